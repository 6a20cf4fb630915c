"""The background thread of "async": averaging rounds matched by sequence with the
other ranks' threads, until a round where some rank says stop.

Round k meets round k everywhere on a private group. It starts with a one-integer
allreduce (MIN) of a "keep going" flag, so every rank stops after the same round;
then, chunk by chunk (``ChunkedRound``: a few MiB of parameters), it snapshots the
chunk under the state's lock, averages the snapshots (lock released: training goes
on) and, under the lock, adds ``average - snapshot`` to the chunk; the next chunk is
snapshotted and launched while one travels. A round is thus one pass over the model
whose chunks are snapshotted at different moments, each averaged exactly. The
in-flight chunks' snapshot and wire buffers, kept for the thread's life, are all it
holds: never a copy of the model. See docs/algorithms.md#async.
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

from ...engine import comm
from ...engine.flat import kind, split
from ...engine.hierarchy import TwoLevel
from ...runtime import membership

#: Longest pause between two checks of an average in flight.
POLL_MAX_S = 0.002
#: Longest wait for a thread at interpreter exit (the process exits anyway).
EXIT_JOIN_S = 5.0


#: Chunks of a round in flight at once: the next chunk is snapshotted and launched while the last one travels.
SLOTS = 2


class Launched:
    """One chunk's average in flight (``wire_bytes``: what it sends)."""

    def __init__(self, works: list, wire_bytes: int) -> None:
        self.works, self.wire_bytes = works, wire_bytes

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        while self.works:
            comm.wait(self.works.pop(0))


