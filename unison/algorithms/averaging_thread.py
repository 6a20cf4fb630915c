"""The background thread of "async": averaging rounds matched by sequence with the
other ranks' threads, until a round where some rank says stop.

Round k meets round k everywhere on a private group. It starts with a one-integer
allreduce (MIN) of a "keep going" flag, so every rank stops after the same round;
then it snapshots the parameters under the state's lock, averages the snapshots
(lock released: training goes on) and, under the lock, adds ``average - snapshot``
to every parameter. See docs/algorithms.md#async.
"""

from __future__ import annotations

import atexit
import threading
import time
import traceback
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.averaging import AsyncAverage

#: Longest pause between two checks of an average in flight.
POLL_MAX_S = 0.002
#: Longest wait for a thread at interpreter exit (the process exits anyway).
EXIT_JOIN_S = 5.0


class AveragingThread(threading.Thread):
    """Rounds paced by ``state.interval`` seconds over ``state.group``, started at construction.

    Args:
        state: the algorithm's state: ``params``, ``group``, ``lock``, ``interval``,
            ``timeout``, and the counters ``rounds`` and ``bytes_sent`` it adds to.

    Example::

        thread = AveragingThread(state)
        thread.stopping.set()  # say "stop" at the next round, and start it now
        thread.join()
    """

    def __init__(self, state) -> None:
        super().__init__(name="unison-async-average", daemon=True)
        self.state, self.world = state, dist.get_world_size(state.group)
        self.failure: Optional[tuple[BaseException, str]] = None  # the error and its traceback
        self.stopped_by_peer = False  # some other rank said stop
        self.stopping = threading.Event()
        _live.add(self)
        self.start()

    def run(self) -> None:
        try:
            with torch.no_grad():
                while True:
                    self.stopping.wait(self.state.interval)
                    if not self._agree_to_go_on():
                        break
                    self._round()
        except BaseException as exc:
            self.failure = (exc, traceback.format_exc())

    def _agree_to_go_on(self) -> bool:
        """The flag exchange that starts every round: False when some rank is stopping."""
        s, stopping = self.state, self.stopping.is_set()
        flag = torch.tensor([0 if stopping else 1], dtype=torch.int32, device=s.params[0].device)
        work = comm.start(dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=s.group)
        s.bytes_sent += comm.ring_bytes(flag.element_size(), self.world)
        try:
            work.wait(timeout=s.timeout)
        except RuntimeError as exc:
            raise RuntimeError(
                f"the exchange that starts averaging round {s.rounds + 1} failed: another rank has exited, or its "
                "averaging thread stopped without this one (every rank must stop it together: model.average(), "
                f"switch_to(), teardown or a normal exit). {exc}"
            ) from exc
        go_on = bool(flag.item())
        self.stopped_by_peer = not go_on and not stopping
        return go_on

    def _round(self) -> None:
        """Average the snapshots and add (average - own snapshot) to the parameters."""
        s = self.state
        with s.lock:
            snapshot = [p.detach().clone() for p in s.params]
        pending = AsyncAverage(snapshot, s.group)
        s.bytes_sent += pending.wire_bytes
        deltas = self._wait(pending)
        for d, snap in zip(deltas, snapshot):
            d.sub_(snap)
        with s.lock:
            for p, d in zip(s.params, deltas):
                p.data.add_(d)
        s.rounds += 1

    def _wait(self, pending: AsyncAverage) -> list[torch.Tensor]:
        """The average, or an error once the timeout has passed (a rank whose thread
        failed before sending its part would otherwise keep this one waiting)."""
        s = self.state
        deadline, pause = time.monotonic() + s.timeout.total_seconds(), 1e-4
        while not pending.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"averaging round {s.rounds + 1} did not complete within {s.timeout}: "
                    "another rank's averaging thread stopped in the middle of it"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        try:
            return pending.wait()
        except RuntimeError as exc:
            raise RuntimeError(f"averaging round {s.rounds + 1} failed: another rank has exited. {exc}") from exc


_live: "weakref.WeakSet[AveragingThread]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, send "stop" from every running thread so the other ranks' threads stop too."""
    threads = [t for t in list(_live) if t.is_alive()]
    for t in threads:
        t.stopping.set()
    for t in threads:
        t.join(EXIT_JOIN_S)
