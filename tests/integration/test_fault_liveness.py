"""A slow process is not a dead one (issue 51): a worker whose heartbeat stands still past the
timeout while its process runs keeps its membership, and so does every worker when the coordinator
itself was frozen past the timeout; a dead worker is out within the heartbeat timeout, whether the
coordinator sees it die (its own child) or only hears its heartbeat stop (a worker started
elsewhere). Real processes over gloo with the exactly-once ledger of tests/scripts/ft_ledger.py;
every launcher, coordinator and worker is capped in time, and only the processes these tests
started are signalled, by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from launch import PRELOAD

from integration.test_fault_nodes import Process
from integration.test_fault_tolerance import SCRIPT, kinds, results
from integration.test_launcher import ENV, alive
from unison.fault.launcher import STALE_S

LIMIT_S = 120
#: How long the busy worker keeps its heartbeat thread from running, and the job stays frozen:
#: longer than the heartbeat timeout, which used to evict them.
BUSY_S = FROZEN_S = 2 * STALE_S


def ledger(out: Path, steps: int, *args: str) -> list[str]:
    """The ledger job's command line: slow steps until OUT/hurry exists, then as fast as they go."""
    hurry = ["--sleep", "0.05", "--hurry-file", str(out / "hurry")]
    return [str(SCRIPT), "--out", str(out), "--steps", str(steps), *hurry, *args]


def launcher(out: Path, steps: int, *args: str) -> subprocess.Popen:
    """``unison launch --fault-tolerant --nproc 3`` of the ledger job (workers forked from a template)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "3", *PRELOAD]
    return subprocess.Popen([*cmd, *ledger(out, steps, *args)], stderr=subprocess.PIPE, text=True, env=ENV)


def marks(out: Path, name: str, count: int, deadline: float) -> dict[int, str]:
    """Wait for ``count`` files OUT/<name>-<pid> (ft_ledger.py's marks); return {pid: text}."""
    while time.monotonic() < deadline:
        found = {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob(f"{name}-*")}
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} OUT/{name}-* within the time cap")


def pids(out: Path) -> dict[int, str]:
    """The workers of a launcher job, as they wrote OUT/pid-<pid>: {pid: worker id}."""
    return {int(p.name.rsplit("-", 1)[1]): p.read_text() for p in out.glob("pid-*")}


def end(job: subprocess.Popen, out: Path, deadline: float) -> str:
    """Let the job run to its end (OUT/hurry: no more sleeps), capped; return its stderr. A launcher
    still running at the cap is killed, then every worker it started (it cannot stop them now)."""
    (out / "hurry").write_text("")
    try:
        _, err = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
        for pid in pids(out):
            send(pid, signal.SIGKILL)
    return err


