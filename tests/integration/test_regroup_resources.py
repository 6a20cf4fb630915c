"""What regroups leave behind, and which errors regroup at all (issue 29).

- An abandoned group is aborted, unregistered and let go by the reaper thread, off the training
  thread: its gloo destructor, which waits for its pending collective, holds up neither the
  training thread nor the process's exit.
- 50 regroups in a row leave the process's threads, file descriptors and memory flat.
- A user's exception whose message says "gloo" and "timed out" is raised at once, never regrouped.

Real processes, each run capped in time; only the processes a test started are ever signalled.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from launch import run

from unison.fault import member

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_tasks(target: int, within: float) -> int:
    deadline = time.monotonic() + within
    while _tasks() > target and time.monotonic() < deadline:
        time.sleep(0.05)
    return _tasks()


def _abandon(group, reaper, *held) -> float:
    """What Member._abandon does to a group; returns how long the training thread spent in it."""
    started = time.monotonic()
    member._abort(group)
    dist.destroy_process_group(group)
    reaper.take(group)
    for obj in held:
        reaper.take(obj)
    return time.monotonic() - started


def _abandoned_with_work_pending(peer_moves_on: bool):
    rank = dist.get_rank()
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    reaper = member._Reaper()
    reaper.take(object())  # its thread starts now, before the baseline
    time.sleep(0.1)
    baseline = _tasks()
    group = dist.new_group(timeout=datetime.timedelta(seconds=40))
    dist.all_reduce(torch.ones(4), group=group)  # connected: the group's threads run
    with_group = _tasks()
    dist.barrier()
    if rank == 0:  # rank 1 never posts its part: this allreduce waits for it
        spent = _abandon(group, reaper, dist.all_reduce(torch.ones(4), group=group, async_op=True))
        del group
        # The training thread goes on at once, the GIL free (the destructor waits without it).
        ticks, until = 0, time.monotonic() + 0.3
        while time.monotonic() < until:
            ticks += 1
        if not peer_moves_on:
            return {"spent": spent, "ticks": ticks, "exit_from": time.time()}
        # Rank 1 let its group go: its connections closed, the pending allreduce failed, and
        # the reaper let the work and the group go.
        left = _settled_tasks(baseline, 15)
        dist.barrier()
        return {"spent": spent, "ticks": ticks, "baseline": baseline, "with_group": with_group, "left": left}
    if peer_moves_on:
        spent = _abandon(group, reaper)
        del group
        left = _settled_tasks(baseline, 15)
        dist.barrier()
        return {"spent": spent, "baseline": baseline, "with_group": with_group, "left": left}
    # Rank 1 keeps its group (a peer stopped, or one that moved on and holds it): rank 0's reaper
    # waits in the destructor until the allreduce's timeout. Rank 0's process must end anyway.
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() < deadline:
        with open(f"/proc/{pids[0]}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.02)
    return {"gone_at": time.time(), "group_alive": group is not None}


def test_an_abandoned_group_with_work_pending_is_destroyed_off_the_training_thread():
    """Both members let the group go (as both move to the next membership): the one whose
    collective was pending spends no time in it, its threads go once the peer's connections close
    (the pending allreduce fails at once), long before the group's 40 s timeout."""
    started = time.monotonic()
    results = run(_abandoned_with_work_pending, 2, True, timeout=60)
    assert time.monotonic() - started < 30
    for r in results:
        assert r["spent"] < 0.5, r
        assert r["with_group"] > r["baseline"], r  # the group had threads of its own
        assert r["left"] <= r["baseline"], r  # ... and they are gone
    assert results[0]["ticks"] > 1000, results[0]


def test_a_group_whose_destructor_waits_holds_up_neither_training_nor_exit():
    """The peer keeps its side open: the destructor waits out the allreduce's 40 s timeout on
    the reaper, while the training thread goes on and the process ends within seconds (exit 0)."""
    started = time.monotonic()
    first, second = run(_abandoned_with_work_pending, 2, False, timeout=60)
    assert first["spent"] < 0.5 and first["ticks"] > 1000, first
    assert second["gone_at"] - first["exit_from"] < 10, (first, second)
    assert time.monotonic() - started < 35


def _launch(script: str, out: Path, *args: str, nproc: int = 2, timeout: float = 60) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", str(nproc)]
    cmd += [str(SCRIPTS / script), "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_fifty_regroups_leave_threads_fds_and_memory_flat(tmp_path):
    """The cheapest regroup: the oldest member asks for the same members again (ft/rebuild), every
    member builds the default group and the algorithm's groups again and settles. Before the
    reaper, each regroup kept its 2 groups' 6 threads and 10 file descriptors for good."""
    started = time.monotonic()
    done = _launch("ft_regroups.py", tmp_path, "--regroups", "50", timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("[0-9]*.json"))]
    assert len(results) == 2, done.stderr[-3000:]
    for r in results:
        before, after = r["before"], r["after"]
        assert r["regroups"] >= 50, r
        assert r["held"] <= 1, r  # the first membership's group, which init()'s Topology holds
        assert after["tasks"] <= before["tasks"] + 2, r
        assert after["threads"] <= before["threads"] + 1, r
        assert after["fds"] <= before["fds"] + 4, r
        assert after["rss_mb"] <= before["rss_mb"] + 10, r
        print(f"worker {r['id']}: {r['regroups']} regroups in {r['elapsed_s']:.2f} s: {before} -> {after}")
    assert time.monotonic() - started < 60


def test_a_user_error_that_mentions_gloo_and_timed_out_is_raised_at_once(tmp_path):
    """Told apart by type, membership and the coordinator's record, not by message: the job ends
    with the user's error at its first occurrence, with no regroup after the first membership."""
    started = time.monotonic()
    done = _launch("ft_user_error.py", tmp_path, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert "ValueError: gloo: the operation timed out (a user's own error)" in done.stderr, done.stderr[-3000:]
    assert "RuntimeError: gloo: Connection closed, timed out (a user's own error)" in done.stderr, done.stderr[-3000:]
    # The workers' own records (unison.ft's warnings, on stderr): no failure, no regroup. (The
    # coordinator may publish a membership without the first worker to exit: not a regroup.)
    assert not [x for x in done.stderr.splitlines() if x.startswith(("failure:", "regroup:"))], done.stderr[-3000:]
    assert elapsed < 30, elapsed
