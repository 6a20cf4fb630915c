"""Naming the rank that failed: heartbeats in the rendezvous store, and clear errors.

When a peer dies, gloo reports "Connection reset by peer [127.0.0.1]:31661";
when it stops answering, "Timed out waiting 1800000ms for recv". Neither says
which rank. Every rank runs a small daemon thread that writes a heartbeat (the
time and how many steps it has done) into the store of the default process
group; when a collective fails, ``explain`` reads them and raises
``RankFailure`` naming the ranks that went silent, or the ones that fell behind.
"""

from __future__ import annotations

import atexit
import dis
import functools
import os
import threading
import time
import types
from typing import Any, Callable, Optional

import torch.distributed as dist

from . import torch_private

#: Seconds between two heartbeats; a rank silent for STALE_AFTER heartbeats is named.
INTERVAL_S = 0.5
STALE_AFTER = 3

_PREFIX = "unison/heartbeat/"


class RankFailure(RuntimeError):
    """A collective failed because other ranks died or stopped answering; ``ranks`` names them."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class Heartbeat:
    """This rank's heartbeat: a daemon thread writing ``time progress`` every INTERVAL_S."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.progress = 0
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="unison-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"{_PREFIX}{self.rank}", f"{time.time():.3f} {self.progress}")

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self._beat()
            except Exception:  # the store went away (its host died, or shutdown): stop quietly
                return

    def read(self) -> dict[int, tuple[float, int]]:
        """Every rank's last heartbeat: rank -> (time, progress); a rank that never beat is left out.
        Raises if the store itself cannot be reached."""
        seen = {}
        for r in range(self.world):
            key = f"{_PREFIX}{r}"
            if not self.store.check([key]):
                continue
            t, progress = self.store.get(key).decode().split()
            seen[r] = (float(t), int(progress))
        return seen

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


_heartbeat: Optional[Heartbeat] = None


def start(rank: int, world: int) -> None:
    """Start this process's heartbeat (``unison.init`` calls it when the world is larger than one)."""
    global _heartbeat
    if _heartbeat is not None or world < 2:
        return
    try:
        store = torch_private.default_store()
    except Exception:  # a group without a store: errors stay gloo's own
        return
    _heartbeat = Heartbeat(store, rank, world)
    # Stopped before the interpreter finalizes: a daemon thread caught inside a store call
    # then would abort the process (the same crash comm.start guards against).
    atexit.register(stop)


def stop() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.close()
        _heartbeat = None


def advance() -> None:
    """Count one forward pass of this rank (the heartbeat carries it, to tell who fell behind)."""
    if _heartbeat is not None:
        _heartbeat.progress += 1


#: What torch.distributed raises when the transport, the backend or the store fails: a failure by
#: its type, whatever its message says.
FAILURE_TYPES: tuple[type[BaseException], ...] = (
    dist.DistBackendError,
    dist.DistNetworkError,
    dist.DistStoreError,
    TimeoutError,
    ConnectionError,
)


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (``raise ... from``), outermost first."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    return chain


def raised_in_a_collective(exc: BaseException) -> bool:
    """Whether ``exc`` may be a collective's own error: its first cause is a plain RuntimeError
    that came out of native code called from torch.distributed or unison's own code (gloo
    reports a peer's death so: "Connection closed by peer"). One first raised in the caller's
    code (a script's hook, its model), or by a ``raise`` statement (a deterministic check), is
    not. Told by where and how it was raised (the innermost frame of its traceback and the
    instruction it was running), never by its message."""
    root = causes(exc)[-1]
    if type(root) is not RuntimeError or root.__traceback__ is None:
        return False
    tb = root.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    ours = module.startswith(("torch.distributed", "unison.")) and not module.startswith("unison.apps")
    return ours and _raised_by_native_code(tb)


def _raised_by_native_code(tb: types.TracebackType) -> bool:
    """Whether the innermost frame was calling native code (a Work's ``wait``, a collective)
    when the error came, rather than running a ``raise`` of its own: unison's and torch's own
    deterministic errors (a changed static graph, a bad argument) are raised, a transport's
    failure comes out of a call."""
    for ins in dis.get_instructions(tb.tb_frame.f_code):
        if ins.offset == tb.tb_lasti:
            return ins.opname not in ("RAISE_VARARGS", "RERAISE")
    return True


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` may be a collective failing because of a peer (not a bug in the caller): by
    its type or a cause's (``FAILURE_TYPES``), or a collective's own RuntimeError
    (``raised_in_a_collective``). Whether a peer did fail is then for the record of who died to
    say (heartbeats here, the coordinator's memberships under fault tolerance)."""
    if isinstance(exc, RankFailure):
        return False
    return any(isinstance(e, FAILURE_TYPES) for e in causes(exc)) or raised_in_a_collective(exc)


def explain(exc: BaseException, what: str) -> BaseException:
    """A RankFailure naming the silent (or lagging) ranks behind ``exc``; ``exc`` itself if it is not a peer failure."""
    hb = _heartbeat
    if hb is None or not is_comm_failure(exc):
        return exc
    # The first line of the error and of each it was raised from (an algorithm's thread wraps its own).
    original = " <- ".join(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" for e in causes(exc))
    advice = (
        "Check that process's log; with torchrun --max-restarts, training resumes from the last unison.save checkpoint."
    )
    stale_s = INTERVAL_S * STALE_AFTER
    deadline = time.time() + stale_s + 2 * INTERVAL_S
    while True:  # a peer that just died still has a fresh heartbeat: give it time to go stale
        try:
            beats = hb.read()
        except Exception:  # the store is gone: under env:// rendezvous rank 0 hosts it
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent hosts it
                host, ranks = "the launcher's rendezvous store", []
            else:
                host, ranks = "rank 0, which hosts the rendezvous store,", [0]
            return RankFailure(
                f"rank {hb.rank}: {what} failed and {host} cannot be reached: it died or its machine went down. {advice} [{original}]",
                ranks,
            )
        now = time.time()
        silent = [r for r in range(hb.world) if r != hb.rank and (r not in beats or now - beats[r][0] > stale_s)]
        if silent or now > deadline:
            break
        time.sleep(INTERVAL_S / 2)
    if silent:
        ages = ", ".join(
            f"rank {r} ("
            + (
                f"silent for {now - beats[r][0]:.1f} s, after {beats[r][1]} forward passes"
                if r in beats
                else "no heartbeat at all"
            )
            + ")"
            for r in silent
        )
        message = (
            f"rank {hb.rank}: {what} failed because {ages} stopped answering: it died or hangs. {advice} [{original}]"
        )
        return RankFailure(message, silent)
    if beats:
        lowest = min(p for _, p in beats.values())
        behind = [r for r, (_, p) in sorted(beats.items()) if p == lowest and r != hb.rank]
        if behind and lowest < max(p for _, p in beats.values()):
            message = (
                f"rank {hb.rank}: {what} failed waiting for rank(s) {', '.join(map(str, behind))}, alive but behind "
                f"(after {lowest} forward passes): they are stuck outside the collective or run a different sequence of collectives. "
                f"[{original}]"
            )
            return RankFailure(message, behind)
    return exc


def translated(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a peer failure inside the call becomes a RankFailure naming the rank."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                failure = explain(exc, what)
                if failure is exc:
                    raise
                raise failure from exc

        return call

    return wrap