def send(pid: int, sig: int) -> None:
    """``sig`` to a worker of this test's job, unless it has ended."""
    if alive(pid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended meanwhile
            pass


def regroups_after(result: dict, t: float) -> list[float]:
    return [when for when, kind, _ in result["events"] if kind == "regroup" and when > t]


def test_a_busy_worker_keeps_its_membership_and_a_killed_one_is_out_within_the_timeout(tmp_path):
    """Worker 1 computes for 4 s with no turn for its heartbeat thread (as under a long call that
    holds the GIL, or starved of CPU): its heartbeat stands still twice the timeout, but its process
    runs, so it stays a member (the coordinator says it is slow). Then worker 2 is SIGKILLed: the
    coordinator sees its child die, and 0 and 1 are in the membership without it well within the
    heartbeat timeout, and train to the end, every step applied once."""
    out, steps = tmp_path / "out", 100
    deadline = time.monotonic() + LIMIT_S
    job = launcher(out, steps, "--busy", f"1@10:{BUSY_S}")
    try:
        spell = json.loads(next(iter(marks(out, "busy", 1, deadline).values())))
        os.kill(next(pid for pid, wid in pids(out).items() if wid == "2"), signal.SIGKILL)
        killed_at = time.time()
    finally:
        err = end(job, out, deadline)
    assert job.returncode == 0, err[-3000:]
    found = results(out)
    assert sorted(found) == [0, 1], err[-3000:]
    assert spell[1] - spell[0] >= BUSY_S
    for wid, result in found.items():
        assert result["w"] == [-1.0] * steps and result["members"] == [0, 1]
        assert kinds(result).count("regroup") == 1  # the kill's, none for the busy spell
        took = regroups_after(result, killed_at)[0] - killed_at
        print(f"worker {wid}: busy {spell[1] - spell[0]:.2f} s; from the kill to the new membership {took:.2f} s")
        assert took < STALE_S, err[-3000:]
    print(*[line for line in err.splitlines() if "unison.launch: slow:" in line], sep="\n")
    assert "worker 1 silent for" in err and "its process runs" in err  # seen, and kept
    assert "worker 1 (pid" not in err and "evicted" not in err
    assert "worker 2 (pid" in err and "exited with -9" in err


def test_a_coordinator_frozen_past_the_timeout_evicts_nobody_when_it_wakes(tmp_path):
    """The whole job (the launcher and its 3 workers) SIGSTOPped for 4 s, as on a machine that
    froze; the launcher resumes first and finds every heartbeat 4 s old. Its own absence is not
    the workers' silence: nobody is evicted, the first membership trains to the end."""
    out, steps = tmp_path / "out", 100
    deadline = time.monotonic() + LIMIT_S
    job = launcher(out, steps)
    workers: list[int] = []
    try:
        workers = sorted(marks(out, "ready", 3, deadline))
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        os.kill(job.pid, signal.SIGSTOP)
        time.sleep(FROZEN_S)
        os.kill(job.pid, signal.SIGCONT)
        time.sleep(0.2)  # the coordinator looks at the heartbeats before any worker runs again
    finally:
        for pid in [job.pid, *workers]:  # never left stopped, whatever failed
            send(pid, signal.SIGCONT)
        err = end(job, out, deadline)
    assert job.returncode == 0, err[-3000:]
    found = results(out)
    assert sorted(found) == [0, 1, 2], err[-3000:]
    for result in found.values():
        assert result["w"] == [-1.0] * steps and result["members"] == [0, 1, 2]
        assert "regroup" not in kinds(result) and "failure" not in kinds(result)
    assert "evicted" not in err


def test_a_killed_worker_nobody_sees_die_is_evicted_within_the_heartbeat_timeout(tmp_path):
    """Under ``unison coordinator``, 3 workers this test started, each in a session of its own (no
    agent, not the coordinator's children): nobody reports worker 1's SIGKILL, only its heartbeat
    stops. The survivors are in the membership without it within the heartbeat timeout (and a look
    at the heartbeats), and train to the end (however slow on a busy machine: their processes run)."""
    out, steps = tmp_path / "out", 100
    out.mkdir()
    deadline = time.monotonic() + LIMIT_S
    boss = Process("coordinator", "--nproc", "3", "--no-status")
    workers: list[subprocess.Popen] = []
    killed_at: Optional[float] = None
    try:
        port = boss.find(r"the job's store listens on .*:(\d+)").group(1)
        env = {**ENV, "UNISON_FT_ADDR": "127.0.0.1", "UNISON_FT_PORT": port}
        for i in range(3):
            with open(tmp_path / f"worker{i}.err", "w") as err:
                cmd = [sys.executable, *ledger(out, steps)]
                workers.append(subprocess.Popen(cmd, env=env, stderr=err, start_new_session=True))
        marks(out, "ready", 3, deadline)
        ids = {pid: json.loads(text)["id"] for pid, text in marks(out, "joined", 3, deadline).items()}
        victim = next(pid for pid, wid in ids.items() if wid == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        (out / "hurry").write_text("")
        codes = [w.wait(max(1.0, deadline - time.monotonic())) for w in workers]
        assert boss.proc.wait(max(1.0, deadline - time.monotonic())) == 0, "\n".join(boss.lines[-30:])
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        boss.close()
    assert sorted(codes) == [-signal.SIGKILL, 0, 0]
    found = results(out)
    assert sorted(found) == [0, 2]
    log = "\n".join(boss.lines)
    for wid, result in found.items():
        assert result["w"] == [-1.0] * steps and result["members"] == [0, 2]
        took = regroups_after(result, killed_at)[0] - killed_at
        print(f"worker {wid}: from the kill to the new membership {took:.2f} s")
        assert took < STALE_S + 0.5, log[-3000:]
    print(*[line for line in boss.lines if "worker 1" in line], sep="\n")
    assert "worker 1 silent for" in log and "evicted" in log
