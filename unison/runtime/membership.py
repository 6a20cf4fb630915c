"""The runtime's one door to fault tolerance: the membership this process runs in, if any.

Under ``unison launch --fault-tolerant`` a process's groups belong to a membership of the job
that a failure ends (``unison.fault.member.Member``): every group must be built through it (a
peer dead before the build fails it in seconds; it is destroyed with the membership), and every
wait on a collective polled together with it (a wait raises instead of blocking on a dead peer).
The runtime and the engine do both, yet import nothing of fault tolerance, which sits above them:
the fault-tolerance package puts its connect function here when it is imported (``provide``; the
package's ``__init__`` imports it, so any ``import unison`` has), and the Member it connects puts
itself here (``enter``). Without a membership each call is torch.distributed's own.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Optional, Protocol


class MembershipChanged(RuntimeError):
    """The job's membership changed while this worker waited on a collective of the old one."""


class Membership(Protocol):
    """What the runtime and the engine ask of a fault-tolerant job's membership: this process's
    place in it (its worker id, the members' ids in rank order, its node's layout) and three calls."""

    id: int
    members: list[int]
    local_rank: int
    local_world_size: int

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def node_group(self) -> Any:
        """The node's group once built (``node_process_group``), else None."""

    def wait(self, work: Any, timed: bool = True) -> Any:
        """``work.wait()``, raising when the membership changes meanwhile."""

    def new_group(self, build: Callable[[Optional[datetime.timedelta]], Any]) -> Any:
        """``build(timeout)``: a group of this membership, destroyed with it."""

    def node_process_group(self) -> Any:
        """The group of this process's node, which outlives memberships."""


_current: Optional[Membership] = None
_connect: Optional[Callable[..., Membership]] = None


def provide(connect: Callable[..., Membership]) -> None:
    """Set the function ``connect`` calls (the fault-tolerance package's, at its import)."""
    global _connect
    _connect = connect


def enter(membership: Optional[Membership]) -> None:
    """Make ``membership`` this process's (None: this process has none)."""
    global _current
    _current = membership


def current() -> Optional[Membership]:
    """This process's membership under a fault-tolerant launcher, else None."""
    return _current


def launched() -> bool:
    """Whether this process was started by a fault-tolerant launcher (or told of a coordinator)."""
    return "UNISON_FT_PORT" in os.environ


def connect(*after_regroup: Callable[[Any], None], backend: str = "gloo") -> Membership:
    """Join the coordinator named by the environment and wait for the first membership with this
    process; ``after_regroup`` are called with it after every regroup (the first included)."""
    if _connect is None:
        raise RuntimeError("a fault-tolerant launcher started this process, but unison.fault was never imported")
    return _connect(*after_regroup, backend=backend)


def wait(work: Any, timed: bool = True) -> Any:
    """``work.wait()``; under fault tolerance polled together with the membership. ``timed``: False
    for a send's or a receive's work (never waited on with a timeout)."""
    return work.wait() if _current is None else _current.wait(work, timed=timed)


def new_group(build: Callable[[Optional[datetime.timedelta]], Any], timeout: Optional[datetime.timedelta]) -> Any:
    """``build(timeout)``: a process group; under fault tolerance one of the membership's."""
    return build(timeout) if _current is None else _current.new_group(build)