class ChunkedRound:
    """A round's average of ``params`` over ``group``, chunk by chunk: chunks of at most
    ``chunk_bytes`` (``comm.staged``: a large tensor cut into views), each snapshotted,
    averaged and applied, at most ``SLOTS`` in flight, each slot's snapshot and wire buffer
    allocated once per dtype and device: a round costs ``2 * SLOTS`` chunks, never a copy
    of the model. With ``levels`` a chunk is averaged in two levels (the node's mean,
    shards across nodes, gathered), blocking in ``launch``.

    ``inter_bytes`` is what a whole round sends across nodes (hierarchical).

    Example::

        r = ChunkedRound(params, group, chunk_bytes=1 << 20)
        for i in range(len(r)):  # chunk i in slot i % SLOTS: chunk i - SLOTS must be applied first
            with lock:
                r.snapshot(i)    # one chunk's copy
            pending = r.launch(i); ...; pending.wait()
            r.delta(i)           # average - snapshot, in place
            with lock:
                r.apply(i)       # added to the parameters
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        chunk_bytes: int = comm.STAGING_BYTES,
        levels: Optional[TwoLevel] = None,
    ) -> None:
        self.params, self.group, self.levels = list(params), group, levels
        self.world = dist.get_world_size(group)
        multiple = levels.local_size if levels is not None else 1
        self.chunks = comm.staged(self.params, chunk_bytes)
        longest: dict[tuple[torch.dtype, torch.device], int] = {}
        for chunk in self.chunks:
            numel = sum(t.numel() for t in chunk)
            longest[kind(chunk[0])] = max(longest.get(kind(chunk[0]), 0), numel)
        # The wire buffer is padded to equal shards and used whole by every chunk of its kind
        # (zeros after the chunk): one length per kind, so the two levels keep one scratch per kind.
        first = {kind(t): t for t in self.params}
        slots = [
            (
                {k: first[k].new_empty(n) for k, n in longest.items()},
                {k: first[k].new_zeros(-(-n // multiple) * multiple) for k, n in longest.items()},
            )
            for _ in range(min(SLOTS, len(self.chunks)))
        ]
        self.parts = []  # per chunk: (its tensors, snapshot, wire, their views)
        for i, chunk in enumerate(self.chunks):
            snaps, wires = slots[i % len(slots)]
            numel, k = sum(t.numel() for t in chunk), kind(chunk[0])
            snap, wire = snaps[k][:numel], wires[k] if levels is not None else wires[k][:numel]
            self.parts.append((chunk, snap, wire, split(snap, chunk), split(wire, chunk)))
        self.inter_bytes = 0
        if levels is not None and levels.nodes > 1:
            for _, _, wire, _, _ in self.parts:
                shard = levels.shard_numel(wire.numel()) * wire.element_size()
                self.inter_bytes += comm.ring_bytes(shard, levels.nodes)
        self.ptrs = [t.data_ptr() for t in self.params]

    def params_moved(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``params`` are not the tensors the chunks were cut from (``p.data`` replaced)."""
        return len(params) != len(self.ptrs) or any(p.data_ptr() != q for p, q in zip(params, self.ptrs))

    def __len__(self) -> int:
        return len(self.parts)

    def snapshot(self, i: int) -> None:
        """Copy chunk ``i`` of the parameters into the snapshot (call it under the lock)."""
        chunk, _, _, snaps, _ = self.parts[i]
        torch._foreach_copy_(snaps, chunk)

    def launch(self, i: int) -> Launched:
        """Start averaging chunk ``i``'s snapshots: each rank sends its snapshot / world, summed
        (hierarchical: the two levels' average, done when this returns)."""
        _, snap, wire, _, _ = self.parts[i]
        h = self.levels
        if h is not None:
            before = h.sent
            wire[: snap.numel()].copy_(snap)
            wire[snap.numel() :].zero_()
            if h.local_size > 1:
                wire.div_(h.local_size)
            h.gather(wire, h.cross_average(h.scatter(wire)))
            return Launched([], h.sent - before)
        torch.div(snap, self.world, out=wire)
        work = comm.start(dist.all_reduce, wire, group=self.group)
        return Launched([work], comm.ring_bytes(wire.numel() * wire.element_size(), self.world))

    def delta(self, i: int) -> None:
        """Turn chunk ``i``'s average into ``average - snapshot``, in place."""
        _, snap, wire, _, _ = self.parts[i]
        wire[: snap.numel()].sub_(snap)

    def apply(self, i: int) -> None:
        """Add chunk ``i``'s ``average - snapshot`` to the parameters (call it under the lock)."""
        chunk, _, _, _, deltas = self.parts[i]
        torch._foreach_add_(chunk, deltas)


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
        self.buffers: Optional[ChunkedRound] = None  # built by the first round, kept for the next ones
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
            if membership.current() is not None:
                comm.wait(work)  # polled with the membership (see _wait)
            else:
                work.wait(timeout=s.timeout)
        except membership.MembershipChanged:
            raise
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
        """Chunk by chunk: average the snapshots and add (average - own snapshot) to the parameters;
        the next chunk is snapshotted and launched while the last one travels."""
        s = self.state
        params = [p.data for p in s.params]  # .data: no version bump
        if self.buffers is None or self.buffers.params_moved(params):
            self.buffers = None  # the old chunks' buffers go before the new ones come
            self.buffers = s.new_round(params)
        buffers = self.buffers
        flight: list[tuple[int, Launched]] = []
        for i in range(len(buffers) + SLOTS - 1):
            if i < len(buffers):
                with s.lock:
                    buffers.snapshot(i)
                pending = buffers.launch(i)
                s.bytes_sent += pending.wire_bytes
                flight.append((i, pending))
            if len(flight) == SLOTS or (i >= len(buffers) and flight):
                done, pending = flight.pop(0)
                self._wait(pending)
                buffers.delta(done)
                with s.lock:
                    buffers.apply(done)
        s.rounds += 1

    def _wait(self, pending: Launched) -> None:
        """Wait for the average, or raise once the timeout has passed (a rank whose thread
        failed before sending its part would otherwise keep this one waiting).

        Under fault tolerance the wait is polled with the membership (``comm.wait``): a peer that
        stopped keeps its sockets open, and gloo would never fail the round; the thread ends with
        ``MembershipChanged`` once the peer's eviction is published, and the regroup, which stops
        this thread, is not held up to the groups' backstop timeout."""
        s = self.state
        deadline, pause = time.monotonic() + s.timeout.total_seconds(), 1e-4
        while membership.current() is None and not pending.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"averaging round {s.rounds + 1} did not complete within {s.timeout}: "
                    "another rank's averaging thread stopped in the middle of it"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        try:
            pending.wait()
        except membership.MembershipChanged:
            raise
        except RuntimeError as exc:
            raise RuntimeError(f"averaging round {s.rounds + 1} failed: another rank has exited. {exc}") from exc


_live: "weakref.WeakSet[AveragingThread]" = weakref.WeakSet()


def _exchanging() -> bool:
    """Whether a thread still exchanges rounds: ``unison.shutdown()`` then keeps every wrapper and
    group as they are (stopping the thread would tell the others to stop too, silently; a peer that
    trains on must see this process leave, and fail)."""
    return any(t.is_alive() for t in list(_live))


comm.ending.in_flight.append(_exchanging)


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, send "stop" from every running thread so the other ranks' threads stop too."""
    threads = [t for t in list(_live) if t.is_alive()]
    for t in threads:
        t.stopping.set()
    for t in threads:
        t.join(EXIT_JOIN_S)
