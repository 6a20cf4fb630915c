"""A node's agent: ``unison launch --fault-tolerant --procs-per-node P --coordinator HOST:PORT``.

On a cluster, ``unison coordinator`` runs somewhere and every node runs one agent. The agent
starts its node's P worker processes (``LOCAL_RANK`` 0..P-1, one node id from the coordinator's
store), tells the coordinator when one of them ends (an ``exit`` message in its inbox), and takes
the whole node out when one fails: it SIGKILLs the others, as the coordinator asks through
``ft/node/<n>/failed`` when it evicts the node for a stopped heartbeat. Under ``respawn`` it then
starts the node again whole, with fresh ids, which joins as any joiner does (and heals).

SIGTERM, SIGINT or SIGHUP to the agent stops its workers (SIGTERM, SIGKILL after 5 s) and exits
128 + the signal; ``ft/abort`` (the job cannot go on) stops them and exits 1. A worker whose agent
died (SIGKILL) kills itself within a heartbeat (``UNISON_FT_AGENT_PID``, see ``member``): no orphan.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as dist

from ..messages import post
from .coordinator import STOP_GRACE_S, STOP_SIGNALS, TICK_S, node_env

logger = logging.getLogger("unison.launch")

#: Seconds between two looks at the coordinator's keys for this node.
LOOK_S = 0.2


class Agent:
    """Run one node of a job served by ``unison coordinator``: ``run()`` returns the exit code.

    Args:
        host, port: the coordinator's store.
        procs_per_node: the node's processes.
        command: each worker's command line.
        respawn: start the node again (fresh processes, a new node id) when it fails.
        max_respawns: most times the node is started again (None: no limit).
        max_start_failures: stop after this many node starts in a row whose workers all failed
            before joining (a script that fails before ``unison.init()``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        procs_per_node: int,
        command: Sequence[str],
        respawn: bool = False,
        max_respawns: Optional[int] = None,
        max_start_failures: int = 3,
    ) -> None:
        if procs_per_node < 1:
            raise ValueError(f"--procs-per-node must be at least 1, got {procs_per_node}")
        self.host, self.port, self.size, self.command = host, port, procs_per_node, list(command)
        self.respawn, self.max_respawns, self.max_start_failures = respawn, max_respawns, max_start_failures
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        except Exception as exc:
            raise RuntimeError(f"cannot reach the coordinator at {host}:{port}: {exc}") from None
        self.node: Optional[int] = None
        self.workers: dict[int, subprocess.Popen] = {}  # worker id -> process, of the current node
        self.failed: Optional[str] = None  # the coordinator took the current node out (ft/node/<n>/failed)
        self.aborted: Optional[str] = None  # ft/abort
        self.stop_signal: Optional[int] = None
        self.hurry = False
        self.respawns = 0
        self.first_code: Optional[int] = None  # the exit code of the process whose failure took the node out

    # ---- the coordinator's keys ------------------------------------------------------------------
    def _look(self) -> None:
        """Look for ``ft/abort`` and ``ft/node/<n>/failed`` (two ``check``s every ``LOOK_S``). Not a
        blocking wait as the workers' and the coordinator's: a thread blocked in a store's wait when
        the agent exits, its coordinator still up, aborts the agent's exit (std::terminate)."""
        try:
            if self.store.check(["ft/abort"]):
                self.aborted = self.store.get("ft/abort").decode()
            key = f"ft/node/{self.node}/failed"
            if self.node is not None and self.store.check([key]):
                self.failed = self.store.get(key).decode()
        except Exception as exc:  # the coordinator is gone
            self.aborted = f"the coordinator cannot be reached [{exc}]"

    # ---- the node's processes -------------------------------------------------------------------
    def start_node(self) -> None:
        """Take a node id and start its processes (each in a session of its own)."""
        self.node = node = int(self.store.add("ft/next_node", 1)) - 1
        self.failed = None
        self.workers = {}
        for local_rank in range(self.size):
            wid = int(self.store.add("ft/next_id", 1)) - 1
            env = dict(
                os.environ,
                UNISON_FT_ADDR=self.host,
                UNISON_FT_PORT=str(self.port),
                UNISON_FT_ID=str(wid),
                UNISON_FT_AGENT_PID=str(os.getpid()),
                **node_env(node, local_rank, self.size),
            )
            self.workers[wid] = subprocess.Popen(self.command, env=env, start_new_session=True)
        logger.info("node %d: worker(s) %s started", node, list(self.workers))

    def _signal(self, sig: int) -> None:
        for process in self.workers.values():
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_node(self, grace: float) -> None:
        """End the node's processes still running: SIGTERM, then SIGKILL after ``grace`` seconds."""
        if any(p.poll() is None for p in self.workers.values()) and grace > 0:
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in self.workers.values()) and time.monotonic() < deadline:
                if self.hurry:
                    break
                time.sleep(TICK_S)
        self._signal(signal.SIGKILL)  # their children too, even when the worker is gone
        for process in self.workers.values():
            process.wait()

    def _report(self, reported: set[int]) -> None:
        """Tell the coordinator of each worker that ended with an error or a signal (a clean exit
        says ``done`` itself)."""
        for wid, process in self.workers.items():
            code = process.poll()
            if code is not None and code != 0 and wid not in reported:
                reported.add(wid)
                try:
                    post(self.store, "exit", wid, code=code, node=self.node)
                except Exception:  # the coordinator is gone: nobody to tell
                    pass

    def _run_node(self) -> str:
        """Watch the current node until it ends: ``"finished"`` (every process exited 0),
        ``"failed"`` (a process failed, or the coordinator took the node out: all stopped),
        ``"aborted"`` or ``"stopped"``."""
        reported: set[int] = set()
        looked = 0.0
        while True:
            if time.monotonic() - looked >= LOOK_S:
                looked = time.monotonic()
                self._look()
            if self.stop_signal is not None:
                return "stopped"
            if self.aborted is not None:
                return "aborted"
            codes = [p.poll() for p in self.workers.values()]
            self._report(reported)
            if any(c is not None and c != 0 for c in codes) or self.failed is not None:
                self.first_code = next((c for c in codes if c not in (None, 0)), None)
                why = self.failed or f"a worker exited with {self.first_code}"
                logger.warning("node %d failed (%s): stopping its workers", self.node, why)
                self.stop_node(0.0)
                self._report(reported)
                return "failed"
            if all(c == 0 for c in codes):
                return "finished"
            time.sleep(TICK_S)

    # ---- the agent's life ----------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is not None:
            self.hurry = True
        self.stop_signal = signum

    def run(self) -> int:
        """Start the node, restart it under ``respawn``, return the exit code (0: it finished)."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue
                previous[sig] = signal.signal(sig, self._on_signal)
        quick_failures = 0
        try:
            while True:
                started = time.monotonic()
                self.start_node()
                outcome = self._run_node()
                if outcome == "finished":
                    return 0
                if outcome == "stopped":
                    assert self.stop_signal is not None
                    logger.warning("%s received: stopping the node's workers", signal.Signals(self.stop_signal).name)
                    self.stop_node(STOP_GRACE_S)
                    self._report(set())
                    return 128 + self.stop_signal
                if outcome == "aborted":
                    logger.error("the job ended: %s", self.aborted)
                    self.stop_node(STOP_GRACE_S)
                    return 1
                # A process that exits by itself (code > 0) soon after its start: the script fails at start-up.
                quick = time.monotonic() - started < 10 and (self.first_code or 0) > 0
                quick_failures = quick_failures + 1 if quick else 0
                if quick_failures >= self.max_start_failures:
                    logger.error(
                        "the node failed %d times in a row within 10 s of its start: giving up", quick_failures
                    )
                    return 1
                if not self.respawn or (self.max_respawns is not None and self.respawns >= self.max_respawns):
                    return 1
                self.respawns += 1
                logger.info("respawn: node %d failed; starting it again (replacement %d)", self.node, self.respawns)
        finally:
            self.node = None
            self.stop_node(0.0)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
