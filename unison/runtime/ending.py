"""The end of a job: every process group let go while Python still runs, so gloo's threads end first.

gloo runs each group's collectives on two worker threads of its own, and a worker holds a work
(and the tensors it reduced) until a moment after the work reports it completed. If its last
reference to a tensor whose Python object is still alive goes then, freeing that object takes
the GIL; once the interpreter has begun to finalize, CPython ends such a thread inside C++ and
the process aborts ("terminate called without an active exception"): a job that trained well
exits with SIGABRT. Only a group's destructor joins its workers (torch 2.13:
``destroy_process_group()`` and the backend's ``shutdown()`` leave them running), and it runs
when the last reference to the group goes. So the end of a job lets go of every reference unison
and torch hold to every group, on the main thread, before the interpreter finalizes: in
``unison.shutdown()``, or at exit when the script did not call it.

The references, and where each is let go of:

- each ``DataParallel`` (its group, step group, Replica and engine): it hands ``hold()`` the methods
  that release it (no collective, no thread left) and let go of its groups, which ``end()`` calls;
- the Topology ``init()`` returned (which the script keeps): held too, its groups cleared;
- unison's private groups and torch's own maps: ``forget_private_groups()`` and
  ``destroy_process_group()``;
- ``torch.distributed.nn.functional`` binds its ``group=`` defaults to the default group itself
  when it is first imported after ``init_process_group`` (torch.optim's first optimizer imports
  it, through torch._dynamo): unison imports it before starting a group, and ``end()`` puts
  ``None`` (the same default) back where it was bound all the same.

Under fault tolerance the membership's groups end with the Member (``unison.fault.member.Member.close``).
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
import weakref
from typing import Callable, Optional

import torch.distributed as dist

# Imported before any group exists, so that its ``group=group.WORLD`` defaults are None (see above).
import torch.distributed.nn.functional as _dist_nn_functional

from . import health, membership

_holders: list[tuple[weakref.WeakMethod, Optional[weakref.WeakMethod]]] = []
_held = False  # whether unison held a group in this process (at exit, a job that never used it is left alone)
#: Callables that say whether a collective unison started has not completed (the engine's works).
in_flight: list[Callable[[], bool]] = []
#: What ``end()`` makes unison forget, in order: the Topology ``init()`` made and the private groups
#: (``launch.forget_topology``, ``groups.forget_private_groups``, registered as they are imported:
#: this module imports neither, which import it).
forgets: list[Callable[[], object]] = []
#: How long the end waits for the collectives in flight to complete.
SETTLE_S = 2.0


def hold(let_go: Callable[[], None], release: Optional[Callable[[], None]] = None) -> None:
    """The object of the bound methods keeps process groups: ``end()`` calls ``release`` if given
    (stop its threads, no collective), then ``let_go`` (drop its groups). Held weakly: an object
    collected before has let go of them already."""
    global _held
    _holders[:] = [refs for refs in _holders if refs[0]() is not None]
    _holders.append((weakref.WeakMethod(let_go), weakref.WeakMethod(release) if release is not None else None))
    _held = True


def _unbind_torch_defaults() -> None:
    """Put None back in ``torch.distributed.nn.functional``'s defaults where a group was bound."""
    for fn in vars(_dist_nn_functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _settled() -> bool:
    """Whether every collective unison started has completed, waiting up to SETTLE_S for it."""
    deadline = time.monotonic() + SETTLE_S
    while any(busy() for busy in in_flight):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def end() -> None:
    """Release every wrapper, let go of every process group unison holds, destroy torch's, and
    collect what is left, so the groups' destructors join their threads now (``unison.shutdown()``
    calls it).

    A collective still in flight after SETTLE_S (an algorithm's thread still exchanging, as
    ``async`` does until ``average()``; a peer that goes on training) would make a group's
    destructor wait for it, up to the collective timeout, and a peer that trains on must see this
    process leave: then nothing is released, the groups are kept, as ``destroy_process_group()``
    alone keeps them, and the process ends without a wait."""
    global _held
    holders = [(let_go(), release() if release is not None else None) for let_go, release in _holders]
    _holders.clear()
    _held = False  # ended: the exit has nothing more to do, unless the script starts again
    settled = _settled()
    if settled:
        for let_go, release in holders:
            if let_go is not None:
                if release is not None:
                    release()
                let_go()
    for forget in forgets:
        forget()
    health.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if settled:
        _unbind_torch_defaults()
        gc.collect()  # a wrapper dropped in a reference cycle still holds its groups until collected


_quick = False  # this process runs only unison's code: its end skips the last cycle collections


def quick_exit(quick: bool = True) -> None:
    """Say that this process runs only unison's own code (``unison launch`` and its coordinator and
    agents, ``unison train``'s workers, ``python -m unison``): once the job has ended at exit, the
    objects left are frozen (``gc.freeze()``), so that the interpreter's finalization does not walk
    torch's hundreds of thousands of objects for cycles, several times over: 0.5-1.5 s of CPU a
    process, which each launch paid once per process. What a collection would still find then is
    unison's and torch's, and the process is about to end; a user's script never calls this (a
    cycle holding their open file would not be flushed). ``quick_exit(False)`` takes it back (a
    process forked from a launcher to run a user's script)."""
    global _quick
    _quick = quick


def _at_exit() -> None:
    """The script ended without ``unison.shutdown()``: end the job as it would have, unless an
    uncaught exception ended it (a peer may be gone; the groups then go as torch lets them) or a
    Member runs the membership (it ends its own groups). Then, in unison's own processes
    (``quick_exit``), freeze what is left."""
    if _held and not hasattr(sys, "last_value") and membership.current() is None:
        end()
    if _quick:
        gc.freeze()


# Registered at import, before health's and the Member's handlers: atexit runs it after them.
atexit.register(_at_exit)
