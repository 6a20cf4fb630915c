"""Online bucket-size tuning for gradient allreduce: measure a few sizes, keep the fastest.

Bagua searches its bucket size from measured throughput; this is the plain
version of that idea. After a short warm-up each candidate size is used for a
few steps and the step time (start of the forward to the end of the
synchronized backward, so the optimizer step and the user's evaluation do not
count) is measured. The per-size medians are averaged across ranks with one
allreduce, so every rank picks the same size, and the fastest one is kept for
the rest of training. Sizes that give the same buckets as an earlier one (all
sizes above a small model's gradients do) are measured once.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...engine import buckets as bucketing
from ...replica import Replica

#: Candidate bucket sizes in MiB, besides the model's own ``bucket_cap_mb``.
CANDIDATES_MB = (1, 4, 10, 25, 64)
#: Steps before tuning starts (the first backward re-plans the buckets).
WARMUP_STEPS = 2
#: Untimed steps after each change of size (the first one allocates the new buckets).
SETTLE_STEPS = 1
#: Timed steps per candidate size.
MEASURE_STEPS = 3


class BucketTuner:
    """Drives one model's reducer through the candidate sizes and keeps the fastest.

    ``forward_started()`` is called at each training forward and
    ``backward_ended(replica)`` after each synchronized backward (the
    algorithm's events; without forward events, as under DistributedOptimizer,
    a step is timed from one backward's end to the next's); ``result`` is None until the choice is made, then a
    dict with ``chosen_mb``, ``default_mb``, ``gain`` (the default size's step
    time over the chosen one's, >= 1) and the measured ``step_ms`` per size.
    """

    def __init__(self, default_mb: float) -> None:
        self.default_mb = default_mb
        self.result: Optional[dict[str, Any]] = None
        self._start: Optional[float] = None
        self._last_end: Optional[float] = None
        self._steps = 0
        self._queue: Optional[list[float]] = None
        self._current = default_mb
        self._seen = 0
        self._times: dict[float, list[float]] = {}

    def forward_started(self) -> None:
        self._start = time.perf_counter()

    def backward_ended(self, replica: Replica) -> None:
        if self.result is not None:
            return
        now = time.perf_counter()
        start = self._start if self._start is not None else self._last_end  # no forward event (DistributedOptimizer)
        elapsed = None if start is None else now - start
        self._start, self._last_end = None, now
        self._steps += 1
        if self._queue is None:
            if self._steps >= WARMUP_STEPS:
                self._queue = self._distinct_sizes(replica)
                self._switch(replica, self._queue.pop(0))
            return
        self._seen += 1
        if self._seen > SETTLE_STEPS and elapsed is not None:
            self._times[self._current].append(elapsed)
        if len(self._times[self._current]) < MEASURE_STEPS:
            return
        if self._queue:
            self._switch(replica, self._queue.pop(0))
        else:
            self._choose(replica)

    def _switch(self, replica: Replica, mb: float) -> None:
        self._current, self._seen = mb, 0
        self._times[mb] = []
        replica.set_bucket_size(int(mb * bucketing.MB))

    def _distinct_sizes(self, replica: Replica) -> list[float]:
        """The default size first, then each candidate that buckets the gradients differently."""
        sizes, plans = [], set()
        for mb in [self.default_mb, *sorted(CANDIDATES_MB)]:
            plan = tuple(map(tuple, replica.bucket_plan(int(mb * bucketing.MB))))
            if plan not in plans:
                plans.add(plan)
                sizes.append(mb)
        return sizes

    def _choose(self, replica: Replica) -> None:
        """Agree on the fastest size (mean over ranks of each rank's median) and keep it."""
        sizes = list(self._times)
        ms = torch.tensor([1000 * statistics.median(self._times[mb]) for mb in sizes], dtype=torch.float64)
        group = replica.gradient_group
        dist.all_reduce(ms, group=group)
        ms /= dist.get_world_size(group)
        best = int(torch.argmin(ms))
        replica.set_bucket_size(int(sizes[best] * bucketing.MB))
        step_ms = {mb: round(t, 3) for mb, t in zip(sizes, ms.tolist())}
        self.result = {
            "chosen_mb": sizes[best],
            "default_mb": self.default_mb,
            "gain": float(ms[0] / ms[best]),  # sizes[0] is the default
            "step_ms": step_ms,
            "tuning_steps": self._steps,
        }
