"""Decentralized training: replicas average their weights with peers, not their gradients.

Each rank trains on its own gradients (no gradient engine runs) and, every
``period`` training steps, mixes its trainable parameters with those of some
peers right after the optimizer step: all of them (one allreduce), one partner
changing every round (``shift_one``, a round-robin tournament), or its two ring
neighbours (``ring``). Buffers stay local until ``model.average()``.

See docs/algorithms.md#decentralized.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.averaging import average_
from .base import Algorithm
from .gossip import FlatParams, exchange, flat_params_of, ring_neighbours, round_robin_partner
from .options import Choice, Int
from .periodic import CountedState, StepCount

PEER_SELECTIONS = ("all", "shift_one", "ring")


class DecentralizedState(CountedState):
    """The step count (it decides the rounds and their pairings), the private group, and the
    flat buffers of the point-to-point rounds."""

    __slots__ = ("count", "group", "flats", "recv")

    def __init__(
        self,
        count: StepCount,
        group: Optional[dist.ProcessGroup] = None,
        flats: Optional[list[FlatParams]] = None,
        recv: Optional[list[list[torch.Tensor]]] = None,
    ) -> None:
        self.count = count
        self.group = group  # None alone: nothing to mix
        self.flats = flats or []  # the trainable parameters, one flat buffer per dtype and device
        self.recv = recv or []  # per flat buffer, one receive buffer per peer

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"steps"})
        if unknown:
            raise ValueError(f"decentralized state has unknown entries {unknown}; expected 'steps'")
        super().load_state_dict(state)


class Decentralized(Algorithm):
    """Weight mixing with peers (all, one rotating partner, or ring neighbours) every ``period`` steps.

    Args:
        peer_selection: ``"all"``, ``"shift_one"`` (even world sizes) or ``"ring"``.
        period: training steps between two rounds, 1 for every step (alias
            ``communication_interval``, Bagua's name).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="decentralized:peer_selection=ring,period=4")
    """

    name = "decentralized"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    peer_selection = Choice("all", PEER_SELECTIONS, doc="who a rank mixes its weights with")
    period = Int(16, aliases=("communication_interval",), doc="training steps between two rounds")

    def setup(self, replica) -> DecentralizedState:
        super().setup(replica)
        world = replica.world_size
        if self.peer_selection == "shift_one" and world > 1 and world % 2:
            raise ValueError(
                f"decentralized with peer_selection='shift_one' pairs the ranks, so it needs an even world size, "
                f"got {world}; use peer_selection='ring' or 'all'"
            )
        count = StepCount(self.period)
        if not replica.distributed:
            return DecentralizedState(count)
        group = replica.private_group("decentralized")
        if self.peer_selection == "all":
            return DecentralizedState(count, group)
        flats = flat_params_of(replica.named_parameters)
        peers = len(self._peers(replica, 0))
        return DecentralizedState(count, group, flats, [[f.like() for _ in range(peers)] for f in flats])

    def after_step(self, replica, state, optimizer) -> None:
        """At the end of every ``period``-th training step, run one mixing round."""
        if state.count.tick(replica, optimizer) and state.group is not None and state.count.due():
            self._round(replica, state, state.count.steps // self.period - 1)

    def _peers(self, replica, round_index: int) -> list[int]:
        """The group ranks this rank mixes with in round ``round_index`` (point-to-point modes)."""
        if self.peer_selection == "shift_one":
            return [round_robin_partner(replica.rank, replica.world_size, round_index)]
        return ring_neighbours(replica.rank, replica.world_size)

    def _round(self, replica, state, round_index: int) -> None:
        """One mixing round: an allreduce for "all", otherwise a point-to-point exchange."""
        if self.peer_selection == "all":
            state.bytes_sent += average_([p for _, p in replica.trainable], state.group)
            return
        peers = self._peers(replica, round_index)
        sends, recvs = [], []
        for tag, (f, bufs) in enumerate(zip(state.flats, state.recv)):
            mine = f.gather()
            sends += [(mine, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(bufs, peers)]
            state.bytes_sent += f.nbytes * len(peers)
        exchange(sends, recvs, state.group)
        for f, bufs in zip(state.flats, state.recv):
            for buf in bufs:
                f.flat.add_(buf)
            f.flat.div_(len(peers) + 1)
            f.scatter(f.flat)
