"""Decentralized training: replicas average their weights with peers, not their gradients.

Each rank trains on its own gradients (no gradient engine runs) and, every
``period`` training steps, mixes its trainable parameters with those of some
peers right after the optimizer step: all of them (one allreduce), one partner
changing every round (``shift_one``, a round-robin tournament), or its two ring
neighbours (``ring``). Buffers stay local until ``model.average()``.

With ``hierarchical=True`` a round first averages each node inside, then each
local rank mixes its shard of the node's mean with the same shard of the peer
nodes (peers are nodes), and the node gathers the shards (``node_rounds``).

Rounds are streamed as local SGD's averages are (``streaming.Stagger``):
``fragments`` of the weights mix in turn across the period, each round's
messages travel for ``delay`` steps, and when they land every rank adds the
change the round makes to the weights it sent (keeping its local steps).

See docs/algorithms.md#decentralized.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.averaging import AsyncAverage
from ..engine.comm import Waitable
from ..engine.node_average import NodeAverage
from ..replica import Replica
from .gossip import FlatParams, Received, exchange, flat_params_of, ring_neighbours, round_robin_partner
from .options import Choice, Int
from .periodic import StepCount
from .streamed import Streamed, StreamedState, write_average
from .streaming import fragments_of

PEER_SELECTIONS = ("all", "shift_one", "ring")


class DecentralizedState(StreamedState):
    """The step count (it decides the rounds and their pairings), the private group, the
    fragments (for the point-to-point rounds, their flat buffers and receive buffers) and
    the rounds in flight."""

    __slots__ = ("group", "fragments", "flats", "recv")

    def __init__(
        self,
        count: StepCount,
        group: Optional[dist.ProcessGroup] = None,
        fragments: Optional[list[list[torch.Tensor]]] = None,
    ) -> None:
        super().__init__(count)
        self.group = group  # None alone: nothing to mix
        self.fragments = fragments or []  # per fragment, its parameters (or pieces of them)
        self.flats: list[list[FlatParams]] = []  # point to point: per fragment, one flat buffer per dtype and device
        self.recv: list[list[list[torch.Tensor]]] = []  # per fragment and flat buffer, one receive buffer per peer


class Decentralized(Streamed[DecentralizedState]):
    """Weight mixing with peers (all, one rotating partner, or ring neighbours) every ``period`` steps.

    Args:
        peer_selection: ``"all"``, ``"shift_one"`` (even world sizes) or ``"ring"``.
        period: training steps between two rounds, 1 for every step (alias
            ``communication_interval``, Bagua's name).
        fragments, delay: how the rounds are streamed (see ``streaming.Streamed``).
        hierarchical: nodes average inside first; peers are nodes (``shift_one``: an even node count).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="decentralized:peer_selection=ring,period=4")
    """

    name = "decentralized"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    peer_selection = Choice("all", PEER_SELECTIONS)
    period = Int(16, aliases=("communication_interval",))

    def setup(self, replica: Replica) -> DecentralizedState:
        self.check_optimizers(replica)
        world = replica.world_size
        count = StepCount(self.period)
        if not replica.distributed:
            return DecentralizedState(count)
        fragments = fragments_of(replica.trainable, self.schedule().fragments)
        state = DecentralizedState(
            count, replica.private_group("decentralized"), [[p for _, p in f] for f in fragments]
        )
        state.nodes = self.node_rounds(replica, state.fragments)
        if state.nodes is not None:
            levels = state.nodes.levels
            if self.peer_selection == "shift_one" and levels.nodes % 2:
                state.nodes.close()  # the state is never returned: nobody else would close it
                raise ValueError(
                    f"hierarchical decentralized with peer_selection='shift_one' pairs the nodes, so it needs an even "
                    f"number of nodes, got {levels.nodes}; use peer_selection='ring' or 'all'"
                )
            peers = len(self._peers(levels.node, levels.nodes, 0))
            state.recv = [[[k.new_shard() for _ in range(peers)] for k in a.kinds] for a in state.nodes.averages]
        elif (
            self.peer_selection == "shift_one" and world > 1 and world % 2
        ):  # flat (hierarchical too: one node, one per node)
            raise ValueError(
                f"decentralized with peer_selection='shift_one' pairs the ranks, so it needs an even world size, "
                f"got {world}; use peer_selection='ring' or 'all'"
            )
        elif self.peer_selection != "all":
            peers = len(self._peers(replica.rank, replica.world_size, 0))
            state.flats = [flat_params_of(f) for f in fragments]
            state.recv = [[[fl.like() for _ in range(peers)] for fl in flats] for flats in state.flats]
        self.stream(replica, state, len(fragments))
        return state

    def _peers(self, rank: int, world: int, round_index: int) -> list[int]:
        """The ranks (of nodes, hierarchical) ``rank`` mixes with in round ``round_index`` (point to point)."""
        if self.peer_selection == "shift_one" and world > 1:
            return [round_robin_partner(rank, world, round_index)]
        return ring_neighbours(rank, world)

    def launch(self, replica: Replica, state: DecentralizedState, fragment: int) -> tuple[Waitable, Any]:
        """Start ``fragment``'s round: an allreduce for "all", otherwise a point-to-point exchange."""
        f = fragment
        if state.nodes is not None:  # the node's mean, shards mixed across nodes
            with torch.no_grad():
                values = [p.detach().clone() for p in state.fragments[f]]
            round_index = (state.count.steps - 1) // self.period
            return state.nodes.submit(state, f, lambda avg: self._node_round(state, f, avg, values, round_index)), (
                values if state.late else None
            )
        if self.peer_selection == "all":
            with torch.no_grad():
                at_launch = [p.detach().clone() for p in state.fragments[f]] if state.late else None
            pending = AsyncAverage(state.fragments[f], state.group)
            state.bytes_sent += pending.wire_bytes
            return pending, at_launch
        peers = self._peers(replica.rank, replica.world_size, (state.count.steps - 1) // self.period)
        sends, recvs, first = [], [], sum(len(flats) for flats in state.flats[:f])
        for tag, (fl, bufs) in enumerate(zip(state.flats[f], state.recv[f]), start=first):
            mine = fl.gather()  # stays untouched until the merge: the weights at launch
            sends += [(mine, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(bufs, peers)]
            state.bytes_sent += fl.nbytes * len(peers)
        return Received(exchange(sends, recvs, state.group, wait=False), state.recv[f]), [
            fl.flat for fl in state.flats[f]
        ]

    def _node_round(
        self, state: DecentralizedState, f: int, avg: NodeAverage, values: list[torch.Tensor], round_index: int
    ) -> list[torch.Tensor]:
        """On the rounds' thread: the node's mean of ``values``, each shard mixed with the peer nodes'."""
        levels = avg.levels
        if self.peer_selection == "all":
            return [v.clone() for v in avg.run(values)]
        peers = self._peers(levels.node, levels.nodes, round_index)
        pieces = avg.scatter(values)
        sends = [(piece, peer, tag) for tag, piece in enumerate(pieces) for peer in peers]
        recvs = [(buf, peer, tag) for tag, bufs in enumerate(state.recv[f]) for buf, peer in zip(bufs, peers)]
        exchange(sends, recvs, levels.inter)
        avg.inter_bytes += sum(piece.numel() * piece.element_size() for piece in pieces) * len(peers)
        for piece, bufs in zip(pieces, state.recv[f]):
            for buf in bufs:
                piece.add_(buf)
            piece.div_(len(bufs) + 1)
        return [v.clone() for v in avg.gather(pieces)]

    def merge(self, replica: Replica, state: DecentralizedState, fragment: int, result: Any, extra: Any) -> None:
        """Write ``fragment``'s round into the weights (adding the change it makes when it lands late)."""
        f, at_launch = fragment, extra
        if self.peer_selection == "all" or state.nodes is not None:
            write_average(state.fragments[f], result, at_launch)
            return
        with torch.no_grad():
            for fl, bufs, sent in zip(state.flats[f], result, at_launch):
                mix = bufs[0]
                for buf in bufs[1:]:
                    mix.add_(buf)
                if state.late:  # (sent + received) / (k + 1) - sent, added to the weights
                    fl.add_to_params(mix.sub_(sent, alpha=len(bufs)).div_(len(bufs) + 1))
                else:
                    fl.scatter(mix.add_(sent).div_(len(bufs) + 1))
