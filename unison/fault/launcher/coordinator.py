"""The coordinator of a fault-tolerant job: it hosts the store, numbers memberships and spawns workers.

A worker is known by an id that never changes, and belongs to a node (a replica group of
``procs_per_node`` processes with consecutive ranks: the unit of failure). Its rank is its place
in the current membership (the oldest node first, a node's processes in local-rank order). The
failure of any process of a node (its death, or a heartbeat that stopped) takes the whole node
out: its other processes are stopped (SIGKILL, by the launcher or the node's agent), the other
nodes regroup, and under ``respawn`` a new node of fresh processes joins. The coordinator talks to
workers through keys of the TCPStore it hosts (no training rank hosts it, so any rank may die),
and every wait on them blocks in the store instead of polling:

- ``ft/inbox/<k>``: a message to the coordinator (JSON: a worker's ``join`` with its pid, host,
  process start time and node, ``done``, ``leave``, or an agent's ``exit`` of a worker), k from
  the counter ``ft/inbox``; a thread of the coordinator waits on the next one and deletes it once read
  (at the end, the coordinator writes the key it waits on itself, and joins it);
- ``ft/hb/<id>``: a counter the worker bumps every ``member.HEARTBEAT_S``; the coordinator reads
  every member's in one ``multi_get`` every ``BEAT_LOOK_S``;
- ``ft/members/<e>``: membership ``e`` as JSON (members, their nodes, joiners, reason), then
  ``ft/epoch``; then each joined worker's bell is rung (``member.ring``: ``ft/bell/<id>/<k>``),
  which its watcher waits on (the worker rings it itself at its end, so no thread of its is
  left inside the store when its interpreter ends);
- ``ft/holder/<id>``: the worker settled into a membership and holds the job's state;
- ``ft/rebuild/<e>``: a member failed without a membership change (its group could not be built,
  or a collective failed before a death was noticed): the same members are published again;
- ``ft/node/<n>/failed``: node n was taken out (its agent stops its processes);
- ``ft/abort``: why the job cannot go on (workers raise ``RankFailure``); set by the coordinator
  (too few members, start-up failures, a stop signal) or by a worker (the job's state is lost),
  then nobody is respawned and every joined worker's bell is rung; the coordinator looks for it
  with the heartbeats (no thread of its waits on it);
- ``ft/step``: the committed step, when a worker writes it; only the status page reads it.

Keys no longer needed are deleted: inbox messages once read, the heartbeats of ended workers,
the regroup keys (``ft/pg/<e>/ready/...``) of memberships two behind.

The coordinator learns of a child's death at once (``poll``), of a worker started by an agent
from the agent's ``exit`` message, and of a hang by a heartbeat that stopped moving. A slow
process is not a dead one: silence is counted only while the coordinator itself looks on time
(``LATE_S``: waking from a stop or a starved spell of its own, it does not find every heartbeat
stale at once), and a worker on the coordinator's machine whose heartbeat stands still while its
process runs (its CPU time grows: starved of CPU, or its heartbeat thread kept from the GIL by a
long call) stays a member up to ``SLOW_S``; a stopped or dead one goes after ``stale_s``. It never
signals a member of a healthy node while the job runs; it stops its own workers (each in a
session of its own, so its process group is the worker and its children) when it ends or is told
to stop: SIGTERM, SIGINT or SIGHUP to the launcher (then it exits 128 + the signal), a start-up
failure it will not retry (see ``Settings.max_start_failures``), or an error of its own. It
forwards each worker's stderr to its own, keeping the last lines to show when the worker fails at
start-up. A read-only status page (``status_page``) shows ``status()``.

What it sees goes to the ``unison.launch`` logger: regroups, leaves and respawns at INFO,
failures at WARNING, an abort at ERROR (``unison launch`` shows INFO and above).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch.distributed as dist

from ..messages import process_stat, ring, unring
from .status_page import StatusPage
from .template import Forked, Template

logger = logging.getLogger("unison.launch")

#: The level of each kind of note (``Coordinator.note``); any other kind is INFO.
LEVELS = {"failure": logging.WARNING, "abort": logging.ERROR, "stop": logging.WARNING, "slow": logging.WARNING}

#: Seconds a heartbeat may stand still before its worker is evicted.
STALE_S = 2.0
#: Seconds of silence one look at the heartbeats counts at most, however long since the last: a
#: coordinator that was itself stopped or starved does not take its own absence for the workers'
#: silence (it would find every heartbeat stale at once as it woke up).
LATE_S = 0.5
#: Seconds a worker on the coordinator's machine may stay silent while its process runs (its CPU
#: time grows within ``stale_s / 2``): slow, not stopped or dead, it is evicted only after this.
SLOW_S = 30.0
#: Seconds between two looks at the children (a local ``poll``, no store operation).
TICK_S = 0.02
#: Seconds between two reads of the members' heartbeats (one ``multi_get``) and of ``ft/rebuild``.
BEAT_LOOK_S = 0.1
#: Seconds a worker that exited with code 0 has for its ``done`` (or ``leave``) message to arrive.
DONE_GRACE_S = 1.0
#: How long a blocking wait on the store lasts before it is made again (it ends at once when the key comes).
WATCH_WAIT = timedelta(days=1)
#: Worker states that are final.
ENDED = ("finished", "dead", "evicted", "left")
#: Seconds a worker has between SIGTERM and SIGKILL when the launcher stops it.
STOP_GRACE_S = 5.0
#: Signals that stop the launcher and its workers (then it exits 128 + the signal).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Lines of a worker's stderr shown when it fails at start-up (and bytes kept to find them).
TAIL_LINES, TAIL_BYTES = 25, 16384


@dataclasses.dataclass
class Settings:
    """What ``unison launch --fault-tolerant`` and ``unison coordinator`` are told.

    Args:
        nproc: worker processes to start (0: serve workers started elsewhere); a multiple of
            ``procs_per_node``.
        procs_per_node: processes per node (a replica group, the unit of failure) this
            coordinator starts.
        min_replicas: fewest members (processes) the job may train with.
        respawn: start a new node for each node that fails (one of its processes died or was evicted).
        max_respawns: most nodes started again over the job (None: no limit).
        join_timeout: seconds the members may stay below ``min_replicas``.
        stale_s: seconds of heartbeat silence before a worker (and its node) is evicted (a worker
            on this machine whose process still runs: ``SLOW_S``).
        expected: workers to wait for before the first membership (default nproc).
        expected_nodes: nodes to wait for before the first membership (workers started elsewhere).
        max_start_failures: stop the job after this many workers in a row exited by themselves
            before joining (a script that fails before ``unison.init()``: every replacement
            would fail the same way), as torchrun's ``--max-restarts`` bounds restarts.
        status_port: serve the status page on this port (0: one the OS picks; None: no page).
        status_host: the address the status page listens on (loopback: this machine only).
        preload: modules a template process imports once; workers are forked from it
            (``unison.fault.launcher.template``) instead of started as ``python script``. Empty: not.
    """

    nproc: int = 0
    procs_per_node: int = 1
    min_replicas: int = 1
    respawn: bool = False
    max_respawns: Optional[int] = None
    join_timeout: float = 30.0
    stale_s: float = STALE_S
    expected: Optional[int] = None
    expected_nodes: Optional[int] = None
    max_start_failures: int = 3
    status_port: Optional[int] = None
    status_host: str = "127.0.0.1"
    preload: tuple[str, ...] = ()


@dataclasses.dataclass
class Worker:
    id: int
    process: Optional[Union[subprocess.Popen, Forked]] = None
    beat: int = -1
    beat_seen: float = 0.0
    silent_from: float = 0.0  # the coordinator's watch (``Coordinator.watch``) when the heartbeat last moved
    cpu: Optional[int] = None  # its process's CPU time at the last look during this silence
    cpu_moved: float = 0.0  # the watch when that CPU time last grew
    slow: bool = False  # logged as slow during this silence
    state: str = "starting"  # starting, waiting, member, finished, dead, evicted, left
    pid: Optional[int] = None
    process_start: Optional[int] = None  # when its process started (``member.process_stat``), as its join says
    node: Optional[int] = None
    local_rank: int = 0
    node_size: int = 1
    host: Optional[str] = None
    started_at: Optional[float] = None
    joined_at: Optional[float] = None
    ended_at: Optional[float] = None
    exit_code: Optional[int] = None
    exited_at: Optional[float] = None  # when its exit (code 0) was seen, its done message not yet
    stderr: Optional["StderrTail"] = None


class StderrTail:
    """Copy a worker's stderr to the launcher's (fd 2) as it comes, keeping its last bytes."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.kept: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._copy, name="unison-stderr", daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        fd = self.pipe.fileno()
        while chunk := os.read(fd, 65536):
            view = memoryview(chunk)
            while view:
                try:
                    view = view[os.write(2, view) :]
                except OSError:  # the launcher's stderr is gone: keep the tail all the same
                    break
            with self.lock:
                self.kept.append(chunk)
                self.size += len(chunk)
                while self.size - len(self.kept[0]) >= TAIL_BYTES:
                    self.size -= len(self.kept.popleft())
        self.pipe.close()

    def lines(self, wait: float = 1.0) -> list[str]:
        """The last ``TAIL_LINES`` lines (after waiting up to ``wait`` s for the pipe's end)."""
        self.thread.join(wait)
        with self.lock:
            text = b"".join(self.kept).decode(errors="replace")
        return text.rstrip("\n").splitlines()[-TAIL_LINES:]


