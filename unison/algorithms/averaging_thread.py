"""The background thread of "async": averaging rounds matched by sequence with the
other ranks' threads, until a round where some rank says stop.

Round k meets round k everywhere on a private group. It starts with a one-integer
allreduce (MIN) of a "keep going" flag, so every rank stops after the same round;
then it snapshots the parameters under the state's lock, averages the snapshots
(lock released: training goes on) and, under the lock, adds ``average - snapshot``
to every parameter. See docs/algorithms.md#async.

The snapshot and the average live in two flat buffers kept for the thread's
life (``FlatRound``): a round copies the parameters once (under the lock), and
every other pass (divide, subtract, add) works in place, so a round costs the
training thread's core a few memory passes rather than fresh allocations.
"""

from __future__ import annotations

import atexit
import threading
import time
import traceback
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.averaging import CHUNK_BYTES
from ..engine.flat import Flats
from ..engine.hierarchy import TwoLevel

#: Longest pause between two checks of an average in flight.
POLL_MAX_S = 0.002
#: Longest wait for a thread at interpreter exit (the process exits anyway).
EXIT_JOIN_S = 5.0


class FlatRound:
    """The snapshot of ``params`` and its average over ``group``, in flat buffers
    allocated once (one pair per dtype and device), averaged in chunks of at most
    ``chunk_bytes`` (views: nothing is copied for the wire). With ``levels`` the
    average runs in two levels (the node's mean, shards across nodes, gathered):
    ``launch`` then runs every leg, blocking (the averaging thread calls it).

    ``wire_bytes`` is what a round sends (hierarchical: what the last one sent, both levels).

    Example::

        r = FlatRound(params, group)
        r.snapshot(params)     # under the lock: one copy
        r.launch()             # the average of the snapshots, in flight
        ...; r.wait(); r.deltas()                  # average - snapshot, in place
        torch._foreach_add_(params, r.delta_views)  # under the lock
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        chunk_bytes: int = CHUNK_BYTES,
        levels: Optional[TwoLevel] = None,
    ) -> None:
        self.group, self.world, self.chunk_bytes = group, dist.get_world_size(group), chunk_bytes
        self.snap, self.wire = Flats(params), Flats(params)
        self.snaps, self.wires = [f.flat for f in self.snap.parts], [f.flat for f in self.wire.parts]
        self.snap_views, self.delta_views = self.snap.views, self.wire.views  # in the order of params
        self.wire_bytes = sum(comm.ring_bytes(w.numel() * w.element_size(), self.world) for w in self.wires)
        self.works: list = []
        self.levels = levels
        self.node = levels.flats(self.snap_views) if levels is not None else None  # the two levels' buffers

    def snapshot(self, params: list[torch.Tensor]) -> None:
        """Copy ``params`` into the snapshot."""
        torch._foreach_copy_(self.snap_views, params)

    def launch(self) -> "FlatRound":
        """Start averaging the snapshots: each rank sends its snapshot / world, summed (hierarchical:
        the two levels' average, done when this returns)."""
        if self.levels is not None and self.node is not None:
            before = self.levels.sent
            torch._foreach_copy_(self.delta_views, self.levels.average(self.node, self.snap_views))
            self.wire_bytes = self.levels.sent - before
            return self
        self.works = []
        for snap, wire in zip(self.snaps, self.wires):
            torch.div(snap, self.world, out=wire)
            step = max(1, self.chunk_bytes // max(1, wire.element_size()))
            self.works += [comm.start(dist.all_reduce, part, group=self.group) for part in wire.split(step)]
        return self

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            comm.wait(w)
        self.works = []

    def deltas(self) -> None:
        """Turn the average into ``average - snapshot``, in place (``delta_views``)."""
        for snap, wire in zip(self.snaps, self.wires):
            wire.sub_(snap)


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

    def __init__(self, state: Any) -> None:  # an AsyncState (averaging/asynchronous.py imports this module)
        super().__init__(name="unison-async-average", daemon=True)
        self.state, self.world = state, dist.get_world_size(state.group)
        self.failure: Optional[tuple[BaseException, str]] = None  # the error and its traceback
        self.stopped_by_peer = False  # some other rank said stop
        self.stopping = threading.Event()
        self.buffers: Optional[FlatRound] = None  # built by the first round, kept for the next ones
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
        if self.buffers is None:
            self.buffers = s.new_round()
        buffers, params = self.buffers, [p.data for p in s.params]  # .data: no version bump
        with s.lock:
            buffers.snapshot(params)
        pending = buffers.launch()
        s.bytes_sent += pending.wire_bytes
        self._wait(pending)
        buffers.deltas()
        with s.lock:
            torch._foreach_add_(params, buffers.delta_views)
        s.rounds += 1

    def _wait(self, pending: FlatRound) -> None:
        """Wait for the average, or raise once the timeout has passed (a rank whose thread
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
            pending.wait()
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
