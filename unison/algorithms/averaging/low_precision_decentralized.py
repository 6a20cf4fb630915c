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
its own copies (``NodeCopies``).
See docs/algorithms.md#low_precision_decentralized.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ...engine.codecs import MinMax8
from ...engine.comm import Waitable
from ...engine.flat import Flat, Flats
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..schedules import StepCount
from ..state import State
from ..streaming import Streamed, StreamedState, fragments_of, write_average
from .decentralized import FlatParams, Received, exchange, flat_params_of, ring_neighbours

#: Values per quantization chunk (each has its own float32 min and scale).
CHUNK_SIZE = 1024


class Copies:
    """One flat group's public copy, neighbour replicas, codec and message buffers."""

    def __init__(self, flat: FlatParams, neighbours: list[int]) -> None:
        self.flat = flat
        self.hold(flat.gather(), neighbours)

    def hold(self, start: torch.Tensor, neighbours: list[int]) -> None:
        """Public copy and neighbour replicas equal to ``start``; the codec and buffers for its size."""
        self.public = start.clone()
        self.replicas = [start.clone() for _ in neighbours]
        self.codec = MinMax8(start.numel(), chunk_size=CHUNK_SIZE, device=start.device)
        self.send = self.codec.empty()
        self.received = [self.codec.empty() for _ in neighbours]
        self.mix = torch.empty_like(start)

    def decoded(self, message: torch.Tensor) -> torch.Tensor:
        """The difference ``message`` carries (a view of the codec's buffer, valid until the next call)."""
        return self.codec.decode(message).view(-1)[: self.public.numel()]

    def mixed(self) -> torch.Tensor:
        """The average of the public copy and the replicas, in ``mix``."""
        self.mix.copy_(self.public)
        for copy in self.replicas:
            self.mix.add_(copy)
        return self.mix.div_(len(self.replicas) + 1)


class ShardCopies(Copies):
    """The copies of this local rank's shard of one kind of a fragment (the weights are equal on
    every replica when it is built, so the shard of the node's mean is the shard of the weights)."""

    def __init__(self, levels: TwoLevel, part: Flat, neighbours: list[int]) -> None:
        start, end = levels.shard(levels.bounds(part.flat.numel()))
        part.load()
        self.hold(part.flat[start:end], neighbours)


