"""`unison launch --fault-tolerant` as an operator sees it: stop signals end every worker, a
script that fails at start-up is not restarted for ever, and the status page shows the job
during a kill. Real processes, each launcher capped in time; only the processes a test started
(the launcher, and the workers whose pids they wrote) are ever signalled."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_ledger.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LIMIT_S = 60


class Launcher:
    """A ``unison launch --fault-tolerant`` this test started, its stderr read as it comes.

    It starts as from a terminal, with Ctrl-C's default meaning (an ignored SIGINT is
    inherited across exec, and a library an earlier test loaded may have left it ignored)."""

    def __init__(self, out: Path, *args: str, nproc: Optional[int] = 2, script: Path = SCRIPT) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant"]
        cmd += ([] if nproc is None else ["--nproc", str(nproc)]) + [*args, str(script)]
        cmd += ["--out", str(out), "--steps", "100000", "--sleep", "0.05"] if script == SCRIPT else [str(out)]
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
        finally:
            signal.signal(signal.SIGINT, previous)
        self.started = time.monotonic()
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def pids(self, mark: str = "pid") -> list[int]:
        """The workers that wrote OUT/<mark>-<pid> (ft_ledger.py: pid, joined, ready)."""
        return sorted(int(p.name.split("-")[1]) for p in self.out.glob(f"{mark}-*"))

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 40.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            assert self.proc.poll() is None, (
                f"the launcher ended ({self.proc.returncode}) before {what}:\n{self.tail()}"
            )
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {timeout:.0f} s:\n{self.tail()}")

    def wait(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def close(self) -> None:
        """SIGKILL what is left of this test's processes: the launcher, then the workers it started."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._reader.join(5)

    # ---- the status page ------------------------------------------------------------------
    def status_url(self) -> str:
        return self.wait_for(
            "status line", lambda: next((m.group(1) for x in self.lines if (m := STATUS_LINE.search(x))), None)
        )

    def status(self) -> dict:
        with urllib.request.urlopen(self.status_url() + "status.json", timeout=5) as reply:
            return json.load(reply)


STATUS_LINE = re.compile(r"INFO unison\.launch: status: (http://127\.0\.0\.1:\d+/)$")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture
def launcher(tmp_path):
    started: list[Launcher] = []

    def start(*args: str, **kw: Any) -> Launcher:
        started.append(Launcher(tmp_path / f"job{len(started)}", *args, **kw))
        return started[-1]

    yield start
    for job in started:
        job.close()


# ---- stop signals ----------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_every_worker_and_exits_128_plus_it(launcher, sig):
    job = launcher("--no-status")
    workers = job.wait_for("two training workers", lambda: len(job.pids("ready")) == 2 and job.pids())
    job.proc.send_signal(sig)
    assert job.wait() == 128 + sig, job.tail()
    assert gone_within(workers, 3.0) == [], job.tail()
    assert f"stop: {signal.Signals(sig).name} received: stopping 2 worker(s)" in job.stderr


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(launcher, tmp_path):
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "open(os.path.join(sys.argv[1], f'pid-{os.getpid()}'), 'w').close()\n"
        "while True:\n    time.sleep(0.1)\n"
    )
    job = launcher("--no-status", nproc=1, script=stubborn)
    (pid,) = job.wait_for("the worker", job.pids)
    start = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM
    assert 4.0 < time.monotonic() - start < 10.0  # SIGTERM ignored: SIGKILL after the 5 s grace
    assert not alive(pid)


