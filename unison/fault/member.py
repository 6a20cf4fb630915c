"""This worker's side of a fault-tolerant job: heartbeats, memberships, regrouping, polled waits.

A worker started by ``unison launch --fault-tolerant`` (or by a node's agent, or served by
``unison coordinator``) finds the coordinator's store in ``UNISON_FT_ADDR`` and
``UNISON_FT_PORT``, and its node in ``UNISON_FT_NODE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
(a node is a replica group of processes: the unit of failure). Daemon threads bump its
heartbeat and wait, blocked in the store (no polling), on this worker's bell (``ring``): the
coordinator rings it after each membership it publishes and when the job is aborted, and the
worker rings it itself at its end, so the thread leaves the store before the interpreter ends.
Every wait on a collective goes through ``Member.wait``, which polls the work together with the
newest epoch this process has seen: when membership changes, the wait raises
``MembershipChanged`` instead of blocking on a dead or stopped peer. ``regroup`` then builds
torch.distributed's default group again over the new members; the abandoned groups are aborted
(where the backend can), unregistered, and let go by a reaper thread once their work has ended
(``_Reaper``), never on the training thread.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from ..runtime import membership, torch_private
from ..runtime.health import RankFailure
from ..runtime.membership import MembershipChanged
from .messages import post, process_stat, ring, unring
from .node_group import NodeGroup

#: Seconds between two looks at in-process state (the epoch the watcher last saw) while waiting.
POLL_S = 0.02
#: Seconds between two heartbeats.
HEARTBEAT_S = 0.2
#: When the heartbeat thread has not run for this long (the process was stopped, or starved), the
#: training thread reads the epoch from the store itself instead of trusting the watcher.
STALE_LOOK_S = 3 * HEARTBEAT_S
#: How long a watcher's blocking wait lasts before it is made again (it ends at once on news).
WATCH_WAIT = datetime.timedelta(days=1)
#: Seconds a worker's end waits for its daemon threads to leave the store (they do at once when
#: the coordinator's store answers; a gone store fails their waits as soon).
JOIN_S = 5.0
#: A wait looks at the epoch at least this often (seconds).
WAIT_SLICE = datetime.timedelta(milliseconds=20)
#: Seconds a regroup waits for the coordinator to publish a membership that includes this worker.
REGROUP_TIMEOUT_S = 60.0
#: The backstop timeout of the groups built per membership (polled waits never reach it).
GROUP_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("UNISON_FT_TIMEOUT", "60")))
#: How long the members of a membership wait for each other while they build its group (they are
#: all ready when they start: only one that died or stopped since then is waited out).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=10)
#: Seconds a collective's own error (a plain RuntimeError: gloo's "Connection closed by peer") waits
#: for the coordinator to record a membership change before it counts as the user's error: more
#: than the coordinator's heartbeat timeout (2 s), which evicts a worker it does not see die.
FAILURE_GRACE_S = float(os.environ.get("UNISON_FT_FAILURE_GRACE", "5"))


class _WaitedOnThread:
    """A Work waited on (without a timeout) by a daemon thread: ``done()`` can be polled. Abandoned,
    the thread ends when the work does (with the group's backstop timeout at the latest)."""

    def __init__(self, work: Any) -> None:
        self.work, self.result = work, None
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()
        threading.Thread(target=self._wait, daemon=True, name="unison-ft-p2p").start()

    def _wait(self) -> None:
        try:
            self.result = self.work.wait()
        except BaseException as exc:  # handed to the waiter
            self.error = exc
        self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> Any:
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _Reaper:
    """Lets go of what old memberships left behind (groups, works, engines) on a daemon thread of
    its own, never on the training thread.

    A gloo group's destructor joins its worker threads, and a worker thread first finishes the
    collective it is in: with a peer that stopped, or that never posted its part because it moved
    on to the next membership, only at the group's backstop timeout (``GROUP_TIMEOUT``). Run on the
    training thread that would stall a regroup by up to that timeout, and the process's exit too.
    So a work is held until it has ended, then dropped; a group (already aborted where the backend
    can, and unregistered from torch) is held until nothing else holds it, then dropped here,
    where its destructor may wait without holding anyone up. Anything else is dropped at once.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.held = 0  # taken and not let go yet (tests read it)
        self._parking = False  # the worker is ending: let go of nothing more (see park)
        self._parked = threading.Event()

    def take(self, obj: Any) -> None:
        with self._lock:
            self.held += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, args=(self._queue,), name="unison-ft-reaper", daemon=True
                )
                self._thread.start()
        self._queue.put(obj)

    def park(self, timeout: float) -> None:
        """Let go of nothing more, and return once the thread is out of any destructor (or after
        ``timeout`` seconds). What it holds then stays held until the process ends: a
        destructor that ran on during the interpreter's end would be torn down inside C++ as
        it took the GIL back, and abort the process."""
        with self._lock:
            self._parking = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_WAKE)
            self._parked.wait(timeout)

    def _run(self, inbox: queue.SimpleQueue) -> None:
        held: list[Any] = []
        pause = 0.05
        while True:
            # Wait for something while nothing is held; while something is, look again after 50 ms,
            # twice as long each time nothing could go (up to 1 s).
            before = len(held)
            self._receive(inbox, held, timeout=pause if held else None)
            received, i = len(held) > before, 0
            while i < len(held):
                if self._parking:
                    self._parked.set()
                    threading.Event().wait()  # parked for good, holding ``held``: see park
                if _releasable(held, i):
                    del held[i]  # a group's destructor runs here, joining its threads
                    with self._lock:
                        self.held -= 1
                    received = True
                else:
                    i += 1
            pause = 0.05 if received else min(1.0, 2 * pause)
            if self._parking:
                self._parked.set()
                threading.Event().wait()

    def _receive(self, inbox: queue.SimpleQueue, held: list[Any], timeout: Optional[float]) -> None:
        """Move what was handed over into ``held`` (the locals holding it end with this call)."""
        taken: list[Any] = []
        try:
            taken.append(inbox.get(timeout=timeout))
            while True:
                taken.append(inbox.get_nowait())
        except queue.Empty:
            pass
        for obj in taken:
            if obj is _WAKE:
                continue
            if any(obj is h for h in held):  # handed over twice: held once
                with self._lock:
                    self.held -= 1
            else:
                held.append(obj)


#: What ``_Reaper.park`` puts in the reaper's inbox to wake it.
_WAKE = object()


def _releasable(held: list[Any], i: int) -> bool:
    """Whether ``held[i]`` may be let go now: a work once it has ended, a group once ``held`` is
    the only holder left (its destructor then runs on the reaper), anything else at once."""
    obj = held[i]
    if isinstance(obj, dist.ProcessGroup):
        del obj
        return sys.getrefcount(held[i]) <= 2  # the list's reference and the argument's
    finished = getattr(obj, "done", None) or getattr(obj, "is_completed", None)
    return finished is None or bool(finished())


def _abort(group: Any) -> None:
    """Cut a group's pending work short where its backend can: NCCL's ``abort`` (ncclCommAbort)
    ends its kernels and lets ``destroy_process_group`` and the destructor go through at once.
    Gloo's does nothing in torch 2.13 (its worker threads end with their collectives)."""
    abort = getattr(group, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # nothing to cut, or not supported by this backend: destruction still follows
        pass


def build_world(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, backend: str = "gloo"
) -> None:
    """``init_process_group(backend)`` over ``store``, which a failed attempt leaves ready for the next.

    ``backend`` is the one ``launch.init`` chose (NCCL on CUDA, gloo otherwise): every membership's
    groups are built with it, by the same code whatever it is.

    torch names an unnamed default group by a per-process count of groups made, reset only when
    the default group is destroyed; a build that fails has counted, and has nothing to destroy.
    Without the reset, a member whose build failed once looks for its next group's rendezvous
    under another name than a fresh joiner's, and every build after it fails too (a livelock
    of "the group could not be built" for good).
    """
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except RuntimeError:
        if not dist.is_initialized():
            torch_private.reset_group_count()
        raise


class Member:
    """This worker in the coordinator's memberships.

    Args:
        addr, port: where the coordinator's store listens.
        worker_id: this worker's id (the launcher sets ``UNISON_FT_ID``; None: take a fresh one).
        node: this worker's node (the launcher or agent sets ``UNISON_FT_NODE``; None: a node of
            its own, a fresh id). The node's processes fail, leave and come back together.
        local_rank, local_world_size: this worker's place in its node, and the node's size.
        backend: the backend every membership's groups are built with ("gloo", "nccl", ...).
    """

    def __init__(
        self,
        addr: str,
        port: int,
        worker_id: Optional[int] = None,
        node: Optional[int] = None,
        local_rank: int = 0,
        local_world_size: int = 1,
        backend: str = "gloo",
    ) -> None:
        timeout = datetime.timedelta(seconds=30)
        self.backend = backend
        self.store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        # One client per blocking wait, and one for the heartbeat: a client runs one request at a time.
        self._watch_store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        self._beat_store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        self.id = int(self.store.add("ft/next_id", 1)) - 1 if worker_id is None else worker_id
        self.node = int(self.store.add("ft/next_node", 1)) - 1 if node is None else node
        self.local_rank, self.local_world_size = local_rank, local_world_size
        self.epoch = 0  # the membership this worker's groups belong to
        self.latest = 0  # the newest membership the coordinator published
        self.members: list[int] = []
        self.joiners: list[int] = []
        self.lost: Optional[str] = None  # why the job cannot go on (coordinator gone, abort)
        self.veteran = False  # this process finished a settle (fault tolerance's): it holds the job's state
        self._admitted = False  # a membership with this worker was published (left out later: evicted)
        self.reaper = _Reaper()  # lets go of abandoned groups and works (see bury)
        self.groups: list[Any] = []  # the groups built for this membership beside its default group
        self.node_group: Optional[NodeGroup] = None  # the node's group, kept across memberships (node_process_group)
        self.after_regroup: list[Any] = []  # called with this Member once a membership's group is built
        self.committed_step: Optional[int] = None  # the job's committed step, as model.ft last saw it
        self._published_step: Optional[int] = None  # what this worker last wrote under ft/step
        self._beat_at = time.monotonic()  # when the heartbeat thread last ran
        self._stop = threading.Event()
        self._bell = 1  # the next ring the watcher waits for (``ring``)
        self.store.set(f"ft/hb/{self.id}", "0")  # before the join: the coordinator reads it from then on
        stat = process_stat()
        post(
            self.store,
            "join",
            self.id,
            pid=os.getpid(),
            process_start=None if stat is None else int(stat[19]),  # with pid and host: this very process
            node=self.node,
            local_rank=local_rank,
            local_world_size=local_world_size,
            host=socket.gethostname(),
        )
        self._threads = [
            threading.Thread(target=target, name=f"unison-ft-{name}", daemon=True)
            for name, target in (("beat", self._beat), ("watch", self._watch))
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self._at_exit)

    # ---- the daemon threads -----------------------------------------------------------
    def _gone(self, exc: BaseException) -> None:
        if not self._stop.is_set() and self.lost is None:
            self.lost = f"the coordinator cannot be reached (it died or its machine went down) [{exc}]"

    def _beat(self) -> None:
        """Bump ``ft/hb/<id>`` every HEARTBEAT_S (one store operation), and publish the step. A
        worker started by a node's agent (``UNISON_FT_AGENT_PID``) ends itself when the agent is
        gone (killed: nobody would stop or replace its node), so it outlives it by a heartbeat."""
        agent = os.environ.get("UNISON_FT_AGENT_PID")
        while not self._stop.is_set():
            if agent is not None and os.getppid() != int(agent):
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                self._beat_store.add(f"ft/hb/{self.id}", 1)
                self._publish_step()
            except Exception as exc:  # the coordinator's store is gone
                self._gone(exc)
                return
            self._beat_at = time.monotonic()
            self._stop.wait(HEARTBEAT_S)

    def _watch(self) -> None:
        """Read the newest membership (the coordinator numbers them one by one: ``ft/members/<e>``)
        and ``ft/abort``, then wait, blocked in the store, for this worker's bell (``ring``), until
        the worker ends. Every wait here is one the worker can end itself: ``close`` rings."""
        store = self._watch_store
        while not self._stop.is_set():
            try:
                latest = int(store.get("ft/epoch")) if store.check(["ft/epoch"]) else 0
                while store.check([f"ft/members/{latest + 1}"]):
                    latest += 1
                self.latest = max(self.latest, latest)
                if store.check(["ft/abort"]):
                    if not self._stop.is_set() and self.lost is None:
                        self.lost = f"the coordinator ended the job: {store.get('ft/abort').decode()}"
                    return
                if self._stop.is_set():
                    return
                store.wait([f"ft/bell/{self.id}/{self._bell}"], WATCH_WAIT)
                store.delete_key(f"ft/bell/{self.id}/{self._bell}")
                self._bell += 1
            except dist.DistStoreError:
                continue  # the day-long wait ran out: wait again
            except Exception as exc:
                self._gone(exc)
                return

    def _publish_step(self) -> None:
        """Rank 0 of the current membership writes the committed step under ``ft/step`` (the
        coordinator's status page reads it), at heartbeat time and only when it changed: no
        store round trip per step."""
        step, members = self.committed_step, self.members
        if step is not None and step != self._published_step and members and members[0] == self.id:
            self._beat_store.set("ft/step", str(step))
            self._published_step = step

    # ---- asking -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise RankFailure if the job cannot go on."""
        if self.lost is not None:
            raise RankFailure(
                f"worker {self.id}: {self.lost}. Restart the job; it resumes from the last unison.save checkpoint.", []
            )

    def changed(self) -> bool:
        """Whether a newer membership than this worker's groups' has been published.

        When the watcher has not looked for a while (this process was stopped, or starved),
        the epoch is read now: a worker resuming after its eviction must not go on as a member.
        """
        self.check()
        self._look_if_stale()
        return self.latest != self.epoch

    def membership_moved(self, within: float = FAILURE_GRACE_S) -> bool:
        """Whether the coordinator publishes a membership newer than this worker's groups' within
        ``within`` seconds (it records a death, an eviction, a leave, a joiner or a rebuild so): what
        tells a collective's own error that a peer failed from an error of the caller's."""
        deadline = time.monotonic() + within
        while not self.changed():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S / 4)
        return True

    def wanted_now(self) -> bool:
        """Whether a newer membership waits for this worker to regroup between two steps: it
        admits a joiner (who waits in its heal), or it asks for these same members again (a member
        waits in the rebuild). A departure alone is left to the next collective, which fails on
        every member at the same step: members of a drifting algorithm (local SGD, DiLoCo) that
        noticed it between steps would settle at different steps, and the one behind would be
        healed with the other's local progress."""
        if not self.changed():
            return False
        newest = set(self._read(self.latest)["members"])
        return bool(newest - set(self.members)) or newest == set(self.members)

    def check_membership(self) -> None:
        """Raise RankFailure if the job cannot go on or the newest membership leaves this worker out."""
        if self.changed() and self.epoch > 0 and self.id not in self._read(self.latest)["members"]:
            self._newest_with_me(time.time(), self.epoch)  # raises: evicted

    @property
    def rank(self) -> int:
        return self.members.index(self.id)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def wait(self, work: Any, timed: bool = True) -> Any:
        """``work.wait()`` (a Work, a Future or anything with ``is_completed``), raising MembershipChanged
        as soon as membership changes. A collective's Work is waited on in short timed slices; a
        point-to-point one (``timed=False``: gloo closes the pair when a timed wait on it runs out)
        is waited on by a thread, which is polled, as is anything else."""
        if not timed and isinstance(work, dist.Work):
            work = _WaitedOnThread(work)  # gloo's p2p works never report is_completed() without a wait
        if not timed or not isinstance(work, dist.Work):  # polled: a p2p Work, a Future, a thread's result
            finished = work.done if hasattr(work, "done") else work.is_completed
            pause = 0.0001
            while not finished():
                if self.changed():
                    self.bury(work)
                    raise MembershipChanged(f"membership epoch {self.latest} replaced {self.epoch}")
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
            return work.wait()
        while True:
            try:
                result = work.wait(timeout=WAIT_SLICE)
            except RuntimeError:
                if not work.is_completed():  # the slice ran out
                    if self.changed():
                        self.bury(work)
                        raise MembershipChanged(f"membership epoch {self.latest} replaced {self.epoch}") from None
                    continue
                # It ended, maybe just after the slice ran out ("Operation timed out!" raced its
                # completion): what it ended with decides, its result or its own error (a peer died).
                result = work.wait()
            if time.monotonic() - self._beat_at > STALE_LOOK_S and self.changed():
                raise MembershipChanged(
                    f"membership epoch {self.latest} replaced {self.epoch} while this worker was stopped"
                )
            return result

    # ---- memberships -------------------------------------------------------------------
    def _read(self, epoch: int) -> dict[str, Any]:
        return json.loads(self.store.get(f"ft/members/{epoch}"))

    def _newest_with_me(self, deadline: float, seen: int) -> tuple[int, dict[str, Any]]:
        """The newest membership, once it is newer than ``seen`` and holds this worker; RankFailure if
        this worker was admitted and is left out (evicted), or the job ended before it was admitted."""
        look_over = 0.0  # when to look at ft/over next (a joiner not admitted yet: every HEARTBEAT_S)
        while True:
            self.check()
            latest = self._newest()
            if latest > 0 and latest != seen:
                doc = self._read(latest)
                if self.id in doc["members"]:
                    self._admitted = True
                    return latest, doc
                if self.epoch == 0 and self.store.check(["ft/over"]):  # admitted as the last members finished
                    raise RankFailure(f"worker {self.id}: the job finished before this worker could join it", [])
                if self._admitted:  # a member, or a joiner left out before it had built its first group
                    raise RankFailure(
                        f"worker {self.id} was evicted from the job (membership {latest}: {doc['reason']}); "
                        "it stopped answering for too long and the others went on without it",
                        [],
                    )
                seen = latest  # a joiner not admitted yet
            if self.epoch == 0 and time.monotonic() > look_over and self.store.check(["ft/over"]):
                raise RankFailure(f"worker {self.id}: the job finished before this worker could join it", [])
            if time.time() > deadline:
                raise RankFailure(
                    f"worker {self.id}: no membership with this worker came within {REGROUP_TIMEOUT_S:.0f} s "
                    "(is the coordinator alive?)",
                    [],
                )
            if time.monotonic() > look_over:
                look_over = time.monotonic() + HEARTBEAT_S
            time.sleep(POLL_S / 4)

    def _newest(self) -> int:
        """The newest membership published; read now if the watcher may have missed it."""
        self._look_if_stale()
        return self.latest

    def _look_if_stale(self) -> None:
        """Read the epoch from the store when the heartbeat thread has not run for STALE_LOOK_S:
        this process was stopped (or starved), and the watcher may not have woken up yet."""
        if time.monotonic() - self._beat_at > STALE_LOOK_S and self.store.check(["ft/epoch"]):
            self.latest = max(self.latest, int(self.store.get("ft/epoch")))

    def _gather(self, epoch: int, doc: dict[str, Any], deadline: float) -> bool:
        """Whether the members of ``epoch`` build its group: all of them or none.

        Each member says it is ready, then the first one to find every member ready ("go"), or a
        newer membership before that ("skip"), decides for all (one compare_set). Without the one
        decision a member could go into the group's rendezvous while another, which saw the newer
        membership first, went on to that one: the first would wait out the rendezvous timeout.
        """
        self.store.set(f"ft/pg/{epoch}/ready/{self.id}", "1")
        keys = [f"ft/pg/{epoch}/ready/{m}" for m in doc["members"]]
        while True:
            self.check()
            if self.store.check(keys):
                want = "go"
            elif self._newest() != epoch:
                want = "skip"
            elif time.time() > deadline:
                raise RankFailure(
                    f"worker {self.id}: the members of membership {epoch} were not all ready within "
                    f"{REGROUP_TIMEOUT_S:.0f} s",
                    [],
                )
            else:
                time.sleep(POLL_S / 4)
                continue
            return self.store.compare_set(f"ft/pg/{epoch}/outcome", "", want).decode() == "go"

    def regroup(self) -> dict[str, Any]:
        """Move to the newest membership: build the default process group over its members.

        Returns the membership (``members``, ``joiners``, ``reason``). Groups of
        earlier memberships are abandoned, not destroyed while work may run on them.
        """
        deadline = time.time() + REGROUP_TIMEOUT_S
        seen = self.epoch
        if seen > 0 and self._newest() == seen:
            self._rebuild(seen)  # a failure, and no newer membership (yet): ask for the same members again
        while True:
            epoch, doc = self._newest_with_me(deadline, seen)
            seen = epoch
            # A new membership is the job going on: the wait for the next one starts again (under
            # churn, joiners dying before they are ready, a member may move through many).
            deadline = time.time() + REGROUP_TIMEOUT_S
            if not self._gather(epoch, doc, deadline):
                continue  # membership moved on while we gathered
            self._abandon()
            rank = doc["members"].index(self.id)
            store = dist.PrefixStore(f"ft/pg/{epoch}/", self.store)
            try:
                build_world(store, rank, len(doc["members"]), RENDEZVOUS_TIMEOUT, self.backend)
                _backstop(dist.group.WORLD)
                if self.node_group is not None:
                    self.node_group.attach()  # with the node's ranks in this membership
                self.epoch, self.members, self.joiners = epoch, list(doc["members"]), list(doc["joiners"])
                for hook in self.after_regroup:  # the node groups of the topology (launch.init)
                    hook(self)
            except RuntimeError:
                # A member that was ready died or stopped before it met the others (the coordinator
                # publishes a membership without it), or the build ran out of time on a busy machine
                # (it publishes the same members again): we wait for that one, never this one again.
                self._rebuild(epoch)
                continue
            return doc

    def new_group(self, build: Any) -> Any:
        """``build(timeout)``: a process group of this membership, built with the short rendezvous
        timeout (a member that died or stopped meanwhile is waited out in seconds, and the error is
        a failure that moves to the next membership, not a 10-minute hang), then given the
        backstop timeout of its collectives, and destroyed with the membership (``_abandon``)."""
        group = build(RENDEZVOUS_TIMEOUT)
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # a group of others (every rank builds every group)
            return group
        _backstop(group)
        self.groups.append(group)
        return group

    def node_process_group(self) -> Any:
        """The process group of this worker's node, which outlives memberships (``NodeGroup``):
        built at the first call, by every process of the node at once."""
        if self.node_group is None:
            self.node_group = NodeGroup(self.local_rank, self.local_world_size, GROUP_TIMEOUT)
        return self.node_group.group

    def hold(self) -> None:
        """Note that this process settled into a membership: it holds the job's state from now on
        (``ft/holder/<id>``: the coordinator asks it before a membership of the last members)."""
        if not self.veteran:
            self.store.set(f"ft/holder/{self.id}", "1")
            self.veteran = True

    def _rebuild(self, epoch: int) -> None:
        """Ask the coordinator for a membership after ``epoch`` even if nobody died (it looks for
        ``ft/rebuild/<epoch>`` with the heartbeats)."""
        self.store.set(f"ft/rebuild/{epoch}", str(self.id))

    def _abandon(self) -> None:
        """Abort and destroy the current membership's groups (its default group and those built
        with ``new_group``) without waiting for their work: aborted where the backend can (NCCL),
        unregistered from torch, then let go by the reaper once their work has ended."""
        if not dist.is_initialized():
            return
        groups = [dist.group.WORLD, *self.groups]
        self.groups = []
        for group in groups:
            _abort(group)
        if self.node_group is not None:
            self.node_group.detach()  # the node's group outlives the membership: kept out of the destruction
        dist.destroy_process_group()  # every group; gloo's shutdown does not wait for their work
        for group in groups:
            self.bury(group)

    def bury(self, obj: Any) -> None:
        """Hand ``obj`` (a group, a work or an engine of an old membership) to the reaper, which lets
        go of it off the training thread once that cannot block: see ``_Reaper``."""
        self.reaper.take(obj)

    def leave(self) -> None:
        """Leave the job gracefully: the others regroup without this worker."""
        post(self.store, "leave", self.id)
        self.close(finished=False)

    def _at_exit(self) -> None:
        # An uncaught exception was printed (sys.last_value) before atexit handlers run: no "done" then.
        self.close(finished=not hasattr(sys, "last_value"))

    def close(self, finished: bool = True) -> None:
        """Stop the daemon threads; ``finished``: tell the coordinator this worker ended normally.

        The watcher is woken (this worker rings its own bell) and both threads are joined, and
        the reaper is parked, so that no thread of this Member is inside torch's C++ code when
        the interpreter ends: one that came back from there (the watcher woken by the
        coordinator's news, the reaper out of a Work's destructor) would be torn down as it
        took the GIL back, and abort the process ("terminate called without an active exception")."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            ring(self.store, self.id)  # the watcher sees _stop and leaves
        except Exception:  # the store is gone: the watcher's wait has failed too
            pass
        if finished and self.lost is None:
            try:
                post(self.store, "done", self.id)
            except Exception:  # the coordinator is gone: nothing to tell
                pass
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_S)
        self.reaper.park(JOIN_S)
        try:
            unring(self.store, self.id, self._bell)
        except Exception:  # the store is gone
            pass


_member: Optional[Member] = None


def _backstop(group: Any) -> None:
    """Give a group built with the short rendezvous timeout the backstop timeout of its collectives."""
    torch_private.set_group_timeout(group, GROUP_TIMEOUT)


def active() -> Optional[Member]:
    """This process's Member when it runs under a fault-tolerant launcher, else None."""
    return _member


def connect() -> Member:
    """Join the coordinator named by the environment and wait for the first membership with this worker."""
    return connect_with()


def connect_with(*after_regroup: Any, backend: str = "gloo") -> Member:
    """``connect()``, with functions to call after every regroup of this worker, the first one
    included (its Member as argument): they run inside the regroup, and a failure of theirs is
    one of the regroup's (the same members are asked for again). ``backend``: the backend of every
    membership's groups. What ``unison.runtime.membership.connect`` calls (``unison.init()`` under
    a fault-tolerant launcher)."""
    global _member
    if _member is None:
        env = os.environ
        wid, node = env.get("UNISON_FT_ID"), env.get("UNISON_FT_NODE")
        local_rank, local_world = 0, 1  # without UNISON_FT_NODE (torchrun's LOCAL_RANK aside): a node of its own
        if node is not None:
            local_rank, local_world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
        if not 0 <= local_rank < local_world:
            raise ValueError(
                f"LOCAL_RANK={local_rank} is not a local rank of a node of LOCAL_WORLD_SIZE={local_world} processes"
            )
        member = Member(
            env.get("UNISON_FT_ADDR", "127.0.0.1"),
            int(env["UNISON_FT_PORT"]),
            None if wid is None else int(wid),
            None if node is None else int(node),
            local_rank,
            local_world,
            backend,
        )
        # Before its first group: groups built for it are its membership's (Member.new_group).
        _member = member
        membership.enter(member)
        member.after_regroup.extend(after_regroup)
        try:
            member.regroup()
        except BaseException:
            _member = None
            membership.enter(None)
            member.close(finished=False)
            raise
    return _member


membership.provide(connect_with)