class NodeCopies:
    """Hierarchical low_precision_decentralized: per fragment, the copies of each kind's shard.

    Args:
        levels: the two levels (their thread runs the rounds).
        flats: per fragment, its parameters' buffers on them.
    """

    def __init__(self, levels: TwoLevel, flats: list[Flats]) -> None:
        self.levels, self.flats, self.neighbours = levels, flats, ring_neighbours(levels.node, levels.nodes)
        self.layout = [levels.nodes, levels.local_size, levels.local_rank]
        self.copies = [[ShardCopies(levels, part, self.neighbours) for part in f.parts] for f in flats]
        self.refresh = False  # the next round first resends the public copies in full precision

    def launch(self, meter: State, f: int, values: list[torch.Tensor]) -> Any:
        """Fragment ``f``'s round on the levels' thread; ``wait()`` gives the mixed weights."""
        return self.levels.submit(self._round, f, values, meter=meter)

    def _round(self, f: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        levels = self.levels
        if self.refresh:
            self._refresh()
        sends, recvs, peers = [], [], self.neighbours
        for tag, (c, piece) in enumerate(zip(self.copies[f], levels.mean_shards(self.flats[f], values))):
            c.codec.encode(c.codec.load(piece, minus=c.public), c.send)
            sends += [(c.send, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(c.received, peers)]
            levels.inter_bytes += c.codec.nbytes * len(peers)
        exchange(sends, recvs, levels.inter)
        for c in self.copies[f]:
            c.public.add_(c.decoded(c.send))
            for copy, message in zip(c.replicas, c.received):
                copy.add_(c.decoded(message))
        return [v.clone() for v in levels.join_shards(self.flats[f], [c.mixed() for c in self.copies[f]])]

    def _refresh(self) -> None:
        """Overwrite the replicas with the neighbour nodes' public copies, sent in full precision."""
        sends, recvs = [], []
        for tag, c in enumerate(c for fragment in self.copies for c in fragment):
            sends += [(c.public, peer, tag) for peer in self.neighbours]
            recvs += [(replica, peer, tag) for replica, peer in zip(c.replicas, self.neighbours)]
            self.levels.inter_bytes += c.public.numel() * c.public.element_size() * len(self.neighbours)
        exchange(sends, recvs, self.levels.inter)
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

    Args:
        period: optimizer steps between two rounds (1: every step); alias
            ``communication_interval`` (Bagua's name).
        fragments, delay, hierarchical: see ``streaming.Streamed`` (hierarchical: the ring is of nodes).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="low_precision_decentralized:period=4")
    """

    name = "low_precision_decentralized"
    reduces_gradients = False
    replicas_drift = True
    needs_optimizers = True
    loads_everywhere = True  # a load makes the next round resend in full: under a heal, every member loads
    period: int = 16

    def __post_init__(self) -> None:
        options.integer("period", self.period)
        super().__post_init__()

    def setup(self, replica: Replica) -> LowPrecisionState:
        self.check_optimizers(replica)
        count = StepCount(self.period)
        if not replica.distributed:
            return LowPrecisionState(count, replica.rank)
        state = LowPrecisionState(count, replica.rank, replica.private_group(self.name))
        pieces = [[p for _, p in f] for f in fragments_of(replica.trainable, self.schedule().fragments)]
        self.use_nodes(replica, state, pieces)
        if state.levels is not None:
            state.node_copies = NodeCopies(state.levels, state.node_flats)
            self.stream(replica, state, len(pieces))
            return state
        neighbours = ring_neighbours(replica.rank, replica.world_size)
        copies: list[Copies] = []
        fragments: list[list[int]] = []
        for piece in fragments_of(replica.trainable, self.schedule().fragments):
            flats = flat_params_of(piece)
            fragments.append(list(range(len(copies), len(copies) + len(flats))))
            copies += [Copies(f, neighbours) for f in flats]
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
        for tag in state.fragments[f]:
            c = state.copies[tag]
            c.codec.encode(c.codec.load(c.flat.gather(), minus=c.public), c.send)  # c.flat.flat: the weights at launch
            sends += [(c.send, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(c.received, peers)]
            state.bytes_sent += c.codec.nbytes * len(peers)
        copies = [state.copies[tag] for tag in state.fragments[f]]
        return Received(exchange(sends, recvs, state.group, wait=False), [[c.send, *c.received] for c in copies]), [
            c.flat.flat for c in copies
        ]

    def merge(self, replica: Replica, state: LowPrecisionState, fragment: int, result: Any, extra: Any) -> None:
        """Apply the differences to the copies, then mix (adding the change to the weights when late)."""
        f, messages, at_launch = fragment, result, extra
        if state.levels is not None:  # the mixed weights, gathered in the node
            write_average(state.node_flats[f].tensors, result, at_launch)
            return
        for tag, (sent, *received), x0 in zip(state.fragments[f], messages, at_launch):
            c = state.copies[tag]
            c.public.add_(c.decoded(sent))
            for copy, message in zip(c.replicas, received):
                copy.add_(c.decoded(message))
            c.mixed()
            if state.late:
                c.flat.add_to_params(c.mix.sub_(x0))
            else:
                c.flat.scatter(c.mix)

    def _refresh_replicas(self, state: LowPrecisionState) -> None:
        """Overwrite the replicas with the neighbours' public copies, sent in full precision."""
        sends, recvs = [], []
        for tag, c in enumerate(state.copies):
            sends += [(c.public, peer, tag) for peer in state.neighbours]
            recvs += [(replica, peer, tag) for replica, peer in zip(c.replicas, state.neighbours)]
            state.bytes_sent += c.flat.nbytes * len(state.neighbours)
        exchange(sends, recvs, state.group)
        state.refresh = False