class Coordinator:
    """Serve one job: ``run()`` returns the launcher's exit code.

    Args:
        settings: the job's Settings.
        command: the worker's command line (None: workers are started elsewhere).
        port: the store's port on ``host``; 0 (the default): one the OS picks as the
            store binds it, then ``self.port``.
        host: the address the store listens on.
    """

    def __init__(
        self, settings: Settings, command: Optional[Sequence[str]], port: int = 0, host: str = "0.0.0.0"
    ) -> None:
        if settings.min_replicas < 1:
            raise ValueError(f"--min-replicas must be at least 1, got {settings.min_replicas}")
        if settings.nproc and settings.min_replicas > settings.nproc:
            raise ValueError(f"--min-replicas {settings.min_replicas} is more than --nproc {settings.nproc}")
        if settings.max_start_failures < 1:
            raise ValueError(f"--max-start-failures must be at least 1, got {settings.max_start_failures}")
        if settings.procs_per_node < 1 or settings.nproc % settings.procs_per_node:
            raise ValueError(
                f"{settings.nproc} worker processes do not make whole nodes of --procs-per-node "
                f"{settings.procs_per_node}"
            )
        self.settings, self.command = settings, list(command or [])
        # Workers forked from a template (``--preload``): made first, so that it is forked from this
        # process before the store starts its threads (``Template``); it imports while ``run`` gets going.
        template = Template(settings.preload) if settings.preload and self.command else None
        self.template = template  # (a worker forked from it leaves Template() by SystemExit: no handler here)
        try:
            self._serve(host, port)
        except BaseException:
            if template is not None:
                template.close()
            raise

    def _serve(self, host: str, port: int) -> None:
        """The store, the status page, the state of the job and the inbox's thread (``__init__``)."""
        settings = self.settings
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.host, self.port = host, self.store.port  # the port bound (the OS's choice when asked for 0)
        self.hostname = socket.gethostname()  # a worker whose join names it runs on this machine
        self.page: Optional[StatusPage] = None
        if settings.status_port is not None:
            try:
                self.page = StatusPage(self.status, settings.status_host, settings.status_port)
            except OSError as exc:
                raise ValueError(
                    f"the status page cannot listen on {settings.status_host}:{settings.status_port} ({exc}): "
                    "choose another --status-port, 0 for one the OS picks, or --no-status"
                ) from None
        logger.info("the job's store listens on %s:%d", host, self.port)
        self.workers: dict[int, Worker] = {}
        self.members: list[int] = []
        self.epoch = 0
        self.respawns = 0
        self.ending = False  # the job is over: no more replacements
        self.short_since: Optional[float] = None
        self.aborted: Optional[str] = None
        # A member finished without joining the membership the others gather in (it can never be
        # built): why, until the next step publishes one without it.
        self.unbuildable: Optional[str] = None
        self.log: list[tuple[float, str, str]] = []
        self.events: list[dict[str, Any]] = []  # self.log's entries with their fields (the status page's)
        self.start_failures = 0  # workers in a row that exited by themselves before joining
        self.failed_nodes: dict[int, str] = {}  # node -> why it was taken out
        self.started_at = time.time()
        self.stop_signal: Optional[int] = None  # a stop signal received (the second: SIGKILL at once)
        self.hurry = False
        self.given_up = False  # a start-up failure ended the job: the other workers are stopped
        self.lock = threading.Lock()  # the loop's changes against status()
        self._beats_looked = time.monotonic()  # when the heartbeats were last read
        self.watch = 0.0  # seconds of the workers' silence counted so far (LATE_S at most a look)
        # Messages come through a thread blocked in the store on a client of its own; ``ft/abort``
        # is looked for with the heartbeats. The thread is woken and joined at the end (``_close_inbox``):
        # a thread inside the store when the interpreter ends aborts the launcher ("terminate called").
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._abort_seen: Optional[str] = None
        self._inbox_key = "ft/inbox/1"  # the key the thread waits on
        self._inbox_closing = False
        client = dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=30))
        self._inbox_thread = threading.Thread(
            target=self._read_inbox, args=(client,), name="unison-coordinator-inbox", daemon=True
        )
        self._inbox_thread.start()  # last: a constructor that raised leaves no thread in the store

    # ---- the store's messages ------------------------------------------------------------
    def _read_inbox(self, client: dist.TCPStore) -> None:
        """Wait for each message ``ft/inbox/<k>`` in turn, hand it to the loop, delete it; return
        once ``_close_inbox`` has woken it."""
        k = 1
        while not self._inbox_closing:
            key = self._inbox_key = f"ft/inbox/{k}"
            try:
                client.wait([key], WATCH_WAIT)
                if self._inbox_closing:
                    return
                self._inbox.put(json.loads(client.get(key)))
                client.delete_key(key)
            except dist.DistStoreError:
                continue  # the day-long wait ran out
            except Exception:  # the store is gone: the coordinator is ending
                return
            k += 1

    def _close_inbox(self) -> None:
        """Wake the inbox's thread (its key written, whoever was to write it) and join it, so that
        no thread is inside the store when the interpreter ends."""
        self._inbox_closing = True
        deadline = time.monotonic() + STOP_GRACE_S
        while self._inbox_thread.is_alive() and time.monotonic() < deadline:
            key = self._inbox_key
            try:
                if not self.store.check([key]):
                    self.store.set(key, "{}")
            except Exception:  # the store failed: the thread's wait fails with it
                pass
            self._inbox_thread.join(0.05)

    # ---- workers -------------------------------------------------------------------
    def spawn_node(self) -> list[Worker]:
        """Start a node: ``procs_per_node`` workers with consecutive local ranks (``spawn``)."""
        node = int(self.store.add("ft/next_node", 1)) - 1
        size = self.settings.procs_per_node
        return [self.spawn(node, local_rank, size) for local_rank in range(size)]

    def spawn(self, node: Optional[int] = None, local_rank: int = 0, size: int = 1) -> Worker:
        """Start a worker in a session of its own (a terminal's Ctrl-C reaches the launcher only,
        which stops the workers in order), its stderr through ``StderrTail``; no ``preexec_fn``,
        unsafe in a process with threads."""
        if node is None:
            node = int(self.store.add("ft/next_node", 1)) - 1
        wid = int(self.store.add("ft/next_id", 1)) - 1
        env = dict(
            os.environ,
            UNISON_FT_ADDR="127.0.0.1",
            UNISON_FT_PORT=str(self.port),
            UNISON_FT_ID=str(wid),
            **node_env(node, local_rank, size),
        )
        process: Union[subprocess.Popen, Forked]
        if self.template is not None:
            process = self.template.spawn(self.command, env)
        else:
            process = subprocess.Popen(self.command, env=env, stderr=subprocess.PIPE, start_new_session=True)
        worker = Worker(
            wid,
            process,
            pid=process.pid,
            node=node,
            local_rank=local_rank,
            node_size=size,
            started_at=time.time(),
            stderr=StderrTail(process.stderr),
        )
        self.workers[wid] = worker
        return worker

    def note(self, kind: str, detail: str, **fields: Any) -> None:
        """Keep an event in ``self.log`` (and ``fields`` in ``self.events``) and log it (``LEVELS``)."""
        now = time.time()
        self.log.append((now, kind, detail))
        self.events.append({"time": now, "kind": kind, "detail": detail, **fields})
        logger.log(LEVELS.get(kind, logging.INFO), "%s: %s", kind, detail)

    def _look(self, now: float) -> list[str]:
        """Update each worker's state (messages, children, heartbeats); return what changed the membership."""
        reasons: list[str] = []
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._message(message, now, reasons)
        for w in list(self.workers.values()):
            if w.state in ENDED or w.process is None:
                continue
            code = w.process.poll()
            if code is not None:
                self._exited(w, code, now, reasons)
        looked = time.monotonic()
        if looked - self._beats_looked >= BEAT_LOOK_S:
            self.watch += min(looked - self._beats_looked, LATE_S)
            self._beats_looked = looked
            self._look_at_beats(now, reasons)
        return reasons

    def _message(self, message: dict[str, Any], now: float, reasons: list[str]) -> None:
        wid, kind = int(message["worker"]), message["kind"]
        w = self.workers.get(wid)
        if w is None:  # started elsewhere (an agent, or by hand)
            w = self.workers[wid] = Worker(wid, started_at=now)
        if kind == "join":
            w.pid, w.host = message.get("pid", w.pid), message.get("host")
            w.process_start = message.get("process_start")
            w.node, w.local_rank = int(message["node"]), int(message.get("local_rank", 0))
            w.node_size = int(message.get("local_world_size", 1))
            if w.state != "starting":
                return
            if w.node in self.failed_nodes:  # its node was taken out before it joined
                w.state, w.ended_at = "evicted", now
                self._tell_node(w.node, self.failed_nodes[w.node])
                return
            w.state, w.beat_seen, w.joined_at, w.silent_from = "waiting", now, now, self.watch
            self.start_failures = 0  # the script gets as far as unison.init()
        elif kind == "done":
            if w.state not in ENDED:
                gathering = w.state == "member" and wid in self.members and self.epoch > 0
                w.state, w.ended_at = "finished", now
                w.exit_code = w.process.poll() if w.process is not None else None
                self._forget(w)
                if gathering and not self.store.check([f"ft/pg/{self.epoch}/ready/{wid}"]):
                    # It never said it was ready for the newest membership: nobody can build that one.
                    self.unbuildable = f"worker {wid} finished before membership {self.epoch} was built"
        elif kind == "leave":
            if w.state in ENDED:
                return
            w.state, w.ended_at = "left", now
            siblings = self._siblings(w)
            for s in siblings:  # a node leaves whole: the others take no part any more
                s.state, s.ended_at = "left", now
            self._forget(w, *siblings)
            also = f" (node {w.node}: worker(s) {[s.id for s in siblings]} too)" if siblings else ""
            reasons.append(f"worker {w.id} left")
            self.note("leave", f"worker {w.id} left{also}", worker=w.id, node=w.node)
        elif kind == "exit":  # an agent saw its worker end
            if w.state not in ENDED:
                self._exited(w, message.get("code"), now, reasons, reported=True)

    def _siblings(self, w: Worker) -> list[Worker]:
        """The other processes of ``w``'s node that still take part."""
        return [
            s
            for s in self.workers.values()
            if s is not w and s.node is not None and s.node == w.node and s.state not in ENDED
        ]

    def _exited(self, w: Worker, code: Optional[int], now: float, reasons: list[str], reported: bool = False) -> None:
        """Worker ``w`` ended with ``code``: finished (its done message came), or a failure of its node."""
        if code == 0 and not reported:
            # It said it is done just before it exited (or left): the message is on its way.
            w.exited_at = w.exited_at or now
            if now - w.exited_at < DONE_GRACE_S:
                return
        w.exit_code, w.ended_at = code, now
        starting, w.state = w.state == "starting", "dead"
        reasons.append(f"worker {w.id} exited with {code}")
        self.note("failure", f"worker {w.id} (pid {w.pid or '?'}) exited with {code}", worker=w.id, exit_code=code)
        self._node_failed(w, f"worker {w.id} exited with {code}", now)
        if not ((starting or self.epoch == 0) and self._start_failed(w, code, starting)):
            self._maybe_respawn(w)

    def _look_at_beats(self, now: float, reasons: list[str]) -> None:
        """Read every joined worker's heartbeat in one ``multi_get``: one that stood still for
        ``stale_s`` (counted on ``watch``) is evicted with its node, unless its process runs
        (``_runs``): that one is slow, and evicted after ``SLOW_S``. Look for ``ft/abort`` and ``ft/rebuild/<epoch>`` too."""
        watched = [w for w in self.workers.values() if w.state in ("waiting", "member")]
        if self._abort_seen is None and self.store.check(["ft/abort"]):  # a worker found the job cannot go on
            self._abort_seen = self.store.get("ft/abort").decode()
        if self.epoch and self.store.check([f"ft/rebuild/{self.epoch}"]):  # a member could not build its group
            reasons.append(f"the group of epoch {self.epoch} could not be built")
        if not watched:
            return
        beats = self.store.multi_get([f"ft/hb/{w.id}" for w in watched])
        for w, value in zip(watched, beats):
            if w.state not in ("waiting", "member"):
                continue  # evicted with its node above
            beat = int(value)
            if beat != w.beat:
                w.beat, w.beat_seen, w.silent_from, w.cpu, w.slow = beat, now, self.watch, None, False
                continue
            silent, stale_s = self.watch - w.silent_from, self.settings.stale_s
            runs = silent > stale_s / 4 and self._runs(w)  # no /proc read between two heartbeats
            if silent <= stale_s:
                continue
            slow_s = max(SLOW_S, stale_s)
            if runs and silent <= slow_s:
                if not w.slow:
                    w.slow = True
                    self.note(
                        "slow",
                        f"worker {w.id} silent for {silent:.1f} s, but its process runs (starved of CPU, or its "
                        f"heartbeat thread kept from the GIL): kept, up to {slow_s:.0f} s",
                        worker=w.id,
                    )
                continue
            w.state, w.ended_at = "evicted", now
            reasons.append(f"worker {w.id} stopped answering")
            self.note("failure", f"worker {w.id} silent for {silent:.1f} s: evicted", worker=w.id)
            self._node_failed(w, f"worker {w.id} stopped answering", now)
            self._maybe_respawn(w)

    def _runs(self, w: Worker) -> bool:
        """Whether ``w``'s process is runnable (waiting for a core: starved) or used CPU time within
        the last ``stale_s / 2`` of its silence, and is neither stopped nor dead: read in /proc for
        a process of this machine (the pid and start time its join gave); one on another machine is
        not looked at."""
        stat = None
        if w.host == self.hostname and w.pid is not None and w.process_start is not None:
            stat = process_stat(w.pid)
        if stat is None or int(stat[19]) != w.process_start or stat[0] in (b"T", b"t", b"Z", b"X"):
            return False
        cpu = int(stat[11]) + int(stat[12])
        if cpu != w.cpu:
            w.cpu, w.cpu_moved = cpu, self.watch
        return stat[0] == b"R" or self.watch - w.cpu_moved < self.settings.stale_s / 2

    def _node_failed(self, w: Worker, why: str, now: float) -> None:
        """``w`` failed: take its node out. Its other processes are evicted and stopped (SIGKILL to
        those this coordinator started; a node's agent stops its own on ``ft/node/<n>/failed``)."""
        if w.node is None:
            return
        self.failed_nodes.setdefault(w.node, why)
        siblings = self._siblings(w)
        for s in siblings:
            s.state, s.ended_at = "evicted", now
        self._signal_workers([s for s in siblings if s.process is not None], signal.SIGKILL)
        self._tell_node(w.node, why)
        if siblings or w.node_size > 1:
            self.note(
                "failure",
                f"node {w.node} taken out ({why}): its worker(s) {[s.id for s in siblings]} stopped",
                node=w.node,
                workers=[s.id for s in siblings],
            )
        self._forget(w, *siblings)

    def _tell_node(self, node: int, why: str) -> None:
        try:
            self.store.set(f"ft/node/{node}/failed", why)
        except Exception:  # the store is ours; a failure here must not stop the loop
            pass

    def _forget(self, *workers: Worker) -> None:
        """Delete the keys of workers that ended (a stopped one that resumes writes its heartbeat
        again). The bell's keys go only with a worker that died: one that ended by itself deletes
        them once its watcher has left (deleted here, the key it is about to wait on could go
        first), and an evicted one may resume and must still hear of the membership without it."""
        for w in workers:
            self.store.delete_key(f"ft/hb/{w.id}")
            self.store.delete_key(f"ft/holder/{w.id}")
            if w.state == "dead":
                unring(self.store, w.id)

    def _ring_all(self) -> None:
        """Wake the watcher of every worker that may be running (an evicted one too: it may
        resume, and must learn that it was left out; a starting one finds its bell rung): a
        membership was published, or the job aborted."""
        for w in self.workers.values():
            if w.state in ("starting", "waiting", "member", "evicted"):
                ring(self.store, w.id)

    def _ring_late_joiners(self) -> None:
        """After an abort no message is handled any more, but a worker started elsewhere that
        joins now must hear of it too: ring each one whose join comes."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message["kind"] == "join":
                ring(self.store, int(message["worker"]))

    def _abort(self, why: str) -> None:
        """End the job: ``ft/abort`` says why, and every joined worker is woken to read it."""
        self.aborted = why
        self.store.set("ft/abort", why)
        self._ring_all()

    def _may_respawn(self) -> bool:
        s = self.settings
        if self.ending or self.aborted is not None or any(w.state == "finished" for w in self.workers.values()):
            return False  # the job is ending: a replacement would have nothing to join
        return bool(self.command and s.respawn and (s.max_respawns is None or self.respawns < s.max_respawns))

    def _maybe_respawn(self, failed: Worker) -> None:
        """Start a new node for ``failed``'s (once per node: its siblings were evicted with it)."""
        if self._may_respawn():
            self.respawns += 1
            started = self.spawn_node()
            ids = [w.id for w in started]
            what = f"worker {ids[0]}" if len(ids) == 1 else f"node {started[0].node}: workers {ids}"
            self.note(
                "respawn",
                f"{what} started (replacement {self.respawns})",
                worker=ids[0],
                workers=ids,
                node=started[0].node,
            )

    def _start_failed(self, w: Worker, code: Optional[int], starting: bool) -> bool:
        """Worker ``w`` ended before it joined (``starting``) or before the first membership: give
        up the job (True) when this is the ``max_start_failures``-th worker in a row to exit by
        itself before joining (a killed one is not the script's fault), or when the first
        membership waits for it and no replacement comes (a worker this coordinator started)."""
        if self.aborted is not None:
            return True  # the job is over already: no replacement, no second verdict
        if starting and code is not None and code >= 0:
            self.start_failures += 1
        limit = self.settings.max_start_failures
        if self.start_failures >= limit:
            why = (
                f"{self.start_failures} worker(s) in a row exited before joining (--max-start-failures {limit}): "
                "the script fails before unison.init(); fix it and launch again"
            )
        elif self.epoch == 0 and self.command and not self._may_respawn():
            why = "a worker exited before the first membership, which waits for it, and none replaces it"
        else:
            return False
        self.given_up = True
        self._abort(f"{why}; worker {w.id} (pid {w.pid}) exited with {code}")
        tail = w.stderr.lines() if w.stderr is not None else []
        shown = "".join(f"\n  | {line}" for line in tail) or "\n  | (nothing)"
        self.note("abort", f"{self.aborted}. Its last lines of stderr:{shown}", worker=w.id, exit_code=code)
        return True

    # ---- memberships -----------------------------------------------------------------
    def _publish(self, members: list[int], joiners: list[int], reason: str) -> None:
        self.epoch += 1
        self.members = members
        nodes = [self.workers[wid].node for wid in members]
        doc = {"members": members, "nodes": nodes, "joiners": joiners, "reason": reason}
        self.store.set(f"ft/members/{self.epoch}", json.dumps(doc))
        self.store.set("ft/epoch", str(self.epoch))
        for wid in joiners:
            self.workers[wid].state = "member"
        self._ring_all()
        self.note(
            "regroup",
            f"epoch {self.epoch}: members {members} ({reason})",
            epoch=self.epoch,
            members=members,
            nodes=nodes,
            joiners=joiners,
        )
        self._clean(self.epoch - 2)

    def _clean(self, epoch: int) -> None:
        """Delete the regroup keys of membership ``epoch`` (two behind: nobody builds it any more)."""
        doc = next((e for e in self.events if e.get("epoch") == epoch and e["kind"] == "regroup"), None)
        if doc is None:
            return
        for wid in doc["members"]:
            self.store.delete_key(f"ft/pg/{epoch}/ready/{wid}")
        self.store.delete_key(f"ft/pg/{epoch}/outcome")
        self.store.delete_key(f"ft/rebuild/{epoch}")

    def _ready_nodes(self) -> list[int]:
        """The waiting workers of whole nodes (every process of the node joined), node by node in
        the order they came, each node's in local-rank order: a node is admitted whole."""
        by_node: dict[int, list[Worker]] = {}
        for w in self.workers.values():
            if w.state == "waiting" and w.node is not None:
                by_node.setdefault(w.node, []).append(w)
        ready = []
        for node in sorted(by_node):
            group = sorted(by_node[node], key=lambda w: w.local_rank)
            if len(group) == group[0].node_size and node not in self.failed_nodes:
                ready += [w.id for w in group]
        return ready

    def _step(self, now: float) -> None:
        reasons = self._look(now)
        alive = [wid for wid in self.members if self.workers[wid].state == "member"]
        waiting = self._ready_nodes()
        if self.epoch == 0:
            s = self.settings
            nodes = len({self.workers[wid].node for wid in waiting})
            if (s.expected_nodes and nodes < s.expected_nodes) or len(waiting) < (s.expected or s.nproc):
                return  # the first membership waits for every worker of the launch
        if waiting:
            reasons.append(f"worker(s) {waiting} joined")
        finished = any(w.state == "finished" for w in self.workers.values())
        if finished and waiting:
            self.store.set("ft/over", "1")  # the job is ending: a late joiner has nothing to join
        if self.unbuildable is not None:
            why, self.unbuildable = self.unbuildable, None
            self._publish_without_finished(alive, why)
        elif (reasons or waiting) and (alive or waiting) and not finished:
            self._publish(alive + waiting, waiting, "; ".join(reasons))
        self._check_quorum(now, alive + waiting if not finished else alive)

    def _publish_without_finished(self, alive: list[int], why: str) -> None:
        """A member finished while the others gathered in a membership that counted it: they (and
        a joiner admitted with it) would wait for it in vain. Publish the members still running,
        who regroup without it, if one of them holds the job's state; else the job is over for
        the joiners (an empty membership, and ``ft/over``: they find the job finished)."""
        holders = [wid for wid in alive if self.store.check([f"ft/holder/{wid}"])]
        if holders:
            self._publish(alive, [wid for wid in alive if wid not in holders], f"{why}: the others go on without it")
            return
        self.store.set("ft/over", "1")
        self._publish([], [], f"{why}; nobody left holds the job's state: the job is over")

    def _check_quorum(self, now: float, current: list[int]) -> None:
        running = [w for w in self.workers.values() if w.state in ("starting", "waiting", "member")]
        if len(current) >= self.settings.min_replicas or not running:
            self.short_since = None
            return
        self.short_since = self.short_since or now
        if now - self.short_since > self.settings.join_timeout:
            self._abort(
                f"only {len(current)} member(s) for {self.settings.join_timeout:.0f} s, fewer than "
                f"--min-replicas {self.settings.min_replicas}"
            )
            self.note("abort", self.aborted or "")

    # ---- stopping ------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Any) -> None:
        """A stop signal: the loop ends and stops the workers; a second one skips the grace."""
        if self.stop_signal is not None:
            self.hurry = True
        self.stop_signal = signum

    def _signal_workers(self, workers: list[Worker], sig: int) -> None:
        """Send ``sig`` to each worker's process group (the worker and its children)."""
        for w in workers:
            assert w.process is not None
            try:
                os.killpg(w.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_workers(self, grace: float = STOP_GRACE_S) -> None:
        """End every worker still running: SIGTERM, then SIGKILL after ``grace`` seconds."""
        live = [w for w in self.workers.values() if w.process is not None and w.process.poll() is None]
        if not live:
            return
        self._signal_workers(live, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(w.process.poll() is None for w in live if w.process) and time.monotonic() < deadline:
            if self.hurry:
                break
            time.sleep(TICK_S)
        self._signal_workers(live, signal.SIGKILL)  # their children too, even when the worker is gone
        for w in live:
            assert w.process is not None
            w.process.wait()

    def _install_handlers(self) -> dict[int, Any]:
        """Catch the stop signals (main thread only; a SIGINT ignored on entry, as in a
        background job of a shell, stays ignored); return the handlers to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for sig in STOP_SIGNALS:
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                continue
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def run(self) -> int:
        """Spawn the workers, keep the memberships until every worker has exited, return the exit code.

        A stop signal ends the workers (``stop_workers``) and returns 128 + the signal; an error
        of the coordinator's own ends them too before it is raised: no worker outlives the launcher.
        """
        previous = self._install_handlers()
        if self.page is not None:
            self.page.start()
            logger.info("status: %s", self.page.url)
        try:
            with self.lock:
                for _ in range(self.settings.nproc // self.settings.procs_per_node if self.command else 0):
                    self.spawn_node()
            self._loop()
            if self.stop_signal is not None:
                return self._stopped()
            if self.given_up:
                self.stop_workers()  # the others are stopped, not waited for
            return self._end()
        finally:
            self.ending = True
            self.stop_workers()
            if self.template is not None:
                self.template.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.page is not None:
                self.page.close()
            self._close_inbox()

    def _loop(self) -> None:
        """Look at workers and keys until the job is over, given up, or told to stop."""
        while self.stop_signal is None:
            with self.lock:
                now = time.time()
                if self.aborted is None and self._abort_seen is not None:  # a worker found the job cannot go on
                    self.aborted = self._abort_seen
                    self._ring_all()
                    self.note("abort", self.aborted)
                if self.aborted is None:
                    self._step(now)
                else:
                    self._ring_late_joiners()
                if self.given_up:
                    return
                live = [
                    w
                    for w in self.workers.values()
                    if w.process is not None
                    and (w.process.poll() is None or (w.exited_at is not None and w.state not in ENDED))
                    and w.state != "evicted"
                ]
                if self.command and not live:
                    return
                if not self.command and self.workers and all(w.state in ENDED for w in self.workers.values()):
                    return
            time.sleep(TICK_S)

    def _stopped(self) -> int:
        """A stop signal came: tell workers started elsewhere (``ft/abort``), end ours, exit 128 + it."""
        assert self.stop_signal is not None
        name = signal.Signals(self.stop_signal).name
        with self.lock:
            self.ending = True
            try:
                self._abort(self.aborted or f"the coordinator received {name}")
            except Exception:  # the store is ours; a failure here must not keep the workers alive
                self.aborted = self.aborted or f"the coordinator received {name}"
            running = sum(w.process is not None and w.process.poll() is None for w in self.workers.values())
            self.note(
                "stop", f"{name} received: stopping {running} worker(s) (SIGTERM, SIGKILL after {STOP_GRACE_S:.0f} s)"
            )
        self.stop_workers()
        return 128 + self.stop_signal

    def _end(self) -> int:
        """The exit code of a job that ended by itself (0: every member of the last membership finished)."""
        self.ending = True
        with self.lock:
            self.stop_workers(0.0)  # an evicted worker that never came back is no member: end it
            if self.aborted is None:
                self._look(time.time())  # the last exits
                deadline = time.monotonic() + 2 * DONE_GRACE_S  # and the done messages on their way
                while time.monotonic() < deadline and any(
                    w.exited_at is not None and w.state not in ENDED for w in self.workers.values()
                ):
                    time.sleep(TICK_S)
                    self._look(time.time())
        finished = sum(w.state == "finished" for w in self.workers.values())
        broken = [wid for wid in self.members if self.workers[wid].state not in ("finished", "left")]
        if broken:
            self.note("failure", f"member(s) {broken} of the last membership did not finish")
        # A worker's "done" comes from its atexit handler, which also runs for sys.exit(3): the exit
        # status it then ends with is the script's word on how it went, as under torchrun; a signal
        # after "done" (an abort in the interpreter's end, a kill) is a failure too.
        failed_after = []
        for w in self.workers.values():
            code = w.process.poll() if w.process is not None and w.state == "finished" else None
            if code is not None and code > 0:
                failed_after.append(w.id)
                note = f"worker {w.id} (pid {w.pid or '?'}) finished, then exited with {code}"
                self.note("failure", note, worker=w.id, exit_code=code)
            elif code is not None and code < 0:
                failed_after.append(w.id)
                name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
                note = f"worker {w.id} (pid {w.pid or '?'}) finished, then died by {name} as it exited"
                self.note("failure", note, worker=w.id, exit_code=code)
        if self.aborted is not None or finished == 0 or broken or failed_after:
            return 1
        return 0

    # ---- the status page --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What the status page shows (its JSON): see docs/fault-tolerance.md, "The status page"."""
        with self.lock:
            now = time.time()
            rank = {wid: r for r, wid in enumerate(self.members)}
            step = self.store.get("ft/step").decode() if self.store.check(["ft/step"]) else None
            if self.stop_signal is not None:
                state = "stopping"
            elif self.aborted is not None:
                state = "aborted"
            elif self.ending:
                state = "ending"
            else:
                state = "starting" if self.epoch == 0 else "running"
            workers = [
                {
                    "id": w.id,
                    "pid": w.pid,
                    "node": w.node,
                    "local_rank": w.local_rank,
                    "host": w.host,
                    "rank": rank.get(w.id) if w.state == "member" else None,
                    "state": w.state,
                    "started_at": w.started_at,
                    "joined_at": w.joined_at,
                    "ended_at": w.ended_at,
                    "exit_code": w.exit_code,
                    "heartbeats": max(w.beat, 0),
                    "last_heartbeat_s_ago": round(now - w.beat_seen, 3) if w.beat >= 0 else None,
                }
                for w in sorted(self.workers.values(), key=lambda w: w.id)
            ]
            events = [dict(e) for e in self.events]
            nodes = self._nodes(rank)
        s = self.settings
        return {
            "job": {
                "state": state,
                "started_at": self.started_at,
                "uptime_s": round(now - self.started_at, 3),
                "store": f"{self.host}:{self.port}",
                "command": self.command,
                "nproc": s.nproc or s.expected,
                "procs_per_node": s.procs_per_node,
                "nodes": s.nproc // s.procs_per_node if s.nproc else s.expected_nodes,
                "min_replicas": s.min_replicas,
                "respawn": s.respawn,
                "max_respawns": s.max_respawns,
            },
            "time": now,
            "epoch": self.epoch,
            "members": list(self.members),
            "committed_step": int(step) if step is not None and step.isdigit() else None,
            "aborted": self.aborted,
            "nodes": nodes,
            "workers": workers,
            "failures": [e for e in events if e["kind"] == "failure"],
            "joins": [
                {"time": e["time"], "epoch": e["epoch"], "workers": e["joiners"]}
                for e in events
                if e["kind"] == "regroup" and e["epoch"] > 1 and e["joiners"]
            ],
            "respawns": [e for e in events if e["kind"] == "respawn"],
            "events": events,
        }

    def _nodes(self, rank: dict[int, int]) -> list[dict[str, Any]]:
        """The nodes (the status page's), from their workers: a node is a ``member`` while all its
        workers are; ``failed`` once one of them failed (the rest were stopped)."""
        by_node: dict[int, list[Worker]] = {}
        for w in sorted(self.workers.values(), key=lambda w: (w.local_rank, w.id)):
            if w.node is not None:
                by_node.setdefault(w.node, []).append(w)
        nodes = []
        for node, workers in sorted(by_node.items()):
            states = {w.state for w in workers}
            if node in self.failed_nodes:
                state = "failed"
            elif len(states) == 1:
                state = states.pop()
            elif states <= set(ENDED):
                state = "finished" if "finished" in states else "left"
            else:
                state = "starting" if "starting" in states else "waiting"
            nodes.append(
                {
                    "id": node,
                    "state": state,
                    "size": workers[0].node_size,
                    "host": workers[0].host,
                    "workers": [w.id for w in workers],
                    "ranks": [rank.get(w.id) if w.state == "member" else None for w in workers],
                    "failure": self.failed_nodes.get(node),
                }
            )
        return nodes


def node_env(node: int, local_rank: int, size: int) -> dict[str, str]:
    """The environment that places a worker in its node: ``UNISON_FT_NODE``, and torch's
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (which unison.init reads under fault tolerance)."""
    return {"UNISON_FT_NODE": str(node), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(size)}


def main(settings: Settings, command: Optional[Sequence[str]], port: int = 0) -> int:
    """Run a coordinator until its job ends (the ``unison launch``/``unison coordinator`` commands);
    ``port`` 0: one the OS picks."""
    return Coordinator(settings, command, port).run()
