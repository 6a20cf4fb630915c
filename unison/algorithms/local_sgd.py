"""Local SGD (post-local SGD): replicas step on their own and average their
weights every ``period`` optimizer steps, after ``warmup_steps`` steps of
ordinary synchronous gradient averaging.

With ``hierarchical=True`` the processes of a node also average among
themselves every ``local_period`` steps (cheap, over the node's fast link),
and across nodes only every ``period`` steps. Parameters and floating-point
buffers (BatchNorm statistics) are averaged; the optimizers' states stay local.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ..engine.averaging import average_
from .base import Algorithm
from .options import Bool, Int
from .periodic import CountedState, StepCount


class LocalSGDState(CountedState):
    """The step count and the node's private group (hierarchical only)."""

    __slots__ = ("count", "intra")

    def __init__(self, count: StepCount, intra: Optional[dist.ProcessGroup]) -> None:
        self.count, self.intra = count, intra


class LocalSGD(Algorithm):
    """Periodic weight averaging after a synchronous warm-up.

    Args:
        period: average the weights every this many steps (alias
            ``communication_interval``).
        warmup_steps: steps of synchronous gradient averaging first.
        hierarchical: also average inside each node every ``local_period`` steps.
        local_period: the node's averaging period (smaller than ``period``).

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

    def validate(self) -> None:
        if self.hierarchical and self.local_period >= self.period:
            raise ValueError(
                f"local_period ({self.local_period}) must be smaller than period ({self.period}): "
                "nodes average inside more often than across"
            )

    def setup(self, replica) -> LocalSGDState:
        super().setup(replica)
        intra = None
        if self.hierarchical and replica.group is not None:
            topo = replica.topology
            if topo.world_size != dist.get_world_size() or replica.group is not dist.group.WORLD:
                raise ValueError("hierarchical local_sgd needs unison.init() and the whole world as its process group")
            intra = replica.private_group("local_sgd/intra", topo.intra_node_group)
        return LocalSGDState(StepCount(self.period, self.warmup_steps), intra)

    def sync_gradients(self, replica, state) -> bool:
        return state.count.warming_up

    def after_step(self, replica, state, optimizer) -> None:
        if not state.count.tick(replica, optimizer) or replica.group is None:
            return
        if state.count.due():
            self._average(replica, state, replica.group)
        elif state.intra is not None and state.count.due(self.local_period):
            self._average(replica, state, state.intra)

    def _average(self, replica, state, group) -> None:
        tensors = replica.parameters + [b for b in replica.buffers if b.is_floating_point()]
        state.bytes_sent += average_(tensors, group)
