"""Asynchronous model averaging (Bagua's "async model average"): a background thread
averages the parameters every ``sync_interval_ms`` while each rank trains its replica
on local gradients, after ``warmup_steps`` steps of synchronous gradient averaging.

A round is one pass over the model, chunk by chunk (at most 2 MiB, or an eighth of
a gradient bucket): a chunk is snapshotted, averaged and its ``average - snapshot``
added, while the next one travels; so the chunks of one round are taken at
different moments, and the thread holds two chunks' snapshots and wire buffers,
never a copy of the model.
Every optimizer step holds a lock the thread takes to read and write the
parameters; the thread's errors are raised in the training thread (the thread
itself is ``async_rounds``). See docs/algorithms.md#async.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ...engine import comm
from ...engine.buckets import MB
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from ...runtime import collective_timeout, membership
from .. import options
from ..contract import FSDP2, Algorithm, Recovery
from ..schedules import CountedState, StepCount
from .async_rounds import SLOTS, AveragingThread, ChunkedRound

#: How long the thread waits for the other ranks when unison.init() was given no timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class AsyncState(CountedState):
    """The averaging thread, the lock every optimizer step holds, and the counters
    ``steps``, ``rounds`` and ``bytes_sent`` (what checkpoints keep)."""

    __slots__ = (
        "params",
        "group",
        "interval",
        "timeout",
        "lock",
        "held",
        "thread",
        "failure",
        "may_run",
        "broken",
        "rounds",
        "levels",
        "chunk_bytes",
    )

    def __init__(
        self,
        params: Sequence[torch.Tensor] = (),
        group: Optional[dist.ProcessGroup] = None,
        interval_s: float = 0.05,
        warmup_steps: int = 0,
        chunk_bytes: int = comm.STAGING_BYTES // SLOTS,
    ) -> None:
        super().__init__(StepCount(1, warmup_steps))
        self.params = list(params)  # the trainable parameters the thread averages
        self.group = group  # the thread's private group; None: nothing to average
        self.interval, self.timeout = interval_s, collective_timeout() or DEFAULT_TIMEOUT
        self.lock, self.held = threading.Lock(), False  # held: by the training thread, now
        self.thread: Optional[AveragingThread] = None
        self.failure: Optional[tuple[BaseException, str]] = None  # the thread's error, not yet raised
        self.may_run = group is not None  # False once a peer stopped, until average()
        self.broken = False  # the thread failed: it never starts again
        self.rounds = 0
        self.levels: Optional[TwoLevel] = None  # hierarchical: the node layout of the rounds
        # A round's chunk: the snapshot and wire buffers of the SLOTS chunks in flight are all a round
        # holds, together at most a gradient bucket or two staging pieces (8 MiB: chunks of 2 MiB; smaller
        # chunks cost a collective's latency each, measured: 126 MB on gloo, 1 MiB chunks 4 rounds/s,
        # 2 MiB 5, 4 MiB 6.25, the whole model at once 6).
        self.chunk_bytes = chunk_bytes

    def new_round(self, params: Sequence[torch.Tensor]) -> ChunkedRound:
        """The buffers of the thread's rounds over ``params`` (the parameters' ``.data``): flat, or
        averaged inside the node first."""
        return ChunkedRound(params, self.group, self.chunk_bytes, levels=self.levels)

    @property
    def running(self) -> bool:
        """Whether the averaging thread is running now."""
        return self.thread is not None and self.thread.is_alive()

    def hold(self) -> None:
        if not self.held:
            self.lock.acquire()
            self.held = True

    def let_go(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()

    def collect(self, stop: bool = False) -> None:
        """Forget a finished thread, keeping its error; with ``stop``, first ask it to stop
        at its next round (the other ranks' stop there too) and wait for it."""
        thread = self.thread
        if stop:
            self.let_go()
            if thread is not None:
                thread.stopping.set()
                thread.join()
        if thread is None or thread.is_alive():
            return
        self.thread = None
        if thread.failure is not None:
            self.failure, self.broken = thread.failure, True
        elif thread.stopped_by_peer:
            self.may_run = False

    def report(self) -> None:
        """Raise, in the training thread, an error the averaging thread met."""
        self.collect()
        if self.failure is not None:
            (exc, text), self.failure = self.failure, None
            self.let_go()
            raise RuntimeError(
                f"'async' model averaging failed in its background thread; its traceback:\n{text}"
            ) from exc

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rounds": self.rounds, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.steps, self.rounds, self.bytes_sent = (int(state[k]) for k in ("steps", "rounds", "bytes_sent"))


class AsyncModelAverage(Algorithm[AsyncState]):
    """Parameters averaged by a background thread every ``sync_interval_ms`` while training goes on locally.

    Args:
        sync_interval_ms: the pause between two averaging rounds, in milliseconds.
        warmup_steps: training steps of synchronous gradient averaging first.
        hierarchical: each round averages inside the node first; shards cross nodes
            (``engine.hierarchy.TwoLevel``).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="async:sync_interval_ms=20")
    """

    name = "async"
    replicas_drift = True
    needs_optimizers = True
    stops_gradient_sync = True  # after its warm-up
    recovery = Recovery()  # an interrupted average is dropped: the thread's next one pulls the replicas together
    fsdp2 = FSDP2()  # the local shards averaged by the thread
    sync_interval_ms: float = 50.0
    warmup_steps: int = 0
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.number("sync_interval_ms", self.sync_interval_ms)
        options.integer("warmup_steps", self.warmup_steps, minimum=0, what="an integer of at least 0")
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    @property
    def reduces_gradients(self) -> bool:  # type: ignore[override]  # the gradient engine runs for the warm-up only
        return self.warmup_steps > 0

    def setup(self, replica: Replica) -> AsyncState:
        super().setup(replica)
        if not replica.modules:
            raise ValueError("'async' averages a model's parameters: wrap the model with unison.DataParallel")
        params = [p for _, p in replica.trainable]
        group = replica.private_group("async") if replica.distributed and params else None
        chunk = max(1, int(min(2 * comm.STAGING_BYTES, replica.bucket_cap_mb * MB)) // (2 * SLOTS))
        state = AsyncState(params, group, self.sync_interval_ms / 1000.0, self.warmup_steps, chunk)
        if self.hierarchical and group is not None:
            topology, private = replica.topology, replica.private_group
            state.levels = TwoLevel.build(topology, replica.group, private, self.name, "async/nodes")
        if group is not None:
            replica.on_optimizer_step(before=lambda _o: state.hold(), after=lambda _o: state.let_go())
        return state

    def teardown(self, replica: Replica, state: AsyncState) -> None:
        """Stop the thread for good (the other ranks' stop at the same round)."""
        state.collect(stop=True)
        state.may_run = False
        if state.failure is not None and isinstance(state.failure[0], membership.MembershipChanged):
            state.failure = None  # the regroup that tears it down is the answer to it
        if state.failure is not None:
            warnings.warn(
                f"'async' was torn down with an unreported error from its averaging thread:\n{state.failure[1]}",
                stacklevel=2,
            )
            state.failure = None

    def release(self, replica: Replica, state: AsyncState) -> None:
        """Ask the thread to stop at its next round, without waiting (the model is gone)."""
        state.may_run = False
        if state.thread is not None:
            state.thread.stopping.set()

    def sync_gradients(self, replica: Replica, state: AsyncState) -> bool:
        return state.count.warming_up

    def before_forward(self, replica: Replica, state: AsyncState) -> None:
        state.let_go()  # a step that raised may have kept the lock
        state.report()

    def after_step(self, replica: Replica, state: AsyncState, optimizer: torch.optim.Optimizer) -> None:
        """Count the step, raise the thread's error, start the thread once the warm-up is over."""
        if not state.count.tick(replica, optimizer):
            return
        state.report()
        if state.may_run and not state.broken and state.thread is None and not state.count.warming_up:
            state.thread = AveragingThread(state)

    def average(self, replica: Replica, state: AsyncState) -> None:
        """Stop every rank's thread after one common round; the next step starts it again."""
        state.collect(stop=True)
        state.report()
        state.may_run = state.group is not None
