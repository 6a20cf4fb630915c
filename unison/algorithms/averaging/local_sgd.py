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
blocking), and across nodes only every ``period`` steps: the node averages
inside, each local rank averages its shard with the other nodes', the node
gathers the shards (``engine.hierarchy.TwoLevel``), so a node's link carries one copy per
node. Parameters and
floating-point buffers (BatchNorm statistics) are averaged; the optimizers'
states stay local. Under ``fault_tolerant=True`` over FSDP2 a blocking average
is held (a copy of the local shards, while it travels) until every process of
the node has completed its own (``Replica.commit``): a node applies it on all
its shards or on none.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ...engine.averaging import AsyncAverage, average_
from ...engine.comm import Finished, Waitable
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Recovery
from ..schedules import StepCount
from ..streaming import Streamed, StreamedState, fragments_of, write_average


class LocalSGDState(StreamedState):
    """The step count, the node's private group (hierarchical only), the fragments and their averages in flight."""

    __slots__ = ("intra", "fragments", "group")

    def __init__(
        self, count: StepCount, intra: Optional[dist.ProcessGroup], fragments: list[list[torch.Tensor]]
    ) -> None:
        super().__init__(count)
        self.intra, self.fragments = intra, fragments
        self.group: Optional[dist.ProcessGroup] = None  # the averages' private group


class LocalSGD(Streamed[LocalSGDState]):
    """Periodic weight averaging after a synchronous warm-up.

    Args:
        period: average the weights every this many steps (alias
            ``communication_interval``).
        warmup_steps: steps of synchronous gradient averaging first.
        hierarchical: also average inside each node every ``local_period`` steps; the
            periodic averages cross nodes once per node (shards of the node's mean).
        local_period: the node's averaging period (smaller than ``period``).
        fragments, delay: how the averages are streamed (see ``streaming.Streamed``).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="local_sgd:period=8")
    """

    name = "local_sgd"
    replicas_drift = True
    needs_optimizers = True
    stops_gradient_sync = True  # after its warm-up
    recovery = Recovery()  # an interrupted average is dropped: the next one pulls the replicas together
    fsdp2 = FSDP2(fault_tolerant=True)  # the local shards averaged
    period: int = 16
    warmup_steps: int = 0
    hierarchical: bool = False
    local_period: int = 2

    def __post_init__(self) -> None:
        options.integer("period", self.period)
        options.integer("warmup_steps", self.warmup_steps, minimum=0, what="an integer of at least 0")
        options.boolean("hierarchical", self.hierarchical)
        options.integer("local_period", self.local_period)
        if self.hierarchical and self.local_period >= self.period:
            raise ValueError(
                f"local_period ({self.local_period}) must be smaller than period ({self.period}): "
                "nodes average inside more often than across"
            )
        super().__post_init__()

    def setup(self, replica: Replica) -> LocalSGDState:
        self.check_optimizers(replica)
        named = replica.named_parameters + replica.float_buffers
        fragments = [[t for _, t in f] for f in fragments_of(named, self.schedule().fragments)]
        state = LocalSGDState(StepCount(self.period, self.warmup_steps), None, fragments)
        if replica.group is not None:
            state.group = replica.private_group("local_sgd")
            self.use_nodes(replica, state, fragments)
            if state.levels is not None:  # the node's own averages, every local_period steps
                state.intra = replica.private_group("local_sgd/intra", replica.topology.intra_node_group)
            self.stream(replica, state, len(fragments))
        return state

    def sync_gradients(self, replica: Replica, state: LocalSGDState) -> bool:
        return state.count.warming_up

    def after_step(self, replica: Replica, state: LocalSGDState, optimizer: torch.optim.Optimizer) -> None:
        super().after_step(replica, state, optimizer)
        due = replica.step_ended(optimizer) and state.count.due(self.local_period) and not state.count.due()
        if state.intra is not None and state.streams is not None and due:
            tensors = replica.parameters + [b for _, b in replica.float_buffers]
            state.bytes_sent += average_(tensors, state.intra)

    def launch(self, replica: Replica, state: LocalSGDState, fragment: int) -> tuple[Waitable, Any]:
        """Start averaging ``fragment``; keep its values when the average lands late."""
        tensors = state.fragments[fragment]
        # Lands at once: averaged in place, staged by chunks; unless the node decides whether it is
        # applied (``commits_by_node``), which holds its result until then.
        if not state.late and state.levels is None and not replica.commits_by_node:
            state.bytes_sent += average_(tensors, state.group)
            return Finished(None), None
        with torch.no_grad():
            at_launch = [t.detach().clone() for t in tensors] if state.late else None
        if state.levels is not None:  # the node's mean, shards across nodes
            values = at_launch if at_launch is not None else [t.detach().clone() for t in tensors]
            return state.average_nodes(fragment, values), at_launch
        pending = AsyncAverage(tensors, state.group)
        state.bytes_sent += pending.wire_bytes
        return pending, at_launch

    def merge(self, replica: Replica, state: LocalSGDState, fragment: int, result: Any, extra: Any) -> None:
        if result is not None:  # None: averaged in place at the launch
            write_average(state.fragments[fragment], result, extra)