# ---- start-up failures -------------------------------------------------------------------------
def test_a_script_failing_at_import_is_not_respawned_for_ever(launcher, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import unison_no_such_module_for_the_test  # a typo\n")
    job = launcher("--no-status", "--respawn", nproc=2, script=broken)
    assert job.wait(LIMIT_S) == 1, job.tail()
    err = job.stderr
    assert err.count("respawn: ") <= 2  # workers 0 and 1 fail, their replacements 2 (and maybe 3)
    verdict = "3 worker(s) in a row exited before joining (--max-start-failures 3)"
    assert verdict in err, err[-3000:]
    shown = err[err.index(verdict) :]  # the worker's error comes after the verdict, last
    assert "No module named 'unison_no_such_module_for_the_test'" in shown


@pytest.mark.parametrize("preload", [(), ("--preload", "torch,unison")])
def test_a_worker_that_finishes_with_a_nonzero_status_fails_the_job(launcher, tmp_path, preload):
    """Its "done" message comes from the atexit handler, which runs for sys.exit(3) too: the job
    used to end with 0, as if every worker had succeeded."""
    script = tmp_path / "exit3.py"
    script.write_text(
        "import os, sys, unison\nunison.init()\n"
        "open(os.path.join(sys.argv[1], f'pid-{os.getpid()}'), 'w').close()\n"
        "sys.exit(3 if os.environ['UNISON_FT_ID'] == '1' else 0)\n"
    )
    job = launcher("--no-status", *preload, nproc=2, script=script)
    assert job.wait(LIMIT_S) == 1, job.tail()
    assert re.search(r"failure: worker 1 \(pid \d+\) finished, then exited with 3", job.stderr), job.tail()
    assert "worker 0 (pid" not in job.stderr  # it finished with 0


def test_a_worker_killed_by_a_signal_after_it_finished_fails_the_job(launcher, tmp_path):
    """Its steps are committed, but an abort at the interpreter's end is a crash the user must
    see (it was a warning, which also hid the abort of a watcher thread torn down in the store)."""
    script = tmp_path / "abort_at_exit.py"
    script.write_text(
        "import atexit, os, signal, sys\n"
        "if os.environ['UNISON_FT_ID'] == '1':  # runs after unison's own handler, which said done\n"
        "    atexit.register(os.kill, os.getpid(), signal.SIGABRT)\n"
        "import unison\nunison.init()\n"
        "open(os.path.join(sys.argv[1], f'pid-{os.getpid()}'), 'w').close()\n"
    )
    job = launcher("--no-status", nproc=2, script=script)
    assert job.wait(LIMIT_S) == 1, job.tail()
    assert re.search(r"failure: worker 1 \(pid \d+\) finished, then died by SIGABRT as it exited", job.stderr), (
        job.tail()
    )
    assert "worker 0 (pid" not in job.stderr  # it finished with 0


def test_a_worker_of_the_first_membership_failing_at_start_up_stops_the_job_at_once(launcher, tmp_path):
    """Without --respawn the first membership would wait for it (until the others give up after a
    minute): the launcher stops the healthy worker, which joined meanwhile, and shows the error."""
    picky = tmp_path / "picky.py"
    picky.write_text(
        "import glob, os, sys, time\n"
        "if os.environ['UNISON_FT_ID'] == '1':\n"
        "    while not glob.glob(os.path.join(sys.argv[1], 'pid-*')):\n"
        "        time.sleep(0.05)\n"
        "    time.sleep(3)  # worker 0 joins meanwhile, and waits for the first membership\n"
        "    raise SystemExit('worker 1: bad configuration (a test)')\n"
        "open(os.path.join(sys.argv[1], f'pid-{os.getpid()}'), 'w').close()\n"
        "import unison\n"
        "unison.init()\n"
        "while True:\n    time.sleep(0.1)\n"
    )
    job = launcher("--no-status", nproc=2, script=picky)
    assert job.wait(LIMIT_S) == 1, job.tail()
    assert time.monotonic() - job.started < 30
    assert "none replaces it; worker 1" in job.stderr
    assert job.stderr.rstrip().endswith("| worker 1: bad configuration (a test)"), job.tail()
    (healthy,) = job.pids()
    assert gone_within([healthy], 1.0) == []


# ---- the status page ---------------------------------------------------------------------------
def test_the_status_json_shows_a_kill_and_the_members_going_on(launcher):
    job = launcher(nproc=3)
    url = job.status_url()
    job.wait_for("three training workers", lambda: len(job.pids("ready")) == 3)
    # The coordinator reads the heartbeats at its own pace: a member's first one may come after its heal.
    doc = job.wait_for(
        "the first membership, every heartbeat seen",
        lambda: (
            (d := job.status())["epoch"] >= 1 and all(w["last_heartbeat_s_ago"] is not None for w in d["workers"]) and d
        ),
    )
    assert doc["job"]["state"] == "running" and doc["job"]["nproc"] == 3 and doc["members"] == [0, 1, 2]
    by_id = {w["id"]: w for w in doc["workers"]}
    assert sorted(w["pid"] for w in by_id.values()) == job.pids()
    assert [by_id[i]["rank"] for i in (0, 1, 2)] == [0, 1, 2]
    assert all(w["state"] == "member" and w["last_heartbeat_s_ago"] < 2.0 for w in by_id.values())
    assert doc["failures"] == [] and doc["respawns"] == [] and doc["joins"] == []
    assert "committed_step" in doc
    step = job.wait_for("the committed step", lambda: (s := job.status()["committed_step"]) is not None and [s])[0]
    assert isinstance(step, int) and step >= 0  # rank 0 writes ft/step at its heartbeat when it changed

    victim = by_id[1]["pid"]
    assert victim in job.pids()  # one of this test's workers
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    after = job.wait_for("the failure in the JSON", lambda: (d := job.status())["members"] == [0, 2] and d, 20)
    assert after["epoch"] > doc["epoch"]
    (failure,) = after["failures"]
    assert failure["worker"] == 1 and failure["exit_code"] == -9 and failure["time"] >= killed_at
    assert f"worker 1 (pid {victim}) exited with -9" in failure["detail"]
    workers = {w["id"]: w for w in after["workers"]}
    assert workers[1]["state"] == "dead" and workers[1]["rank"] is None and workers[1]["exit_code"] == -9
    assert [workers[0]["rank"], workers[2]["rank"]] == [0, 1]
    time.sleep(0.5)  # the members go on: their heartbeats keep coming
    later = job.status()
    assert all(w["last_heartbeat_s_ago"] < 2.0 for w in later["workers"] if w["id"] in (0, 2))
    assert {w["id"]: w["heartbeats"] for w in later["workers"]}[0] > workers[0]["heartbeats"]
    assert isinstance(later["committed_step"], int) and later["committed_step"] >= step  # still published
    kinds = [e["kind"] for e in later["events"]]
    assert kinds.count("regroup") == 2 and "failure" in kinds

    with urllib.request.urlopen(url, timeout=5) as reply:
        page = reply.read().decode()
    assert reply.headers["Content-Type"].startswith("text/html")
    assert "unison job" in page and "exited with -9" in page
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(url + "nothing", timeout=5)
    assert missing.value.code == 404

    job.proc.send_signal(signal.SIGTERM)
    assert job.wait() == 128 + signal.SIGTERM


def test_a_status_port_in_use_is_refused_with_what_to_do(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "1"]
        cmd += ["--status-port", str(port), str(SCRIPT), "--out", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=ENV)
    assert done.returncode == 2
    assert f"the status page cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "--no-status" in done.stderr
    assert list(tmp_path.glob("pid-*")) == []  # no worker was started


def test_the_coordinator_leaves_no_thread_inside_the_store_when_it_ends(tmp_path):
    """A thread blocked in the store when the interpreter ends aborts the launcher ("terminate
    called", exit -6, seen after a start-up failure): the inbox's thread is woken and joined
    before ``run`` returns, and no thread waits on ``ft/abort`` (the loop looks for it)."""
    from unison.fault.launcher import coordinator

    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit(5)  # before unison.init(): a start-up failure\n")
    settings = coordinator.Settings(nproc=1, status_port=None, max_start_failures=1)
    boss = coordinator.Coordinator(settings, [sys.executable, str(broken)], 0, host="127.0.0.1")
    assert boss.run() == 1
    left = [t.name for t in threading.enumerate() if t.name.startswith("unison-coordinator")]
    assert not left, left
