"""Asynchronous model averaging (Bagua's "async model average"): a background
thread averages the parameters every ``sync_interval_ms`` while each rank goes
on training its replica on local gradients.

**Warm-up.** The first ``warmup_steps`` optimizer steps (of the first
registered optimizer) average gradients synchronously, as "allreduce" does;
the replicas stay identical and the thread is not running. With
``warmup_steps=0`` there is no gradient engine at all.

**A round.** After the warm-up each rank's thread repeats, paced by
``sync_interval_ms`` on its own clock but matched with the other ranks' threads
by sequence (round k meets round k everywhere, on a private process group):

1. a one-integer allreduce (MIN) of a "keep going" flag: a rank that is
   stopping sends 0, and if any rank sent 0 every thread stops after this same
   exchange, so all ranks always run the same number of collectives;
2. under the model's lock, the parameters are copied: the snapshot ``s_i``;
3. the snapshots are averaged (lock released: training goes on meanwhile);
4. under the lock, every parameter gets ``x_i <- x_i + (mean_j s_j - s_i)``.

So a replica that made no step during the round becomes exactly the average,
and the local progress a rank made while the average was on the wire
(``x_i - s_i``) is kept. The update leaves the sum of the replicas unchanged.

**Safety.** The lock is taken by a pre-hook and released by a post-hook of
every registered optimizer's ``step()``: the thread never reads or writes a
parameter while a step runs. Forward and backward are not locked: the thread
may write a parameter between a forward and its backward (asynchronous
training, as in Bagua), through ``param.data`` so autograd's saved-tensor
check is not tripped. Buffers (BatchNorm statistics) stay local until
``model.average()``.

**Stopping.** ``model.average()`` (a collective) stops every rank's thread
after one common round, then DataParallel averages everything blocking; the
thread starts again at the next optimizer step. ``switch_to()`` and teardown
stop it for good. A rank that tears down (or whose model is garbage collected,
or whose interpreter exits normally) sends 0 at its next round, and the other
ranks' threads stop there too; they go on training locally and do not restart
until their own ``model.average()``. A rank whose process dies makes the
others' next exchange fail at once (connection reset); a rank alive whose
thread has died makes it fail after the process group's timeout. Either way
the error, like any exception in the thread, is raised in the training thread
(with the thread's traceback) at the next forward, optimizer step or
``model.average()``; the thread does not start again after an error.

Replicas differ between rounds: call ``model.average()`` before saving a
checkpoint that should hold the common model, and before loading one (a round
in flight would otherwise add its correction to the loaded weights).

Counters: ``rounds`` (averaging rounds done), ``steps`` (optimizer steps) and
``bytes_sent`` (bytes this rank sent, flags included) are saved in the state dict.
``reduces_gradients`` is True only when ``warmup_steps`` > 0.
"""

from __future__ import annotations

import atexit
import datetime
import math
import threading
import time
import traceback
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import comm
from ..runtime import collective_timeout
from ..averaging import AsyncAverage
from .base import Algorithm, check_int, require_optimizers

#: Used when the model's process group does not say its own timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

#: Longest pause between two checks of an average in flight.
POLL_MAX_S = 0.002

#: Longest wait for a thread at interpreter exit (the process exits anyway).
EXIT_JOIN_S = 5.0


