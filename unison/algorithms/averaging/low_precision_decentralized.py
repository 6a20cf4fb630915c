"""Low-precision decentralized training: ring neighbours exchange 8-bit weight differences.

Each rank keeps a public copy of its weights and replicas of its ring
neighbours' public copies. Every ``period`` steps it sends ``Q(x - public)``
(``unison.engine.codecs``, 8-bit min-max) to both neighbours, adds every
decoded difference to the matching copy, and sets its weights to the average
of the copies in its neighbourhood (Bagua's algorithm). Rounds are streamed
as decentralized's are (``streaming.Stagger``: ``fragments`` in turn, each
round's messages travelling for ``delay`` steps, the local steps taken
meanwhile kept). With ``hierarchical=True`` the node averages inside first and the
ring is one of nodes: each local rank gossips its shard of the node's mean, with
its own copies (``NodeCopies``). ``offload=True`` keeps the copies on the host.
See docs/algorithms.md#low_precision_decentralized and #memory-and-offload.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ...engine.codecs import WHOLE, MinMax8, schedule_for, work_numel
from ...engine.comm import Waitable
from ...engine.flat import Flat, Flats
from ...engine.hierarchy import TwoLevel
from ...engine.offload import keep, pieces
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Recovery
from ..schedules import StepCount
from ..state import State
from ..streaming import Streamed, StreamedState, fragments_of, write_average
from .decentralized import FlatParams, Received, exchange, flat_params_of, ring_neighbours

#: Values per quantization chunk (each has its own float32 min and scale).
CHUNK_SIZE = 1024


class Copies:
    """One flat group's public copy and neighbour replicas (what Bagua's algorithm keeps, one
    each), and its codec. A round's weights at launch and messages are made at its launch and
    dropped at its merge; the codec's work buffer is shared (``scratch``: rounds encode and decode
    one at a time). With ``offload`` the copies live on the host, moved piece by piece at a sync.
    """

    def __init__(
        self, flat: FlatParams, neighbours: list[int], scratch: Callable[[int], torch.Tensor], offload: bool = False
    ) -> None:
        self.flat = flat
        self.hold(flat.gather(), neighbours, scratch, offload)

    def hold(
        self, start: torch.Tensor, neighbours: list[int], scratch: Callable[[int], torch.Tensor], offload: bool
    ) -> None:
        """Public copy and neighbour replicas equal to ``start``; the codec for its size."""
        self.public = keep(start, offload)
        self.replicas = [keep(start, offload) for _ in neighbours]
        self.codec = MinMax8(start.numel(), chunk_size=CHUNK_SIZE, device=start.device, scratch=scratch)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A new message carrying ``Q(x - public)`` (``x`` flat, on the codec's device)."""
        return self.codec.encode_from(x, self.codec.empty(), minus=self.public)

    def inboxes(self, count: int) -> list[torch.Tensor]:
        """New buffers for ``count`` neighbours' messages."""
        return [self.codec.empty() for _ in range(count)]

    def apply(self, sent: torch.Tensor, received: list[torch.Tensor]) -> None:
        """Add the difference ``sent`` carries to the public copy, each received one to its replica."""
        self.codec.decode_add(sent, self.public)
        for copy, message in zip(self.replicas, received):
            self.codec.decode_add(message, copy)

    def mix_into(self, out: torch.Tensor, late: bool = False) -> torch.Tensor:
        """``out`` becomes the average of the public copy and the replicas (``late``: that average
        less ``out``, the weights at launch); returns ``out``. Piece by piece on the CPU and when
        offloaded (a piece at a time on the device); in whole buffers elsewhere (``schedule_for``)."""
        count = len(self.replicas) + 1
        if self.public.device == out.device and schedule_for(out.device) == WHOLE:
            # The copies beside ``out`` (not offloaded): whole buffers, a fixed number of kernels.
            mix = torch.empty_like(out) if late else out
            mix.copy_(self.public)
            for copy in self.replicas:
                mix.add_(copy)
            mix.div_(count)
            if late:
                out.copy_(mix.sub_(out))
            return out
        for part in pieces(out.numel(), out.element_size()):
            mix = torch.empty_like(out[part]) if late else out[part]
            mix.copy_(self.public[part])
            for copy in self.replicas:
                mix.add_(copy[part].to(mix.device, non_blocking=True))
            mix.div_(count)
            if late:
                out[part].copy_(mix.sub_(out[part]))
        return out

    def mixed(self) -> torch.Tensor:
        """The average of the public copy and the replicas, in a new tensor on the codec's device."""
        return self.mix_into(torch.empty(self.public.shape, dtype=self.public.dtype, device=self.codec.device))

    def resend(self, peers: list[int], tag: int, group: Optional[dist.ProcessGroup]) -> int:
        """Overwrite the replicas with the neighbours' public copies, sent in full precision (through
        the codec's device when offloaded); returns the bytes sent."""
        device = self.codec.device
        public = self.public.to(device)
        inbox = [r if r.device == device else torch.empty_like(r, device=device) for r in self.replicas]
        exchange([(public, peer, tag) for peer in peers], list(zip(inbox, peers, [tag] * len(peers))), group)
        for replica, received in zip(self.replicas, inbox):
            if received is not replica:
                replica.copy_(received)
        return public.numel() * public.element_size() * len(peers)


