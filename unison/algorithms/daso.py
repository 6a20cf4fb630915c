"""DASO: Distributed Asynchronous and Selective Optimization (Coquelin et al., 2022).

Gradients are averaged synchronously inside each node; across nodes the
replicas exchange their weights, rarely, with non-blocking collectives whose
result is merged a few batches later. ``daso_schedule`` says when (phases,
skips, the plateau rule), ``daso_transport`` moves the weights; this module
wires them to the events. See docs/algorithms.md#daso.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine.codecs import WIRE_DTYPES
from ..engine.codecs import wire_dtype as to_wire_dtype
from ..engine.comm import ring_bytes
from ..replica import Replica
from .base import Algorithm, State
from .daso_schedule import Schedule
from .daso_transport import Transport
from .options import Bool, Choice, Int, Number, Option


class DASOState(State):
    """DASO's schedule and transport for one model.

    ``schedule`` holds the counters (``epoch``, ``batch`` in the epoch,
    ``batches``, ``global_skip``, ``local_skip``, ``batches_to_wait``,
    ``pending_sync``, ``syncs_sent``, ``syncs_received``, ``syncs_blocking``,
    ``plateau_bad``); ``bytes_sent`` is what this rank sent.
    """

    __slots__ = ("schedule", "transport", "batch_ended")

    def __init__(self, schedule: Schedule, transport: Transport) -> None:
        super().__init__()
        self.schedule, self.transport = schedule, transport
        transport.meter = self
        self.batch_ended = False  # a batch ended since the last forward or scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batch counters, skips, rotation, plateau tracking, and the sync in flight
        with its reference weights (no new communication)."""
        return {**self.schedule.state_dict(), **self.transport.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)
        self.transport.load_state_dict(state)


