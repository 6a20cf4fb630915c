"""The coordinator of a fault-tolerant job: it hosts the store, numbers memberships and spawns workers.

A worker is known by an id that never changes; its rank is its place in the
current membership (oldest first). The coordinator talks to workers through
keys of the TCPStore it hosts (no training rank hosts it, so any rank may die):

- ``ft/join/<id>``: a worker asks to take part (its pid);
- ``ft/hb/<id>``: a counter the worker bumps every ``member.HEARTBEAT_S``;
- ``ft/leave/<id>``: a graceful leave; ``ft/done/<id>``: the worker finished;
- ``ft/members/<e>``: membership ``e`` as JSON (members, joiners, reason);
  ``ft/epoch`` is written after it, so a reader of the epoch finds its membership;
- ``ft/rebuild/<e>``: a member failed without a membership change (its group could not be built,
  or a collective failed before a death was noticed): the same members are published again.
- ``ft/abort``: why the job cannot go on (workers raise ``RankFailure``); set by the coordinator
  (too few members) or by a worker (the job's state is lost), then nobody is respawned.

The coordinator learns of a child's death at once (``poll``) and of a hang by
a heartbeat that stopped moving. It never signals a member.

What it sees goes to the ``unison.launch`` logger: regroups, leaves and
respawns at INFO, failures at WARNING, an abort at ERROR (``unison launch``
shows INFO and above).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

logger = logging.getLogger("unison.launch")

#: The level of each kind of note (``Coordinator.note``); any other kind is INFO.
LEVELS = {"failure": logging.WARNING, "abort": logging.ERROR}

#: Seconds a heartbeat may stand still before its worker is evicted.
STALE_S = 2.0
#: Seconds between two looks at children and keys.
TICK_S = 0.02


@dataclasses.dataclass
class Settings:
    """What ``unison launch --fault-tolerant`` and ``unison coordinator`` are told.

    Args:
        nproc: workers to start (0: serve workers started elsewhere).
        min_replicas: fewest members the job may train with.
        respawn: start a replacement for each worker that dies or is evicted.
        max_respawns: most replacements over the job (None: no limit).
        join_timeout: seconds the members may stay below ``min_replicas``.
        stale_s: seconds of heartbeat silence before a worker is evicted.
        expected: workers to wait for before the first membership (default nproc).
    """

    nproc: int = 0
    min_replicas: int = 1
    respawn: bool = False
    max_respawns: Optional[int] = None
    join_timeout: float = 30.0
    stale_s: float = STALE_S
    expected: Optional[int] = None


@dataclasses.dataclass
class Worker:
    id: int
    process: Optional[subprocess.Popen] = None
    beat: int = -1
    beat_seen: float = 0.0
    state: str = "starting"  # starting, waiting, member, finished, dead, evicted, left


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
        self.settings, self.command = settings, list(command or [])
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
        self.port = self.store.port  # the port bound (the OS's choice when asked for 0)
        logger.info("the job's store listens on %s:%d", host, self.port)
        self.workers: dict[int, Worker] = {}
        self.members: list[int] = []
        self.epoch = 0
        self.respawns = 0
        self.ending = False  # the job is over: no more replacements
        self.short_since: Optional[float] = None
        self.aborted: Optional[str] = None
        self.log: list[tuple[float, str, str]] = []

    # ---- workers -------------------------------------------------------------------
    def spawn(self) -> Worker:
        wid = int(self.store.add("ft/next_id", 1)) - 1
        env = dict(os.environ, UNISON_FT_ADDR="127.0.0.1", UNISON_FT_PORT=str(self.port), UNISON_FT_ID=str(wid))
        worker = Worker(wid, subprocess.Popen(self.command, env=env))
        self.workers[wid] = worker
        return worker

    def note(self, kind: str, detail: str) -> None:
        """Keep an event in ``self.log`` and log it (``LEVELS``)."""
        self.log.append((time.time(), kind, detail))
        logger.log(LEVELS.get(kind, logging.INFO), "%s: %s", kind, detail)

    def _discover(self) -> None:
        """Workers started elsewhere take ids from the store's counter: look for their join keys."""
        top = int(self.store.add("ft/next_id", 0))
        for wid in range(top):
            if wid not in self.workers and self.store.check([f"ft/join/{wid}"]):
                self.workers[wid] = Worker(wid)

    def _look(self, now: float) -> list[str]:
        """Update each worker's state; return what changed the membership."""
        reasons = []
        for w in list(self.workers.values()):
            if w.state in ("finished", "dead", "evicted", "left"):
                continue
            done = self.store.check([f"ft/done/{w.id}"])
            code = w.process.poll() if w.process is not None else None
            if code is not None or done:
                if done:
                    w.state = "finished"
                    continue
                w.state = "dead"
                reasons.append(f"worker {w.id} exited with {code}")
                self.note("failure", f"worker {w.id} (pid {w.process.pid if w.process else '?'}) exited with {code}")
                self._maybe_respawn()
                continue
            if self.store.check([f"ft/leave/{w.id}"]):
                w.state = "left"
                reasons.append(f"worker {w.id} left")
                self.note("leave", f"worker {w.id} left")
                continue
            if w.state == "starting" and self.store.check([f"ft/join/{w.id}"]):
                w.state, w.beat_seen = "waiting", now
            if w.state in ("waiting", "member"):
                beat = int(self.store.add(f"ft/hb/{w.id}", 0))
                if beat != w.beat:
                    w.beat, w.beat_seen = beat, now
                elif now - w.beat_seen > self.settings.stale_s:
                    w.state = "evicted"
                    reasons.append(f"worker {w.id} stopped answering")
                    self.note("failure", f"worker {w.id} silent for {now - w.beat_seen:.1f} s: evicted")
                    self._maybe_respawn()
        return reasons

    def _maybe_respawn(self) -> None:
        s = self.settings
        if self.ending or self.aborted is not None or any(w.state == "finished" for w in self.workers.values()):
            return  # the job is ending: a replacement would have nothing to join
        if self.command and s.respawn and (s.max_respawns is None or self.respawns < s.max_respawns):
            self.respawns += 1
            w = self.spawn()
            self.note("respawn", f"worker {w.id} started (replacement {self.respawns})")

    # ---- memberships -----------------------------------------------------------------
    def _publish(self, members: list[int], joiners: list[int], reason: str) -> None:
        self.epoch += 1
        self.members = members
        doc = {"members": members, "joiners": joiners, "reason": reason}
        self.store.set(f"ft/members/{self.epoch}", json.dumps(doc))
        self.store.set("ft/epoch", str(self.epoch))
        for wid in joiners:
            self.workers[wid].state = "member"
        self.note("regroup", f"epoch {self.epoch}: members {members} ({reason})")

    def _step(self, now: float) -> None:
        if not self.command:
            self._discover()
        reasons = self._look(now)
        if self.epoch and self.store.check([f"ft/rebuild/{self.epoch}"]):  # a member could not build its group
            reasons.append(f"the group of epoch {self.epoch} could not be built")
        alive = [wid for wid in self.members if self.workers[wid].state == "member"]
        waiting = sorted(w.id for w in self.workers.values() if w.state == "waiting")
        expected = self.settings.expected or self.settings.nproc
        if self.epoch == 0 and len(waiting) < expected:
            return  # the first membership waits for every worker of the launch
        if waiting:
            reasons.append(f"worker(s) {waiting} joined")
        finished = any(w.state == "finished" for w in self.workers.values())
        if finished and waiting:
            self.store.set("ft/over", "1")  # the job is ending: a late joiner has nothing to join
        if (reasons or waiting) and (alive or waiting) and not finished:
            self._publish(alive + waiting, waiting, "; ".join(reasons))
        self._check_quorum(now, alive + waiting if not finished else alive)

    def _check_quorum(self, now: float, current: list[int]) -> None:
        running = [w for w in self.workers.values() if w.state in ("starting", "waiting", "member")]
        if len(current) >= self.settings.min_replicas or not running:
            self.short_since = None
            return
        self.short_since = self.short_since or now
        if now - self.short_since > self.settings.join_timeout:
            self.aborted = (
                f"only {len(current)} member(s) for {self.settings.join_timeout:.0f} s, fewer than "
                f"--min-replicas {self.settings.min_replicas}"
            )
            self.store.set("ft/abort", self.aborted)
            self.note("abort", self.aborted)

    def run(self) -> int:
        """Spawn the workers, keep the memberships until every worker has exited, return the exit code."""
        for _ in range(self.settings.nproc if self.command else 0):
            self.spawn()
        while True:
            now = time.time()
            if self.aborted is None and self.store.check(["ft/abort"]):  # a worker found the job cannot go on
                self.aborted = self.store.get("ft/abort").decode()
                self.note("abort", self.aborted)
            if self.aborted is None:
                self._step(now)
            live = [
                w
                for w in self.workers.values()
                if w.process is not None and w.process.poll() is None and w.state != "evicted"
            ]
            if self.command and not live:
                break
            if (
                not self.command
                and self.workers
                and all(w.state in ("finished", "dead", "evicted", "left") for w in self.workers.values())
            ):
                break
            time.sleep(TICK_S)
        self.ending = True
        for w in self.workers.values():  # an evicted worker that never came back is no member: end it
            if w.process is not None and w.process.poll() is None:
                w.process.kill()
                w.process.wait()
        if self.aborted is None:
            self._look(time.time())  # the last exits
        finished = sum(w.state == "finished" for w in self.workers.values())
        broken = [wid for wid in self.members if self.workers[wid].state not in ("finished", "left")]
        if broken:
            self.note("failure", f"member(s) {broken} of the last membership did not finish")
        if self.aborted is not None or finished == 0 or broken:
            return 1
        return 0


def main(settings: Settings, command: Optional[Sequence[str]], port: int = 0) -> int:
    """Run a coordinator until its job ends (the ``unison launch``/``unison coordinator`` commands);
    ``port`` 0: one the OS picks."""
    return Coordinator(settings, command, port).run()
