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
its own copies (``low_precision_copies.NodeCopies``).
See docs/algorithms.md#low_precision_decentralized.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.comm import Waitable
from ..replica import Replica
from .gossip import Received, exchange, flat_params_of, ring_neighbours
from .low_precision_copies import Copies, NodeCopies
from .options import Int
from .periodic import StepCount
from .streamed import Streamed, StreamedState, write_average
from .streaming import fragments_of


class LowPrecisionState(StreamedState):
    """The step count, the ring neighbours, each flat group's copies, and a pending refresh."""

    __slots__ = ("rank", "group", "neighbours", "copies", "refresh", "loaded", "fragments", "shards")

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
        self.shards: Optional[NodeCopies] = None  # hierarchical: the copies of this rank's shards

    def state_dict(self) -> dict[str, Any]:
        """Step count, public copy and replicas (by neighbour rank), per parameter name (hierarchical:
        the layout and this rank's shards' copies, under ``nodes``)."""
        if not self.copies and self.shards is None:
            return {"steps": self.count.steps, **self.loaded}
        in_flight = self.streams.state_dict() if self.streams else []  # first: hierarchical rounds update the copies
        out: dict[str, Any] = {"steps": self.count.steps, "rank": self.rank}
        if self.shards is not None:
            out["nodes"] = self.shards.state_dict()
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
        if not self.copies and self.shards is None:
            self.loaded = loaded
            return
        if ("nodes" in loaded and self.shards is None) or ("public" in loaded and self.shards is not None):
            raise ValueError("a hierarchical low_precision_decentralized state loads only into a hierarchical one")
        if self.streams:
            self.streams.load_state_dict(state.get("in_flight", []))
        if self.shards is not None and "nodes" in loaded:
            self.shards.load_state_dict(loaded["nodes"])
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
        fragments, delay, hierarchical: see ``streamed.Streamed`` (hierarchical: the ring is of nodes).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="low_precision_decentralized:period=4")
    """

    name = "low_precision_decentralized"
    reduces_gradients = False
    replicas_drift = True
    needs_optimizers = True
    loads_everywhere = True  # a load makes the next round resend in full: under a heal, every member loads
    period = Int(16, aliases=("communication_interval",))

    def setup(self, replica: Replica) -> LowPrecisionState:
        self.check_optimizers(replica)
        count = StepCount(self.period)
        if not replica.distributed:
            return LowPrecisionState(count, replica.rank)
        state = LowPrecisionState(count, replica.rank, replica.private_group(self.name))
        pieces = [[p for _, p in f] for f in fragments_of(replica.trainable, self.schedule().fragments)]
        state.nodes = self.node_rounds(replica, pieces)
        if state.nodes is not None:
            state.shards = NodeCopies(state.nodes)
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
        if state.shards is not None and state.nodes is not None:  # shards of the node's mean, across nodes
            with torch.no_grad():
                values = [p.detach().clone() for p in state.nodes.averages[f].tensors]
            return state.shards.launch(state, f, values), values if state.late else None
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
        if state.nodes is not None:  # the mixed weights, gathered in the node
            write_average(state.nodes.averages[f].tensors, result, at_launch)
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