class AsyncModelAverage(Algorithm):
    """Parameters averaged by a background thread every ``sync_interval_ms`` while training goes on locally."""

    name = "async"
    replicas_drift = True
    defaults = {"sync_interval_ms": 50.0, "warmup_steps": 0}

    def validate(self) -> None:
        """sync_interval_ms: a positive number; warmup_steps: an integer >= 0."""
        interval = self.options["sync_interval_ms"]
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (math.isfinite(interval) and interval > 0):
            raise ValueError(f"sync_interval_ms must be a positive number of milliseconds, got {interval!r}")
        check_int(self.options, "warmup_steps", minimum=0)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.reduces_gradients = self.options["warmup_steps"] > 0
        self.steps = self.rounds = self.bytes_sent = 0
        self._lock = threading.Lock()
        self._held = False
        self._thread: Optional[_Averager] = None
        self._failure: Optional[tuple[BaseException, str]] = None
        self._active = self._may_run = self._broken = False
        self._hooks: list = []
        self._finalizer: Optional[weakref.finalize] = None

    # ---- set-up and teardown -------------------------------------------
    def setup(self, model) -> None:
        """Hook the optimizers' steps (the lock); the thread starts after the warm-up."""
        require_optimizers(model, self.name)
        if getattr(model, "module", None) is None:
            raise ValueError("'async' averages a model's parameters: wrap the model with unison.DataParallel")
        self._params = [p for p in model.module.parameters() if p.requires_grad]
        self._active = model.process_group is not None and model.world_size > 1 and bool(self._params)
        if not self._active:
            return
        self._group = comm.private_group(model.process_group, f"{model.serial}/async")
        self._timeout = _group_timeout(model.process_group)
        for opt in model.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._step_begins))
            self._hooks.append(opt.register_step_post_hook(self._step_ends))
        self._finalizer = weakref.finalize(model, self._request_stop)
        self._may_run = True

    def teardown(self, model) -> None:
        """Stop the thread for good (the other ranks' stop at the same round) and unhook the optimizers."""
        self._stop_thread()
        self._active = self._may_run = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._failure is not None:
            warnings.warn(f"'async' was torn down with an unreported error from its averaging thread:\n{self._failure[1]}", stacklevel=2)
            self._failure = None

    # ---- events -----------------------------------------------------------
    def sync_gradients(self, model) -> bool:
        """Gradients are averaged during the warm-up only."""
        return self.steps < self.options["warmup_steps"]

    def before_forward(self, model) -> None:
        """Raise the thread's error, if any; free the lock a failed step may have kept."""
        self._release()
        self._report()

    def after_step(self, model, optimizer) -> None:
        """Count the step, raise the thread's error, start the thread once the warm-up is over."""
        if optimizer is not model.optimizers[0]:
            return
        self.steps += 1
        self._report()
        if self._active and self._may_run and not self._broken and self._thread is None and not self.sync_gradients(model):
            self._thread = _Averager(self)

    def average(self, model) -> None:
        """Stop every rank's thread after one common round; it restarts at the next optimizer step."""
        self._stop_thread()
        self._report()
        self._may_run = self._active

    # ---- the lock around optimizer steps ------------------------------------
    def _step_begins(self, optimizer, args, kwargs) -> None:
        """Optimizer pre-step hook: hold the lock while the step runs."""
        if not self._held:
            self._lock.acquire()
            self._held = True

    def _step_ends(self, optimizer, args, kwargs) -> None:
        """Optimizer post-step hook."""
        self._release()

    def _release(self) -> None:
        """Free the lock if the training thread holds it (also after a step that raised)."""
        if self._held:
            self._held = False
            self._lock.release()

    # ---- the thread's life ----------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the averaging thread is running now."""
        return self._thread is not None and self._thread.is_alive()

    def _request_stop(self) -> None:
        """Ask the thread to stop at its next round without waiting (the model was garbage collected)."""
        if self._thread is not None:
            self._thread.request_stop()

    def _stop_thread(self) -> None:
        """Ask this rank's thread to stop at its next round and wait for it (the others stop there too)."""
        self._release()
        thread = self._thread
        if thread is None:
            return
        thread.request_stop()
        thread.join()
        self._collect()

    def _collect(self) -> None:
        """Forget a finished thread, keeping its error for the training thread."""
        thread = self._thread
        if thread is None or thread.is_alive():
            return
        self._thread = None
        if thread.failure is not None:
            self._failure = thread.failure
            self._broken = True
        elif thread.stopped_by_peer:
            self._may_run = False

    def _report(self) -> None:
        """Raise, in the training thread, an error the averaging thread met."""
        self._collect()
        if self._failure is None:
            return
        exc, text = self._failure
        self._failure = None
        self._release()
        raise RuntimeError(f"'async' model averaging failed in its background thread; its traceback:\n{text}") from exc

    # ---- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters (the thread itself holds no state between rounds)."""
        return {"steps": self.steps, "rounds": self.rounds, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters (and so whether the warm-up is over)."""
        self.steps = int(state["steps"])
        self.rounds = int(state["rounds"])
        self.bytes_sent = int(state["bytes_sent"])


class _Averager:
    """One background thread running averaging rounds for one algorithm until a round where some rank stops."""

    def __init__(self, owner: AsyncModelAverage):
        self.owner = owner
        self.params = owner._params
        self.group = owner._group
        self.lock = owner._lock
        self.interval = owner.options["sync_interval_ms"] / 1000.0
        self.timeout = owner._timeout
        self.world = dist.get_world_size(self.group)
        self.failure: Optional[tuple[BaseException, str]] = None
        self.stopped_by_peer = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unison-async-average", daemon=True)
        _live.add(self)
        self._thread.start()

    def request_stop(self) -> None:
        """Send "stop" at the next round, and start that round now."""
        self._stop.set()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the thread to end."""
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """Whether the thread is still running rounds."""
        return self._thread.is_alive()

    def _run(self) -> None:
        """The thread: rounds paced by the interval until one where some rank stops; keeps any error."""
        try:
            with torch.no_grad():
                while True:
                    self._stop.wait(self.interval)
                    if not self._agree_to_go_on():
                        break
                    self._round()
        except BaseException as exc:
            self.failure = (exc, traceback.format_exc())

    def _agree_to_go_on(self) -> bool:
        """The flag exchange that starts every round: False when some rank is stopping."""
        stopping = self._stop.is_set()
        flag = torch.tensor([0 if stopping else 1], dtype=torch.int32, device=self.params[0].device)
        work = comm.start(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self.group)
        self.owner.bytes_sent += 2 * (self.world - 1) * flag.element_size() // self.world
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise RuntimeError(
                f"the exchange that starts averaging round {self.owner.rounds + 1} failed: another rank has exited, or its "
                "averaging thread stopped without this one (every rank must stop it together: model.average(), "
                f"switch_to(), teardown or a normal exit). {exc}"
            ) from exc
        go_on = bool(flag.item())
        if not go_on and not stopping:
            self.stopped_by_peer = True
        return go_on

    def _round(self) -> None:
        """Average the snapshots and add (average - own snapshot) to the parameters."""
        with self.lock:
            snapshot = [p.detach().clone() for p in self.params]
        pending = AsyncAverage(snapshot, self.group)
        self.owner.bytes_sent += pending.wire_bytes
        deltas = self._wait(pending)
        for d, s in zip(deltas, snapshot):
            d.sub_(s)
        with self.lock:
            for p, d in zip(self.params, deltas):
                p.data.add_(d)
        self.owner.rounds += 1

    def _wait(self, pending: AsyncAverage) -> list[torch.Tensor]:
        """The average, or an error once the group's timeout has passed (a rank whose thread
        failed before sending its part would otherwise keep this one waiting)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 1e-4
        while not pending.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"averaging round {self.owner.rounds + 1} did not complete within {self.timeout}: "
                    "another rank's averaging thread stopped in the middle of it"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        try:
            return pending.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"averaging round {self.owner.rounds + 1} failed: another rank has exited. {exc}") from exc


def _group_timeout(group) -> datetime.timedelta:
    """How long a flag exchange may wait for the other ranks: the timeout given to
    ``unison.init()`` (which the private groups are created with), else torch's default."""
    return collective_timeout() or DEFAULT_TIMEOUT


_live: "weakref.WeakSet[_Averager]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, send "stop" from every running thread so the other ranks' threads stop too."""
    threads = [t for t in list(_live) if t.is_alive()]
    for t in threads:
        t.request_stop()
    for t in threads:
        t.join(EXIT_JOIN_S)