def shared_scratch(numels: list[int], device: torch.device) -> Callable[[int], torch.Tensor]:
    """One float32 work buffer for codecs of ``numels`` values run one at a time (``MinMax8(scratch=)``)."""
    work = torch.empty(max([work_numel(n, 1, CHUNK_SIZE) for n in numels] or [0]), dtype=torch.float32, device=device)
    return lambda n: work


class ShardCopies(Copies):
    """The copies of this local rank's shard of one kind of a fragment (the weights are equal on
    every replica when it is built, so the shard of the node's mean is the shard of the weights)."""

    def __init__(
        self,
        levels: TwoLevel,
        part: Flat,
        neighbours: list[int],
        scratch: Callable[[int], torch.Tensor],
        offload: bool = False,
    ) -> None:
        start, end = levels.shard(levels.bounds(part.flat.numel()))
        part.load()
        self.hold(part.flat[start:end], neighbours, scratch, offload)


class NodeCopies:
    """Hierarchical low_precision_decentralized: per fragment, the copies of each kind's shard.

    Args:
        levels: the two levels (their thread runs the rounds).
        flats: per fragment, its parameters' buffers on them.
        offload: keep the copies on the host.
    """

    def __init__(self, levels: TwoLevel, flats: list[Flats], offload: bool = False) -> None:
        self.levels, self.flats, self.neighbours = levels, flats, ring_neighbours(levels.node, levels.nodes)
        self.layout = [levels.nodes, levels.local_size, levels.local_rank]
        bounds = [levels.shard(levels.bounds(part.flat.numel())) for f in flats for part in f.parts]
        device = flats[0].parts[0].flat.device if flats else torch.device("cpu")
        scratch = shared_scratch([end - start for start, end in bounds], device)
        self.copies = [
            [ShardCopies(levels, part, self.neighbours, scratch, offload) for part in f.parts] for f in flats
        ]
        self.refresh = False  # the next round first resends the public copies in full precision

    def launch(self, meter: State, f: int, values: list[torch.Tensor]) -> Any:
        """Fragment ``f``'s round on the levels' thread; ``wait()`` gives the mixed weights."""
        return self.levels.submit(self._round, f, values, meter=meter)

    def _round(self, f: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        levels = self.levels
        if self.refresh:
            self._refresh()
        sends, recvs, peers, messages = [], [], self.neighbours, []
        for tag, (c, piece) in enumerate(zip(self.copies[f], levels.mean_shards(self.flats[f], values))):
            send, received = c.encode(piece), c.inboxes(len(peers))
            sends += [(send, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(received, peers)]
            messages.append((send, received))
            levels.inter_bytes += c.codec.nbytes * len(peers)
        exchange(sends, recvs, levels.inter)
        for c, (send, received) in zip(self.copies[f], messages):
            c.apply(send, received)
        return [v.clone() for v in levels.join_shards(self.flats[f], [c.mixed() for c in self.copies[f]])]

    def _refresh(self) -> None:
        """Overwrite the replicas with the neighbour nodes' public copies, sent in full precision."""
        for tag, c in enumerate(c for fragment in self.copies for c in fragment):
            self.levels.inter_bytes += c.resend(self.neighbours, tag, self.levels.inter)
        self.refresh = False

    def state_dict(self) -> dict[str, Any]:
        """The layout, and per fragment and kind the shard's public copy and replicas (by neighbour node)."""
        return {
            "layout": list(self.layout),
            "public": [[c.public.clone() for c in f] for f in self.copies],
            "replicas": [[{n: r.clone() for n, r in zip(self.neighbours, c.replicas)} for c in f] for f in self.copies],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["layout"]) != self.layout:
            raise ValueError(
                f"this hierarchical low_precision_decentralized state was saved on {state['layout']} "
                f"(nodes, processes per node, local rank), this run is {self.layout}: its shards do not match"
            )
        for f, public, replicas in zip(self.copies, state["public"], state["replicas"]):
            for c, p, r in zip(f, public, replicas):
                c.public.copy_(p)
                for n, copy in zip(self.neighbours, c.replicas):
                    copy.copy_(r[n])
        self.refresh = True


class LowPrecisionState(StreamedState):
    """The step count, the ring neighbours, each flat group's copies, and a pending refresh."""

    __slots__ = ("rank", "group", "neighbours", "copies", "refresh", "loaded", "fragments", "node_copies")

    def __init__(
        self,
        count: StepCount,
        rank: int,
        group: Optional[dist.ProcessGroup] = None,
        neighbours: Optional[list[int]] = None,
        copies: Optional[list[Copies]] = None,
    ) -> None:
        super().__init__(count)
        self.rank, self.group = rank, group
        self.neighbours = neighbours or []
        self.copies = copies or []
        self.refresh = False  # the next round first resends the public copies in full precision
        self.loaded: dict[str, Any] = {}  # a loaded state kept as it is (alone: nothing to restore into)
        self.fragments: list[list[int]] = []  # per fragment, the indices of its copies
        self.node_copies: Optional[NodeCopies] = None  # hierarchical: the copies of this rank's shards

    def state_dict(self) -> dict[str, Any]:
        """Step count, public copy and replicas (by neighbour rank), per parameter name (hierarchical:
        the layout and this rank's shards' copies, under ``nodes``)."""
        if not self.copies and self.node_copies is None:
            return {"steps": self.count.steps, **self.loaded}
        in_flight = self.streams.state_dict() if self.streams else []  # first: hierarchical rounds update the copies
        out: dict[str, Any] = {"steps": self.count.steps, "rank": self.rank}
        if self.node_copies is not None:
            out["nodes"] = self.node_copies.state_dict()
        else:
            public: dict[str, torch.Tensor] = {}
            replicas: dict[int, dict[str, torch.Tensor]] = {peer: {} for peer in self.neighbours}
            for c in self.copies:
                public.update(c.flat.by_name(c.public))
                for peer, replica in zip(self.neighbours, c.replicas):
                    replicas[peer].update(c.flat.by_name(replica))
            out.update(public=public, replicas=replicas)
        return {**out, "in_flight": in_flight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the count and copies; the next round refreshes the replicas (see the docs)."""
        unknown = sorted(set(state) - {"steps", "rank", "public", "replicas", "in_flight", "nodes"})
        if unknown:
            raise ValueError(
                f"low_precision_decentralized state has unknown entries {unknown}; expected steps, rank, public, replicas, in_flight"
            )
        self.count.steps = int(state["steps"])
        loaded: dict[str, Any] = {k: state[k] for k in ("rank", "public", "replicas", "nodes") if k in state}
        if not self.copies and self.node_copies is None:
            self.loaded = loaded
            return
        if ("nodes" in loaded and self.node_copies is None) or ("public" in loaded and self.node_copies is not None):
            raise ValueError("a hierarchical low_precision_decentralized state loads only into a hierarchical one")
        if self.streams:
            self.streams.load_state_dict(state.get("in_flight", []))
        if self.node_copies is not None and "nodes" in loaded:
            self.node_copies.load_state_dict(loaded["nodes"])
        if "public" not in loaded:
            return
        same_ring = loaded.get("rank") == self.rank and sorted(loaded.get("replicas", {})) == sorted(self.neighbours)
        for c in self.copies:
            c.flat.from_names(c.public, loaded["public"], "public copy")
            if same_ring:
                for peer, replica in zip(self.neighbours, c.replicas):
                    c.flat.from_names(replica, loaded["replicas"][peer], f"replica of rank {peer}")
        self.refresh = True


class LowPrecisionDecentralized(Streamed[LowPrecisionState]):
    """Ring gossip of 8-bit compressed weight differences with neighbour replicas (Bagua's algorithm).

    Memory: the public copy and one replica per distinct ring neighbour (+2 P with two ranks,
    +3 P on a ring of three or more, as Bagua's), and while a round travels its weights at launch
    and 8-bit messages (a fragment's). ``offload=True`` keeps the copies on the host.

    Args:
        period: optimizer steps between two rounds (1: every step); alias
            ``communication_interval`` (Bagua's name).
        fragments, delay, hierarchical: see ``streaming.Streamed`` (hierarchical: the ring is of nodes).
        offload: keep the public copy and the replicas in host memory (pinned with CUDA), moved
            to the parameters' device piece by piece at a round; nothing changes on CPU.

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="low_precision_decentralized:period=4")
    """

    name = "low_precision_decentralized"
    reduces_gradients = False
    replicas_drift = True
    needs_optimizers = True
    # A load makes the next round resend the copies in full: under a heal, every member loads again.
    recovery = Recovery(reload_after_heal=True)
    fsdp2 = FSDP2()  # the local shards gossiped
    period: int = 16
    offload: bool = False

    def __post_init__(self) -> None:
        options.integer("period", self.period)
        options.boolean("offload", self.offload)
        super().__post_init__()

    def setup(self, replica: Replica) -> LowPrecisionState:
        self.check_optimizers(replica)
        count = StepCount(self.period)
        if not replica.distributed:
            return LowPrecisionState(count, replica.rank)
        state = LowPrecisionState(count, replica.rank, replica.private_group(self.name))
        parts = [[p for _, p in f] for f in fragments_of(replica.trainable, self.schedule().fragments)]
        self.use_nodes(replica, state, parts)
        if state.levels is not None:
            state.node_copies = NodeCopies(state.levels, state.node_flats, self.offload)
            self.stream(replica, state, len(parts))
            return state
        neighbours = ring_neighbours(replica.rank, replica.world_size)
        flats_by_fragment = [
            flat_params_of(piece) for piece in fragments_of(replica.trainable, self.schedule().fragments)
        ]
        by_device: dict[torch.device, list[int]] = {}
        for fl in (fl for flats in flats_by_fragment for fl in flats):
            by_device.setdefault(fl.device, []).append(fl.numel)
        scratch = {device: shared_scratch(numels, device) for device, numels in by_device.items()}
        copies: list[Copies] = []
        fragments: list[list[int]] = []
        for flats in flats_by_fragment:
            fragments.append(list(range(len(copies), len(copies) + len(flats))))
            copies += [Copies(f, neighbours, scratch[f.device], self.offload) for f in flats]
        state.neighbours, state.copies, state.fragments = neighbours, copies, fragments
        self.stream(replica, state, len(fragments))
        return state

    def launch(self, replica: Replica, state: LowPrecisionState, fragment: int) -> tuple[Waitable, Any]:
        """Send ``fragment``'s 8-bit differences and start receiving the neighbours'."""
        f = fragment
        if state.node_copies is not None:  # shards of the node's mean, across nodes
            with torch.no_grad():
                values = [p.detach().clone() for p in state.node_flats[f].tensors]
            return state.node_copies.launch(state, f, values), values if state.late else None
        if state.refresh:
            self._refresh_replicas(state)
        sends, recvs, peers = [], [], state.neighbours
        messages, at_launch = [], []
        for tag in state.fragments[f]:
            c = state.copies[tag]
            x0 = c.flat.gather()  # the weights at launch, kept until the merge
            send, received = c.encode(x0), c.inboxes(len(peers))
            sends += [(send, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(received, peers)]
            state.bytes_sent += c.codec.nbytes * len(peers)
            messages.append([send, *received])
            at_launch.append(x0)
        return Received(exchange(sends, recvs, state.group, wait=False), messages), at_launch

    def merge(self, replica: Replica, state: LowPrecisionState, fragment: int, result: Any, extra: Any) -> None:
        """Apply the differences to the copies, then mix (adding the change to the weights when late)."""
        f, messages, at_launch = fragment, result, extra
        if state.levels is not None:  # the mixed weights, gathered in the node
            write_average(state.node_flats[f].tensors, result, at_launch)
            return
        for tag, (sent, *received), x0 in zip(state.fragments[f], messages, at_launch):
            c = state.copies[tag]
            c.apply(sent, received)
            c.mix_into(x0, late=state.late)  # the mix, or (late) the change it makes to the weights at launch
            if state.late:
                c.flat.add_to_params(x0)
            else:
                c.flat.scatter(x0)

    def _refresh_replicas(self, state: LowPrecisionState) -> None:
        """Overwrite the replicas with the neighbours' public copies, sent in full precision."""
        for tag, c in enumerate(state.copies):
            state.bytes_sent += c.resend(state.neighbours, tag, state.group)
        state.refresh = False
