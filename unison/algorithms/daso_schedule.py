"""DASO's schedule: phases, skips, the plateau rule and which batch sends or merges. Pure
bookkeeping (no tensors, no collectives), tested alone; the rules are HeAT's (docs/algorithms.md#daso).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Optional

#: HeAT's plateau patience: the loss is stable after PATIENCE + 1 epochs in a row without improvement.
PATIENCE = 2

#: global_skip on entering the cycling phase (HeAT's constant), capped by max_global_skips.
FIRST_GLOBAL_SKIP = 4

#: What ``Schedule.state_dict`` keeps, apart from the sync in flight.
SAVED = tuple(
    "epoch batch batches global_skip local_skip batches_to_wait send_rank "
    "plateau_best plateau_bad syncs_sent syncs_received syncs_blocking".split()
)

#: The schedule's settings (its options).
SETTINGS = tuple(
    "warmup_epochs cooldown_epochs total_epochs max_global_skips skip_reduction_factor "
    "local_skip_factor stability_level local_size nodes".split()
)


@dataclass(frozen=True)
class PendingSync:
    """A non-blocking global sync started by the group of ``local_rank``, merged at batch ``receive_at``."""

    local_rank: int
    batches_to_wait: int
    receive_at: int


class Plan(NamedTuple):
    """What a batch's end does: a blocking sync of local rank ``blocking``'s group, or merge, then send."""

    blocking: Optional[int] = None
    merge: Optional[PendingSync] = None
    send: Optional[PendingSync] = None


class Schedule:
    """DASO's epochs and batches: when nodes sync, and how often.

    Args:
        warmup_epochs, cooldown_epochs, total_epochs: the blocking phases
            (``total_epochs`` None: no cool-down).
        max_global_skips, skip_reduction_factor, local_skip_factor,
        stability_level: the skip schedule and the plateau rule (HeAT's).
        local_size: processes per node (the inter-node groups rotate over them).
        nodes: nodes; with one there are no global syncs.

    Example::

        s = Schedule(warmup_epochs=1, cooldown_epochs=0, total_epochs=None, nodes=2)
        s.end_batch(), s.end_epoch(1.0)  # Plan(blocking=0): the warm-up syncs every batch; then cycling
    """

    __slots__ = (*SETTINGS, *SAVED, "pending_sync")

    def __init__(
        self,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        total_epochs: Optional[int] = None,
        max_global_skips: int = 8,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        stability_level: float = 0.05,
        local_size: int = 1,
        nodes: int = 1,
    ) -> None:
        self.warmup_epochs, self.cooldown_epochs, self.total_epochs = warmup_epochs, cooldown_epochs, total_epochs
        self.max_global_skips, self.skip_reduction_factor = max_global_skips, skip_reduction_factor
        self.local_skip_factor, self.stability_level = local_skip_factor, stability_level
        self.local_size, self.nodes = local_size, nodes
        self.epoch = 0  # epochs ended
        self.batch = 0  # batches ended in the current epoch
        self.batches = 0  # batches ended in all
        self.global_skip = self.local_skip = self.batches_to_wait = 0
        self.send_rank = 0  # local rank whose inter-node group syncs next
        self.pending_sync: Optional[PendingSync] = None
        self.plateau_best, self.plateau_bad = math.inf, 0
        self.syncs_sent = self.syncs_received = self.syncs_blocking = 0
        self._enter_epoch(None)

    # ---- phases ---------------------------------------------------------
    def blocking_epoch(self, e: int) -> bool:
        """Whether epoch ``e`` is in the warm-up or the cool-down."""
        cooling = self.total_epochs is not None and e >= self.total_epochs - self.cooldown_epochs
        return e < self.warmup_epochs or cooling

    @property
    def global_syncs(self) -> bool:
        """Whether there are other nodes to sync with."""
        return self.nodes > 1

    def sync_gradients(self) -> bool:
        """Whether the node averages gradients this batch: every ``local_skip``-th of a cycling epoch, else always."""
        if not self.global_syncs or self.global_skip == 0 or self.local_skip <= 1:
            return True
        return self.batch % self.local_skip == 0

    # ---- batches ----------------------------------------------------------
    def rotate(self) -> int:
        """The local rank whose inter-node group syncs now; the next sync goes to the next one."""
        k = self.send_rank % self.local_size
        self.send_rank = (k + 1) % self.local_size
        return k

    def blocking_sync(self) -> int:
        """Count a blocking sync; the local rank of the group that runs it."""
        self.syncs_blocking += 1
        return self.rotate()

    def end_batch(self) -> Plan:
        """One batch ended: what it does (blocking sync, or merge and send), then count it."""
        b, plan = self.batch, Plan()
        if self.global_syncs and self.global_skip == 0:
            plan = Plan(blocking=self.blocking_sync())
        elif self.global_syncs:
            merge = send = None
            if self.pending_sync is not None and self.pending_sync.receive_at <= b:
                merge, self.pending_sync = self.pending_sync, None
                self.syncs_received += 1
            if b % self.global_skip == 0:
                wait = min(max(1, self.batches_to_wait), self.global_skip)
                send = self.pending_sync = PendingSync(self.rotate(), wait, b + wait)
                self.syncs_sent += 1
            plan = Plan(None, merge, send)
        self.batch += 1
        self.batches += 1
        return plan

    # ---- epochs -----------------------------------------------------------
    def end_epoch(self, loss: Optional[float]) -> Optional[int]:
        """The epoch ended with ``loss`` (averaged over the ranks): set the next epoch's skips.

        Returns the local rank of the group whose blocking sync realigns the
        replicas after a cycling epoch (None when there is none); a sync in
        flight is dropped.
        """
        k = self.blocking_sync() if self.global_syncs and self.global_skip > 0 else None
        self.pending_sync = None
        self.epoch += 1
        self.batch = 0
        self._enter_epoch(loss)
        return k

    def _enter_epoch(self, loss: Optional[float]) -> None:
        """Set the skips for epoch ``self.epoch`` from its phase and the last epoch's loss."""
        if self.blocking_epoch(self.epoch):
            self.global_skip = self.local_skip = self.batches_to_wait = 0
            return
        if self.global_skip == 0:
            self.global_skip = min(FIRST_GLOBAL_SKIP, self.max_global_skips)
            self.local_skip = self.batches_to_wait = 1
        if loss is None or not self.stable(loss):
            return
        factor = self.skip_reduction_factor
        if self.global_skip > 1:
            self.global_skip = max(1, self.global_skip // factor)
            self.local_skip = max(1, self.local_skip // factor)
            self.batches_to_wait = max(1, self.batches_to_wait - 1)
        else:
            self.global_skip = self.max_global_skips
            self.local_skip = self.batches_to_wait = max(1, self.max_global_skips // self.local_skip_factor)

    def stable(self, loss: float) -> bool:
        """Plateau detection: True after PATIENCE + 1 epochs in a row without a relative
        improvement of ``stability_level`` (the count then restarts)."""
        best, level = self.plateau_best, self.stability_level
        if loss < (best * (1 - level) if best >= 0 else best * (1 + level)):
            self.plateau_best, self.plateau_bad = loss, 0
        else:
            self.plateau_bad += 1
        if self.plateau_bad > PATIENCE:
            self.plateau_bad = 0
            return True
        return False

    # ---- state ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {key: getattr(self, key) for key in SAVED}
        state["pending_sync"] = None if self.pending_sync is None else asdict(self.pending_sync)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(SAVED) - set(state))
        if missing:
            raise ValueError(f"daso state is missing {missing}")
        for key in SAVED:
            setattr(self, key, float(state[key]) if key == "plateau_best" else int(state[key]))
        pending = state.get("pending_sync")
        self.pending_sync = None if pending is None else PendingSync(**pending)