class DASO(Algorithm[DASOState]):
    """Node-local gradient averaging every step, stale inter-node weight averaging in rotation.

    Args:
        total_epochs: epochs of training (None: unknown, no cool-down).
        warmup_epochs: blocking epochs first (weights averaged after every batch).
        cooldown_epochs: blocking epochs last (needs ``total_epochs``).
        scheduler: must be None (the training loop steps its schedulers).
        stability_level: relative improvement of the loss that is not a plateau.
        max_global_skips: the most batches between two global syncs.
        sending_chunk_size: elements per collective of a global sync.
        wire_dtype: wire dtype of global syncs ("bf16", "fp16", "fp32" or a torch dtype);
            alias ``downcast_type``, HeAT's name.
        use_mpi_groups: no effect (HeAT's option; torch.distributed groups are used).
        skip_reduction_factor: divides the skips when the loss plateaus.
        local_skip_factor: ``max_global_skips // local_skip_factor`` is the local skip after a reset.
        verbose: print the schedule on rank 0 at every epoch end.

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="daso:total_epochs=90")
        for epoch in range(90):
            loss = train_one_epoch(model)
            model.end_epoch(loss)
    """

    name = "daso"
    replicas_drift = True
    needs_optimizers = True
    total_epochs = Int(None, optional=True)
    warmup_epochs = Int(4, minimum=0)
    cooldown_epochs = Int(4, minimum=0)
    scheduler = Option(None)
    stability_level = Number(0.05, low=0.0, open_low=False, high=1.0)
    max_global_skips = Int(8)
    sending_chunk_size = Int(10_000_000)
    wire_dtype = Choice(
        "bf16", (*WIRE_DTYPES, *WIRE_DTYPES.values()), convert=to_wire_dtype, aliases=("downcast_type",)
    )
    use_mpi_groups = Bool(True)
    skip_reduction_factor = Int(2, minimum=2)
    local_skip_factor = Int(4)
    verbose = Bool(False)

    def validate(self) -> None:
        if self.scheduler is not None:
            raise ValueError(
                "scheduler must be None: unison's DASO does not step schedulers; call scheduler.step() "
                "in your training loop as usual (optimizer.step() still drives DASO)"
            )

    def setup(self, replica: Replica) -> DASOState:
        super().setup(replica)
        wire = None if self.wire_dtype == torch.float32 else self.wire_dtype
        transport = Transport.build(replica, wire, self.sending_chunk_size)
        schedule = Schedule(
            self.warmup_epochs,
            self.cooldown_epochs,
            self.total_epochs,
            self.max_global_skips,
            self.skip_reduction_factor,
            self.local_skip_factor,
            self.stability_level,
            transport.local_size,
            transport.nodes,
        )
        state = DASOState(schedule, transport)
        replica.on_scaler_update(lambda scaler: self._scaler_updated(state))
        return state

    def teardown(self, replica: Replica, state: DASOState) -> None:
        """Let a sync in flight finish (no new collective)."""
        state.transport.drop()
        super().teardown(replica, state)

    def release(self, replica: Replica, state: DASOState) -> None:
        state.transport.inflight = None  # no waiting: the peers may be gone

    def gradient_group(self, replica: Replica, state: DASOState) -> Optional[dist.ProcessGroup]:
        """The node: gradients are averaged inside it only (None with one process per node)."""
        return state.transport.grad_group

    def sync_gradients(self, replica: Replica, state: DASOState) -> bool:
        return state.schedule.sync_gradients()

    # ---- batches ------------------------------------------------------------
    def before_forward(self, replica: Replica, state: DASOState) -> None:
        state.batch_ended = False

    def after_step(self, replica: Replica, state: DASOState, optimizer: torch.optim.Optimizer) -> None:
        """The batch ends once every registered optimizer has stepped."""
        if replica.step_ended(optimizer):
            self._end_batch(state)

    def _scaler_updated(self, state: DASOState) -> None:
        """After ``scaler.update()``: end the batch if the scaler skipped its optimizer step
        (inf/NaN gradients), so this rank's batch count stays with the other nodes'."""
        if not state.batch_ended:
            self._end_batch(state)
        state.batch_ended = False

    def _end_batch(self, state: DASOState) -> None:
        """One batch ended on this rank: block on, merge or start a global sync as scheduled."""
        state.batch_ended = True
        plan, transport = state.schedule.end_batch(), state.transport
        if plan.blocking is not None:
            transport.blocking(plan.blocking)
        if plan.merge is not None:
            transport.receive(plan.merge.local_rank, plan.merge.batches_to_wait)
        if plan.send is not None and transport.local_rank == plan.send.local_rank:
            transport.start()

    # ---- epochs, final sync -------------------------------------------------
    def end_epoch(self, replica: Replica, state: DASOState, loss: Optional[float], averaged: bool) -> None:
        """``model.end_epoch(loss, averaged)``, HeAT's ``epoch_loss_logic``: end the epoch (every rank),
        average the loss (unless ``averaged``), resync if cycling, set the next skips."""
        value = None if loss is None else float(loss)
        mean = value if averaged else _mean_loss(state, value, replica.group)
        k = state.schedule.end_epoch(mean)
        if k is not None:  # a cycling epoch ends: drop the sync in flight, make every replica identical
            state.transport.drop()
            state.transport.blocking(k)
        if self.verbose and replica.rank == 0:
            s = state.schedule
            print(
                f"daso: epoch {s.epoch} loss {mean}: global_skip {s.global_skip}, local_skip {s.local_skip}, "
                f"batches_to_wait {s.batches_to_wait}",
                flush=True,
            )

    def average(self, replica: Replica, state: DASOState) -> None:
        """Every rank drops its sync in flight (after it completes); DataParallel then averages all weights."""
        state.transport.drop()
        state.transport.anchor = None
        state.schedule.pending_sync = None


def _mean_loss(state: DASOState, loss: Optional[float], group: Optional[dist.ProcessGroup]) -> Optional[float]:
    """The epoch's loss averaged over ``group``'s ranks that gave one (None if none did)."""
    if group is None:
        return loss
    t = torch.tensor([0.0 if loss is None else loss, 0.0 if loss is None else 1.0], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    state.bytes_sent += ring_bytes(t.numel() * t.element_size(), dist.get_world_size(group))
    return t[0].item() / t[1].item() if t[1].item() > 0 else None
