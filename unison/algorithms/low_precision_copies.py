"""The copies of low_precision_decentralized: a public copy of the weights, replicas of
the ring neighbours' public copies, and the 8-bit codec between them.

Flat (``Copies``): one per flat group of parameters, the neighbours are ranks.
Hierarchical (``NodeCopies``): the codec state lives where the compression happens,
on the local rank that carries a shard of its node's mean across nodes: one
``ShardCopies`` per fragment and kind of shard, the neighbours are nodes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.codecs import MinMax8
from ..engine.node_average import NodeAverage, Shards
from .gossip import FlatParams, exchange, ring_neighbours
from .node_rounds import NodeRounds
from .state import State

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

    def __init__(self, shards: Shards, neighbours: list[int]) -> None:
        start = shards.flat.view(-1)[shards.levels.local_rank * shards.size :][: shards.size]
        with torch.no_grad():
            torch._foreach_copy_(shards.views, [t.detach() for t in shards.like])
        self.hold(start, neighbours)


class NodeCopies:
    """Hierarchical low_precision_decentralized: per fragment, the copies of each kind's shard."""

    def __init__(self, rounds: NodeRounds) -> None:
        levels = rounds.levels
        self.rounds, self.neighbours = rounds, ring_neighbours(levels.node, levels.nodes)
        self.layout = [levels.nodes, levels.local_size, levels.local_rank]
        self.copies = [[ShardCopies(k, self.neighbours) for k in a.kinds] for a in rounds.averages]
        self.refresh = False  # the next round first resends the public copies in full precision

    def launch(self, meter: State, f: int, values: list[torch.Tensor]) -> Any:
        """Fragment ``f``'s round on the rounds' thread; ``wait()`` gives the mixed weights."""
        return self.rounds.submit(meter, f, lambda avg: self._round(f, avg, values))

    def _round(self, f: int, avg: NodeAverage, values: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.refresh:
            self._refresh(avg)
        sends, recvs, peers = [], [], self.neighbours
        for tag, (c, piece) in enumerate(zip(self.copies[f], avg.scatter(values))):
            c.codec.encode(c.codec.load(piece, minus=c.public), c.send)
            sends += [(c.send, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(c.received, peers)]
            avg.inter_bytes += c.codec.nbytes * len(peers)
        exchange(sends, recvs, avg.levels.inter)
        for c in self.copies[f]:
            c.public.add_(c.decoded(c.send))
            for copy, message in zip(c.replicas, c.received):
                copy.add_(c.decoded(message))
        return [v.clone() for v in avg.gather([c.mixed() for c in self.copies[f]])]

    def _refresh(self, avg: NodeAverage) -> None:
        """Overwrite the replicas with the neighbour nodes' public copies, sent in full precision."""
        sends, recvs = [], []
        for tag, c in enumerate(c for fragment in self.copies for c in fragment):
            sends += [(c.public, peer, tag) for peer in self.neighbours]
            recvs += [(replica, peer, tag) for replica, peer in zip(c.replicas, self.neighbours)]
            avg.inter_bytes += c.public.numel() * c.public.element_size() * len(self.neighbours)
        exchange(sends, recvs, avg.levels.inter)
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
