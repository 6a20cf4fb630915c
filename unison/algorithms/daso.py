"""DASO: Distributed Asynchronous and Selective Optimization (Coquelin et al., 2022).

Gradients are averaged synchronously inside each node (the fast link); across
nodes the replicas exchange their *weights*, rarely, with non-blocking
collectives whose result is merged a few batches later while training goes on.

**Groups.** Gradients are averaged over a private copy of the node's group
(``gradient_group``); with one process per node there is no gradient engine.
Weights travel over one inter-node group at a time: the processes with local
rank ``k`` on every node, ``k`` rotating 0, 1, ... with every global sync.
After a sync the process that took part broadcasts the result to the other
processes of its node, so the node's replicas agree again. With a single node
there is nothing to exchange: DASO is then plain synchronous gradient averaging.

**Batches and epochs.** A batch ends when every optimizer given to
``DataParallel`` has stepped (``after_step``). The user calls
``model.end_epoch(loss)`` on every rank at the end of each epoch (HeAT's
``epoch_loss_logic``; ``model.algorithm.epoch_loss_logic(loss,
loss_globally_averaged=True)`` skips the averaging of the loss across ranks).
No ``last_batch`` is needed: the end of an epoch is that call. Without it DASO
never leaves its warm-up (it stays synchronous).

**Phases.** Epoch ``e`` (counted by ``end_epoch``, from 0) is

* *blocking* if ``e < warmup_epochs`` or, when ``total_epochs`` is given,
  ``e >= total_epochs - cooldown_epochs``: after every batch one inter-node
  group averages its weights (blocking) and broadcasts them in its node, so all
  replicas are identical after every step;
* *cycling* otherwise: the batch ``b`` of the epoch (from 0) with
  ``b % global_skip == 0`` starts a non-blocking average of group ``k``'s
  weights; ``B = min(batches_to_wait, global_skip)`` batches later the members
  of group ``k`` merge the (stale) average ``a`` into their current weights
  ``x`` as ``x = (2B x + P a) / (2B + P)`` (``P`` nodes; ``P a`` is the sum of
  the weights sent) and broadcast the result in their node. The node's
  gradient averaging happens on batches with ``b % local_skip == 0`` only
  (every batch when ``local_skip`` is 1); in between, the node's replicas step
  on their own gradients until the next merge realigns them. At the end of a
  cycling epoch (``end_epoch``) a sync still in flight is awaited and dropped,
  and one blocking sync makes every replica identical.

**Skip schedule** (applied by ``end_epoch``, HeAT's rule). Entering the
cycling phase: ``global_skip = min(4, max_global_skips)``, ``local_skip = 1``,
``batches_to_wait = 1``. Then the epoch's loss, averaged over all ranks, feeds
a plateau detector: the loss improves when it is below ``best * (1 -
stability_level)``; after 3 epochs in a row without improvement (HeAT's
patience of 2) the loss is *stable* and the count restarts. When stable:

* if ``global_skip > 1``: ``global_skip //= skip_reduction_factor`` and
  ``local_skip //= skip_reduction_factor`` (both at least 1) and
  ``batches_to_wait -= 1`` (at least 1);
* if ``global_skip == 1``: reset to ``global_skip = max_global_skips``,
  ``local_skip = batches_to_wait = max(1, max_global_skips //
  local_skip_factor)``.

Blocking epochs set all three to 0. ``total_epochs=None`` (the default) means
the length of training is unknown: there is no cool-down, and since every
cycling epoch ends with a blocking sync the replicas are still identical after
the last ``end_epoch``. Give ``total_epochs`` to get HeAT's cool-down.

**Wire format.** Global syncs travel in ``downcast_type`` (bf16 by default),
in chunks of at most ``sending_chunk_size`` elements (whole tensors; a larger
tensor is a chunk by itself). HeAT casts only its blocking syncs and casts the
weights themselves; here every global sync is cast, but what is sent is the
difference between the weights and the last average this inter-node group
agreed on (kept on each member: one extra copy of the weights), so the
rounding error scales with the drift, not with the weights. The first sync of
each group (after set-up, ``average()`` or a checkpoint load) sends the
weights in full precision to establish that reference. ``"fp32"`` sends the
weights themselves. Buffers (BatchNorm statistics) are not part of global
syncs; ``model.average()`` broadcasts them.

**Options kept for HeAT compatibility.** ``use_mpi_groups`` has no effect
(torch.distributed groups are used). ``scheduler`` must be None: in unison the
training loop calls ``optimizer.step()`` and ``scheduler.step()`` itself, as
usual. ``verbose`` prints the schedule on rank 0 at every epoch end.

**Mixed precision.** ``scaler.step(optimizer)`` calls ``optimizer.step()``,
which ends the batch, except when the scaler finds inf/NaN gradients and skips
the step: then that rank's batch count would fall behind the other nodes'.
Call ``model.algorithm.add_scaler(scaler)`` once: the batch then also ends at
``scaler.update()`` when the step was skipped.

**average() and checkpoints.** ``model.average()`` waits for a sync in flight
and drops it (every rank does), then DataParallel averages all weights.
``state_dict()`` holds the epoch, the batch counters, the skips, the rotation
and the plateau tracking; a sync in flight is not saved, so after a load its
merge is skipped on every rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import comm, runtime
from ..averaging import AsyncAverage
from .base import Algorithm, StepCounter, check_int, require_optimizers

_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: HeAT's plateau patience: stable after patience + 1 epochs without improvement.
PATIENCE = 2

#: global_skip on entering the cycling phase (HeAT's constant), capped by max_global_skips.
FIRST_GLOBAL_SKIP = 4

_STATE_KEYS = (
    "epoch",
    "batch",
    "batches",
    "global_skip",
    "local_skip",
    "batches_to_wait",
    "send_rank",
    "plateau_best",
    "plateau_bad",
    "syncs_sent",
    "syncs_received",
    "syncs_blocking",
)


@dataclass(frozen=True)
class PendingSync:
    """A non-blocking global sync started by group ``local_rank``, merged at batch ``receive_at``."""

    local_rank: int
    batches_to_wait: int
    receive_at: int


class DASO(Algorithm):
    """Node-local gradient averaging every step, stale inter-node weight averaging in rotation.

    Readable attributes: ``epoch``, ``batch`` (in the epoch), ``batches``,
    ``global_skip``, ``local_skip``, ``batches_to_wait``, ``pending_sync`` (the
    sync in flight, a PendingSync), ``syncs_sent``, ``syncs_received``,
    ``syncs_blocking`` and ``bytes_sent`` (what this rank sent).
    """

    name = "daso"
    replicas_drift = True
    defaults = {
        "total_epochs": None,
        "warmup_epochs": 4,
        "cooldown_epochs": 4,
        "scheduler": None,
        "stability_level": 0.05,
        "max_global_skips": 8,
        "sending_chunk_size": 10_000_000,
        "downcast_type": "bf16",
        "use_mpi_groups": True,
        "skip_reduction_factor": 2,
        "local_skip_factor": 4,
        "verbose": False,
    }

    def validate(self) -> None:
        """Refuse options HeAT would refuse, and a scheduler (the training loop steps it here)."""
        o = self.options
        if o["total_epochs"] is not None:
            check_int(o, "total_epochs")
        check_int(o, "warmup_epochs", minimum=0)
        check_int(o, "cooldown_epochs", minimum=0)
        check_int(o, "max_global_skips")
        check_int(o, "sending_chunk_size")
        check_int(o, "skip_reduction_factor", minimum=2)
        check_int(o, "local_skip_factor")
        if o["scheduler"] is not None:
            raise ValueError(
                "scheduler must be None: unison's DASO does not step schedulers; call scheduler.step() "
                "in your training loop as usual (optimizer.step() still drives DASO)"
            )
        level = o["stability_level"]
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 <= level < 1:
            raise ValueError(f"stability_level must be a number in [0, 1), got {level!r}")
        if wire_dtype(o["downcast_type"]) is None:
            raise ValueError(
                f"downcast_type must be 'bf16', 'fp16', 'fp32' or torch.bfloat16/float16/float32, got {o['downcast_type']!r}"
            )
        for flag in ("use_mpi_groups", "verbose"):
            if not isinstance(o[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {o[flag]!r}")

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._wire = wire_dtype(self.options["downcast_type"])
        if self._wire == torch.float32:
            self._wire = None
        self.bytes_sent = 0
        self.epoch = 0
        self.batch = 0  # batches ended in the current epoch
        self.batches = 0  # batches ended in all
        self.send_rank = 0  # local rank whose inter-node group syncs next
        self.syncs_sent = self.syncs_received = self.syncs_blocking = 0
        self.plateau_best = math.inf
        self.plateau_bad = 0
        self.pending_sync: Optional[PendingSync] = None
        self._model = None
        self._inflight = None
        self._anchor: Optional[list[torch.Tensor]] = None
        self._counter = StepCounter()
        self._since_update = 0
        self.global_skip = self.local_skip = self.batches_to_wait = 0
        self._enter_epoch()

    # ---- set-up ---------------------------------------------------------
    def setup(self, model) -> None:
        """Private copies of the node's group (gradients, broadcasts) and of this rank's inter-node group."""
        require_optimizers(model, self.name)
        self._model = model
        self._grad_group = self._intra = self._inter = None
        self._local_rank, self._local_size, self._nodes = 0, 1, 1
        if model.process_group is None:
            return
        topo = runtime.topology()
        if topo.world_size != dist.get_world_size():
            raise ValueError("daso needs the node layout: call unison.init() before building DataParallel")
        if dist.get_world_size(model.process_group) != dist.get_world_size():
            raise ValueError("daso runs on the whole world; it cannot be combined with a process_group subset")
        self._local_rank, self._local_size, self._nodes = topo.local_rank, topo.local_world_size, topo.num_nodes
        self._node_ranks = topo.node_ranks()
        tag = f"{model.serial}/daso"
        if self._local_size > 1:
            self._grad_group = comm.private_group(topo.intra_node_group, tag + "/grad")
            if self._nodes > 1:
                self._intra = comm.private_group(topo.intra_node_group, tag + "/intra")
        if self._nodes > 1:
            self._inter = comm.private_group(topo.inter_node_group, tag + "/inter")

    def teardown(self, model) -> None:
        """Let a sync in flight finish (no new collective) and release the model."""
        self._drop_inflight()
        self._model = None
        super().teardown(model)

    def gradient_group(self, model):
        """The node: gradients are averaged inside it only (None with one process per node)."""
        return self._grad_group

    # ---- the step -------------------------------------------------------
    def sync_gradients(self, model) -> bool:
        """Average gradients in the node on every ``local_skip``-th batch of a cycling epoch, else always."""
        if self._inter is None or self.global_skip == 0 or self.local_skip <= 1:
            return True
        return self.batch % self.local_skip == 0

    def after_step(self, model, optimizer) -> None:
        """The batch ends once every registered optimizer has stepped."""
        if self._counter.step_ended(model, optimizer):
            self._end_batch()

    def add_scaler(self, scaler) -> None:
        """End the batch at ``scaler.update()`` when the scaler skipped ``optimizer.step()``.

        A GradScaler that finds inf/NaN gradients does not call the optimizer's
        step, so without this that rank would count one batch less than the
        others and the nodes' schedules would part.
        """
        update = scaler.update

        def update_and_count(*args, **kwargs):
            result = update(*args, **kwargs)
            self._scaler_updated()
            return result

        scaler.update = update_and_count
        self._since_update = 0

    def _scaler_updated(self) -> None:
        """After ``scaler.update()``: end the batch if its optimizer step was skipped."""
        if self._model is not None and (self._counter.pending or self._since_update == 0):
            self._end_batch()
        self._since_update = 0

    def _end_batch(self) -> None:
        """One batch ended on this rank: start, merge or block on a global sync as scheduled."""
        self._counter.pending.clear()
        self._since_update += 1
        b = self.batch
        if self._inter is not None:
            if self.global_skip == 0:
                self._blocking_sync()
            else:
                if self.pending_sync is not None and self.pending_sync.receive_at <= b:
                    self._receive()
                if b % self.global_skip == 0:
                    self._send(b)
        self.batch += 1
        self.batches += 1

    def _rotate(self) -> int:
        """The local rank whose inter-node group syncs now; the next sync goes to the next one."""
        k = self.send_rank % self._local_size
        self.send_rank = (k + 1) % self._local_size
        return k

    def _params(self) -> list[torch.Tensor]:
        """The weights global syncs carry: the trainable parameters."""
        return [p for p in self._model.module.parameters() if p.requires_grad]

    def _send(self, b: int) -> None:
        """Start a non-blocking sync of the next group at batch ``b``; it is merged B batches later."""
        k = self._rotate()
        wait = min(max(1, self.batches_to_wait), self.global_skip)
        if self._local_rank == k:
            self._inflight = self._start_average()
        self.pending_sync = PendingSync(k, wait, b + wait)
        self.syncs_sent += 1

    def _receive(self) -> None:
        """Merge the stale average into the group's weights, (2B x + P a) / (2B + P), and share it in the node."""
        pending, self.pending_sync = self.pending_sync, None
        if self._local_rank == pending.local_rank and self._inflight is not None:
            average = self._finish_average()
            two_b, nodes = 2.0 * pending.batches_to_wait, float(self._nodes)
            with torch.no_grad():
                for p, a in zip(self._params(), average):
                    p.mul_(two_b / (two_b + nodes)).add_(a, alpha=nodes / (two_b + nodes))
        self._node_broadcast(pending.local_rank)
        self.syncs_received += 1

    def _blocking_sync(self) -> None:
        """Replace the next group's weights by their average now and share it in each node."""
        k = self._rotate()
        if self._local_rank == k:
            self._inflight = self._start_average()
            with torch.no_grad():
                for p, a in zip(self._params(), self._finish_average()):
                    p.copy_(a)
        self._node_broadcast(k)
        self.syncs_blocking += 1

    def _start_average(self):
        """Launch this rank's part of its inter-node group's average (difference from the anchor when cast)."""
        params = self._params()
        with torch.no_grad():
            if self._wire is not None and self._anchor is not None:
                payload, wire, relative = [p.detach() - a for p, a in zip(params, self._anchor)], self._wire, True
            else:
                payload, wire, relative = [p.detach() for p in params], None, False
        chunk_bytes = self.options["sending_chunk_size"] * max(1, params[0].element_size()) if params else 1
        pending = AsyncAverage(payload, self._inter, wire, chunk_bytes=chunk_bytes)
        self.bytes_sent += pending.wire_bytes
        return pending, relative

    def _finish_average(self) -> list[torch.Tensor]:
        """The group's average from the sync in flight; it becomes the group's new anchor."""
        (pending, relative), self._inflight = self._inflight, None
        values = pending.wait()
        if relative:
            values = [a + d for a, d in zip(self._anchor, values)]
        if self._wire is not None:
            self._anchor = values
        return values

    def _drop_inflight(self) -> None:
        """Wait for this rank's sync in flight (its peers launched it too) and forget it."""
        if self._inflight is not None:
            self._inflight[0].wait()
            self._inflight = None
        self.pending_sync = None

    def _node_broadcast(self, local_rank: int) -> None:
        """Give the node's other processes the weights of its process ``local_rank``."""
        if self._intra is None:
            return
        src = self._node_ranks[local_rank]
        mine = self._local_rank == local_rank
        with torch.no_grad():
            for chunk in comm._chunks(self._params(), 25 * 1024 * 1024):
                flat = comm.flatten(chunk)
                dist.broadcast(flat, src=src, group=self._intra)
                if mine:
                    self.bytes_sent += (self._local_size - 1) * flat.numel() * flat.element_size()
                else:
                    comm.unflatten_into(flat, chunk)

    # ---- epochs ----------------------------------------------------------
    def end_epoch(self, model, loss: Optional[float]) -> None:
        """``model.end_epoch(loss)``: HeAT's ``epoch_loss_logic``."""
        self.epoch_loss_logic(loss)

    def epoch_loss_logic(self, loss, loss_globally_averaged: bool = False) -> None:
        """End the epoch (every rank calls it): average the loss, resync if cycling, update the schedule."""
        mean = self._mean_loss(loss, loss_globally_averaged)
        if self._inter is not None and self.global_skip > 0:
            self._drop_inflight()
            self._blocking_sync()
        self.pending_sync = None
        self.epoch += 1
        self.batch = 0
        self._enter_epoch(mean)
        if self.options["verbose"] and (self._model is None or self._model.rank == 0):
            print(
                f"daso: epoch {self.epoch} loss {mean}: global_skip {self.global_skip}, local_skip {self.local_skip}, "
                f"batches_to_wait {self.batches_to_wait}",
                flush=True,
            )

    def _mean_loss(self, loss, globally_averaged: bool) -> Optional[float]:
        """The epoch's loss averaged over the ranks that gave one (None if none did)."""
        value = None if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        model = self._model
        if globally_averaged or model is None or model.process_group is None:
            return value
        t = torch.tensor([0.0 if value is None else value, 0.0 if value is None else 1.0], dtype=torch.float64)
        dist.all_reduce(t, group=model.process_group)
        world = model.world_size
        self.bytes_sent += comm.ring_bytes(t.numel() * t.element_size(), world)
        return t[0].item() / t[1].item() if t[1].item() > 0 else None

    def _blocking_epoch(self, e: int) -> bool:
        """Whether epoch ``e`` is in the warm-up or the cool-down."""
        o = self.options
        return e < o["warmup_epochs"] or (o["total_epochs"] is not None and e >= o["total_epochs"] - o["cooldown_epochs"])

    def _enter_epoch(self, loss: Optional[float] = None) -> None:
        """Set the skips for epoch ``self.epoch`` from its phase and the last epoch's loss."""
        if self._blocking_epoch(self.epoch):
            self.global_skip = self.local_skip = self.batches_to_wait = 0
            return
        if self.global_skip == 0:
            self.global_skip = min(FIRST_GLOBAL_SKIP, self.options["max_global_skips"])
            self.local_skip = self.batches_to_wait = 1
        if loss is None or not self._stable(loss):
            return
        factor, most = self.options["skip_reduction_factor"], self.options["max_global_skips"]
        if self.global_skip > 1:
            self.global_skip = max(1, self.global_skip // factor)
            self.local_skip = max(1, self.local_skip // factor)
            self.batches_to_wait = max(1, self.batches_to_wait - 1)
        else:
            self.global_skip = most
            self.local_skip = self.batches_to_wait = max(1, most // self.options["local_skip_factor"])

    def _stable(self, loss: float) -> bool:
        """Plateau detection: True after PATIENCE + 1 epochs in a row without a relative improvement."""
        threshold = self.options["stability_level"]
        best = self.plateau_best
        bar = best * (1 - threshold) if best >= 0 else best * (1 + threshold)
        if loss < bar:
            self.plateau_best, self.plateau_bad = loss, 0
        else:
            self.plateau_bad += 1
        if self.plateau_bad > PATIENCE:
            self.plateau_bad = 0
            return True
        return False

    # ---- final sync and state -------------------------------------------
    def average(self, model) -> None:
        """Every rank drops its sync in flight (after it completes); DataParallel then averages all weights."""
        self._drop_inflight()
        self._anchor = None

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batch counters, skips, rotation, plateau tracking, and the sync in flight
        with its reference weights, so a resumed run merges it at the same batch.

        No new communication: a sync in flight is waited for (every peer launched
        it already) and kept, received but not yet merged.
        """
        state = {key: getattr(self, key) for key in _STATE_KEYS}
        inflight = None
        if self._inflight is not None:
            pending, relative = self._inflight
            values = [v.clone() for v in pending.wait()]
            self._inflight = (_Received(values), relative)
            inflight = {"values": values, "relative": relative}
        state["inflight"] = inflight
        state["pending_sync"] = None if self.pending_sync is None else asdict(self.pending_sync)
        state["anchor"] = None if self._anchor is None else [a.clone() for a in self._anchor]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule and the sync in flight (a state without one re-establishes
        the reference weights at the next sync)."""
        missing = sorted(set(_STATE_KEYS) - set(state))
        if missing:
            raise ValueError(f"daso state is missing {missing}")
        self._drop_inflight()
        self._counter.pending.clear()
        for key in _STATE_KEYS:
            setattr(self, key, float(state[key]) if key == "plateau_best" else int(state[key]))
        anchor, inflight, pending = state.get("anchor"), state.get("inflight"), state.get("pending_sync")
        self._anchor = None if anchor is None else [a.clone() for a in anchor]
        self._inflight = None if inflight is None else (_Received([v.clone() for v in inflight["values"]]), bool(inflight["relative"]))
        self.pending_sync = None if pending is None else PendingSync(**pending)


class _Received:
    """A sync already received (kept by a checkpoint): ``wait()`` gives its values at once."""

    def __init__(self, values: list[torch.Tensor]):
        self._values = values

    def is_completed(self) -> bool:
        return True

    def wait(self) -> list[torch.Tensor]:
        return self._values


def wire_dtype(value) -> Optional[torch.dtype]:
    """The torch dtype named by a downcast_type option, or None if it names none allowed."""
    if isinstance(value, torch.dtype):
        return value if value in _WIRE.values() else None
    return _WIRE.get(value) if isinstance(value, str) else None
