"""Local SGD (post-local SGD): replicas step on their own and average their
weights every ``period`` optimizer steps, after ``warmup_steps`` steps of
ordinary synchronous gradient averaging.

The averages are streamed (``streaming.Stagger``): the weights are cut into
``fragments`` averaged in turn across the period, and each average travels
for ``delay`` steps while training goes on; when it lands, every rank keeps
the local steps it took meanwhile (``weights + average - weights_at_launch``).
``fragments=1, delay=0`` is the classic blocking average every ``period`` steps.

With ``hierarchical=True`` the processes of a node also average among
themselves every ``local_period`` steps (cheap, over the node's fast link, and
blocking), and across nodes only every ``period`` steps. Parameters and
floating-point buffers (BatchNorm statistics) are averaged; the optimizers'
states stay local.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.averaging import AsyncAverage, average_
from .base import Algorithm
from .options import Bool, Int
from .periodic import CountedState, StepCount
from .streaming import Stagger, Streamed, Streams, fragments_of, resolve


class LocalSGDState(CountedState):
    """The step count, the node's private group (hierarchical only), the fragments and their averages in flight."""

    __slots__ = ("count", "intra", "fragments", "streams")

    def __init__(self, count: StepCount, intra: Optional[dist.ProcessGroup], fragments: list[list[torch.Tensor]]) -> None:
        self.count, self.intra, self.fragments = count, intra, fragments
        self.streams: Optional[Streams] = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.count.state_dict(), "in_flight": self.streams.state_dict() if self.streams else []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.load_state_dict(state)
        if self.streams:
            self.streams.load_state_dict(state.get("in_flight", []))


class LocalSGD(Streamed, Algorithm):
    """Periodic weight averaging after a synchronous warm-up.

    Args:
        period: average the weights every this many steps (alias
            ``communication_interval``).
        warmup_steps: steps of synchronous gradient averaging first.
        hierarchical: also average inside each node every ``local_period`` steps.
        local_period: the node's averaging period (smaller than ``period``).
        fragments: how many fragments of the weights are averaged in turn across
            the period (default ``min(4, period)``).
        delay: steps an average travels before it lands, less than ``period``
            (default ``period // fragments // 2``; 0 blocks).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="local_sgd:period=8")
    """

    name = "local_sgd"
    replicas_drift = True
    needs_optimizers = True
    period = Int(16, aliases=("communication_interval",), doc="steps between two averages")
    warmup_steps = Int(0, minimum=0, what="an integer of at least 0", doc="steps of synchronous gradient averaging first")
    hierarchical = Bool(False, doc="also average inside each node every local_period steps")
    local_period = Int(2, doc="steps between two averages inside a node")
    fragments = Int(None, optional=True, doc="fragments of the weights averaged in turn (None: min(4, period))")
    delay = Int(None, minimum=0, optional=True, doc="steps an average travels before it lands (None: period // fragments // 2)")

    def validate(self) -> None:
        if self.hierarchical and self.local_period >= self.period:
            raise ValueError(
                f"local_period ({self.local_period}) must be smaller than period ({self.period}): "
                "nodes average inside more often than across"
            )
        self.stagger = resolve(self.period, self.fragments, self.delay)  # refuses fragments > period, delay >= period

    def setup(self, replica) -> LocalSGDState:
        super().setup(replica)
        intra = None
        if self.hierarchical and replica.group is not None:
            topo = replica.topology
            if topo.world_size != dist.get_world_size() or replica.group is not dist.group.WORLD:
                raise ValueError("hierarchical local_sgd needs unison.init() and the whole world as its process group")
            intra = replica.private_group("local_sgd/intra", topo.intra_node_group)
        named = list(replica.named_parameters) + [(n, b) for n, b in replica.named_buffers if b.is_floating_point()]
        state = LocalSGDState(StepCount(self.period, self.warmup_steps), intra, [[t for _, t in f] for f in fragments_of(named, self.stagger.fragments)])
        if replica.group is not None:
            group = replica.private_group("local_sgd")
            stagger = Stagger(self.period, len(state.fragments), self.stagger.delay)
            state.streams = Streams(stagger, lambda f: self._launch(state, group, f), lambda f, avg, at: self._merge(state, f, avg, at))
        return state

    def sync_gradients(self, replica, state) -> bool:
        return state.count.warming_up

    def after_step(self, replica, state, optimizer) -> None:
        if not state.count.tick(replica, optimizer) or state.streams is None:
            return
        state.streams.advance(state.count.local_steps)
        if state.intra is not None and state.count.due(self.local_period) and not state.count.due():
            state.bytes_sent += average_(replica.parameters + [b for b in replica.buffers if b.is_floating_point()], state.intra)

    def _launch(self, state: LocalSGDState, group, f: int):
        """Start averaging fragment ``f``; keep its values when the average lands late."""
        tensors = state.fragments[f]
        with torch.no_grad():
            at_launch = [t.detach().clone() for t in tensors] if self.stagger.delay else None
        pending = AsyncAverage(tensors, group)
        state.bytes_sent += pending.wire_bytes
        return pending, at_launch

    def _merge(self, state: LocalSGDState, f: int, averaged: list[torch.Tensor], at_launch) -> None:
        with torch.no_grad():
            if at_launch is None:
                torch._foreach_copy_(state.fragments[f], averaged)
            else:  # keep the local steps taken while the average travelled
                torch._foreach_sub_(averaged, at_launch)
                torch._foreach_add_(state.fragments[f], averaged)
