"""Decentralized training: replicas average their weights with peers, not their gradients.

Each rank trains on its own gradients (no gradient engine runs) and, every
``period`` training steps, mixes its trainable parameters with those of some
peers right after the optimizer step: all of them (one allreduce), one partner
changing every round (``shift_one``, a round-robin tournament), or its two ring
neighbours (``ring``). Buffers stay local until ``model.average()``.

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
from .base import Algorithm
from .gossip import FlatParams, Received, exchange, flat_params_of, ring_neighbours, round_robin_partner
from .options import Choice, Int
from .periodic import CountedState, StepCount
from .streaming import Stagger, Streamed, Streams, fragments_of, resolve

PEER_SELECTIONS = ("all", "shift_one", "ring")


class DecentralizedState(CountedState):
    """The step count (it decides the rounds and their pairings), the private group, the
    fragments (for the point-to-point rounds, their flat buffers and receive buffers) and
    the rounds in flight."""

    __slots__ = ("count", "group", "fragments", "flats", "recv", "streams")

    def __init__(self, count: StepCount, group: Optional[dist.ProcessGroup] = None, fragments: Optional[list] = None) -> None:
        self.count = count
        self.group = group  # None alone: nothing to mix
        self.fragments = fragments or []  # per fragment, its parameters (or pieces of them)
        self.flats: list[list[FlatParams]] = []  # point to point: per fragment, one flat buffer per dtype and device
        self.recv: list[list[list[torch.Tensor]]] = []  # per fragment and flat buffer, one receive buffer per peer
        self.streams: Optional[Streams] = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.count.state_dict(), "in_flight": self.streams.state_dict() if self.streams else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"steps", "in_flight"})
        if unknown:
            raise ValueError(f"decentralized state has unknown entries {unknown}; expected 'steps' and 'in_flight'")
        self.count.load_state_dict(state)
        if self.streams:
            self.streams.load_state_dict(state.get("in_flight", []))


class Decentralized(Streamed, Algorithm):
    """Weight mixing with peers (all, one rotating partner, or ring neighbours) every ``period`` steps.

    Args:
        peer_selection: ``"all"``, ``"shift_one"`` (even world sizes) or ``"ring"``.
        period: training steps between two rounds, 1 for every step (alias
            ``communication_interval``, Bagua's name).
        fragments: fragments of the weights mixed in turn (default ``min(4, period)``).
        delay: steps a round's messages travel before they are merged (default
            ``period // fragments // 2``; 0 blocks).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="decentralized:peer_selection=ring,period=4")
    """

    name = "decentralized"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    peer_selection = Choice("all", PEER_SELECTIONS, doc="who a rank mixes its weights with")
    period = Int(16, aliases=("communication_interval",), doc="training steps between two rounds")
    fragments = Int(None, optional=True, doc="fragments of the weights mixed in turn (None: min(4, period))")
    delay = Int(None, minimum=0, optional=True, doc="steps a round travels before it is merged (None: period // fragments // 2)")

    def validate(self) -> None:
        self.stagger = resolve(self.period, self.fragments, self.delay)  # refuses fragments > period, delay >= period

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
        fragments = fragments_of(replica.trainable, self.stagger.fragments)
        state = DecentralizedState(count, replica.private_group("decentralized"), [[p for _, p in f] for f in fragments])
        if self.peer_selection != "all":
            peers = len(self._peers(replica, 0))
            state.flats = [flat_params_of(f) for f in fragments]
            state.recv = [[[fl.like() for _ in range(peers)] for fl in flats] for flats in state.flats]
        stagger = Stagger(self.period, len(fragments), self.stagger.delay)
        state.streams = Streams(stagger, lambda f: self._launch(replica, state, f), lambda f, result, at: self._merge(state, f, result, at))
        return state

    def after_step(self, replica, state, optimizer) -> None:
        """After a training step: merge the rounds due, launch the fragments due."""
        if state.count.tick(replica, optimizer) and state.streams is not None:
            state.streams.advance(state.count.steps)

    def _peers(self, replica, round_index: int) -> list[int]:
        """The group ranks this rank mixes with in round ``round_index`` (point-to-point modes)."""
        if self.peer_selection == "shift_one":
            return [round_robin_partner(replica.rank, replica.world_size, round_index)]
        return ring_neighbours(replica.rank, replica.world_size)

    def _launch(self, replica, state, f: int):
        """Start fragment ``f``'s round: an allreduce for "all", otherwise a point-to-point exchange."""
        late = self.stagger.delay > 0
        if self.peer_selection == "all":
            with torch.no_grad():
                at_launch = [p.detach().clone() for p in state.fragments[f]] if late else None
            pending = AsyncAverage(state.fragments[f], state.group)
            state.bytes_sent += pending.wire_bytes
            return pending, at_launch
        peers = self._peers(replica, (state.count.steps - 1) // self.period)
        sends, recvs, first = [], [], sum(len(flats) for flats in state.flats[:f])
        for tag, (fl, bufs) in enumerate(zip(state.flats[f], state.recv[f]), start=first):
            mine = fl.gather()  # stays untouched until the merge: the weights at launch
            sends += [(mine, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(bufs, peers)]
            state.bytes_sent += fl.nbytes * len(peers)
        return Received(exchange(sends, recvs, state.group, wait=False), state.recv[f]), [fl.flat for fl in state.flats[f]]

    def _merge(self, state, f: int, result, at_launch) -> None:
        """Write fragment ``f``'s round into the weights (adding the change it makes when it lands late)."""
        late = self.stagger.delay > 0
        with torch.no_grad():
            if self.peer_selection == "all":
                if late:  # keep the local steps taken while the round travelled
                    torch._foreach_sub_(result, at_launch)
                    torch._foreach_add_(state.fragments[f], result)
                else:
                    torch._foreach_copy_(state.fragments[f], result)
                return
            for fl, bufs, sent in zip(state.flats[f], result, at_launch):
                mix = bufs[0]
                for buf in bufs[1:]:
                    mix.add_(buf)
                if late:  # (sent + received) / (k + 1) - sent, added to the weights
                    fl.add_to_params(mix.sub_(sent, alpha=len(bufs)).div_(len(bufs) + 1))
                else:
                    fl.scatter(mix.add_(sent).div_(len(bufs) + 1))
