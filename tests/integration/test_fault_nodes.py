"""The node as the unit of failure (issue 29): `unison launch --fault-tolerant --nodes N
--procs-per-node P` and node agents under `unison coordinator`. Real processes over gloo, the
exactly-once ledger of tests/scripts/ft_ledger.py; every launcher, coordinator and agent is
capped in time, and only processes these tests started are signalled (by pid)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch import PRELOAD

from integration.test_launcher import ENV, SCRIPT, Launcher, alive, gone_within
from unison.apps import cli

LIMIT_S = 90


def launch(out: Path, launcher: tuple, *args: str, steps: int = 40, sleep: float = 0.02, timeout: float = LIMIT_S):
    """Run the ledger job (``args``: its own) under a launcher of nodes (``launcher``: its options);
    return (exit code, stderr, {worker id: result})."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--no-status", *PRELOAD, *launcher]
    cmd += [str(SCRIPT), "--out", str(out), "--steps", str(steps), "--sleep", str(sleep), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    found = {}
    for path in out.glob("[0-9]*.json"):
        data = json.loads(path.read_text())
        found[data["id"]] = data
    return done.returncode, done.stderr, found


def test_a_killed_process_takes_its_node_out_and_the_node_comes_back_whole(tmp_path):
    """3 nodes x 2 processes (workers 0-1, 2-3, 4-5): worker 1 is SIGKILLed before its reduction at
    step 10. Its sibling 0 is stopped with it, nodes 1 and 2 go on, and a new node (workers 6 and 7)
    joins and heals: every step applied exactly once on every member, the newcomers included."""
    steps = 200
    nodes = ("--nodes", "3", "--procs-per-node", "2", "--respawn")
    code, err, found = launch(tmp_path / "out", nodes, "--kill", "1@10", steps=steps, sleep=0.05)
    assert code == 0, err[-3000:]
    assert sorted(found) == [2, 3, 4, 5, 6, 7], err[-3000:]
    for wid, result in found.items():
        assert result["step"] == steps and result["world"] == 6
        assert result["w"] == [-1.0] * steps, (wid, result["w"])  # a doubled step shows -2, a lost one 0
        assert result["members"] == [2, 3, 4, 5, 6, 7]  # whole nodes in consecutive ranks
        rank = result["members"].index(wid)
        assert result["topology"] == [rank % 2, 2, rank // 2]  # local rank, local world size, node
    assert found[6]["node"] == found[7]["node"] == 3 and found[6]["first_step"] > 10  # healed into the job
    assert "worker 1 (pid" in err and "exited with -9" in err
    assert "node 0 taken out (worker 1 exited with -9): its worker(s) [0] stopped" in err
    assert "respawn: node 3: workers [6, 7] started (replacement 1)" in err


def test_a_process_killed_while_the_nodes_build_their_groups_is_a_failure_not_a_hang(tmp_path):
    """2 nodes x 2: worker 2 dies inside unison.init() as the node groups are built (the others wait
    in those groups' rendezvous for it). They used to wait out torch's default timeout (30 minutes:
    a CI failure); now the build fails in seconds, node 1 is taken out and node 0 trains on."""
    code, err, found = launch(tmp_path / "out", ("--nodes", "2", "--procs-per-node", "2"), "--kill-node-groups", "2")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 1], err[-3000:]
    for result in found.values():
        assert result["step"] == 40 and result["world"] == 2 and result["w"] == [-1.0] * 40
    assert "node 1 taken out (worker 2 exited with -9)" in err


def test_a_stopped_process_gets_its_node_evicted_within_2_5_s(tmp_path):
    """SIGSTOP worker 3 (node 1 of 2 nodes x 2): its heartbeat stands still, the coordinator evicts
    node 1 and stops worker 2 with it; node 0 regroups alone within 2.5 s of the stop."""
    out = tmp_path / "out"
    steps = 120
    code, err, found = launch(out, ("--nodes", "2", "--procs-per-node", "2"), "--stop", "3@10", steps=steps, sleep=0.03)
    stopped = [int(p.name.split("-")[1]) for p in out.glob("pid-*") if p.read_text() == "3"]
    for pid in stopped:  # the stopped one is no member: the launcher left it to end when it resumes
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert sorted(found) == [0, 1], err[-3000:]
    stopped_at = float((out / "stopped").read_text())
    for result in found.values():
        assert result["w"] == [-1.0] * steps and result["world"] == 2
        regroup = min(t for t, kind, _ in result["events"] if kind == "regroup" and t > stopped_at)
        assert regroup - stopped_at < 2.5, regroup - stopped_at
    assert "worker 3 silent for" in err and "node 1 taken out (worker 3 stopped answering): its worker(s) [2]" in err


def test_two_nodes_killed_at_once_with_min_replicas_met_and_not_met(tmp_path):
    """3 nodes x 2: workers 0 (node 0) and 2 (node 1) die at the same step. With --min-replicas 2
    the last node trains on, the ledger exact; with --min-replicas 3 it stops (RankFailure) after
    --join-timeout, and the launcher exits 1."""
    nodes = ("--nodes", "3", "--procs-per-node", "2")
    kills = ("--kill", "0@10", "--kill", "2@10")
    code, err, found = launch(tmp_path / "met", (*nodes, "--min-replicas", "2"), *kills)
    assert code == 0, err[-3000:]
    assert sorted(found) == [4, 5], err[-3000:]
    assert all(r["w"] == [-1.0] * 40 and r["members"] == [4, 5] for r in found.values())

    out = tmp_path / "unmet"
    args = ("--min-replicas", "3", "--join-timeout", "2")
    code, err, found = launch(out, (*nodes, *args), *kills, steps=100000, sleep=0.05)
    assert code == 1, err[-3000:]
    assert "fewer than --min-replicas 3" in err
    assert found == {}
    ids = {int(p.name[4:]): int(p.read_text()) for p in out.glob("pid-*")}
    failed = {ids[int(p.stem.split("-")[1])] for p in out.glob("failed-*.json")}
    assert {4, 5} <= failed <= {1, 3, 4, 5}  # the last node raised RankFailure (and maybe a killed one's sibling)


def test_the_status_json_shows_the_nodes_during_a_node_kill(tmp_path):
    job = Launcher(tmp_path / "job", "--nodes", "2", "--procs-per-node", "2", nproc=None)
    try:
        job.wait_for("four training workers", lambda: len(job.pids("ready")) == 4)
        doc = job.wait_for("the first membership", lambda: (d := job.status())["epoch"] >= 1 and d)
        assert doc["job"]["procs_per_node"] == 2 and doc["job"]["nodes"] == 2 and doc["members"] == [0, 1, 2, 3]
        nodes = {n["id"]: n for n in doc["nodes"]}
        assert nodes[0]["workers"] == [0, 1] and nodes[0]["ranks"] == [0, 1] and nodes[0]["state"] == "member"
        assert nodes[1]["workers"] == [2, 3] and nodes[1]["ranks"] == [2, 3] and nodes[1]["size"] == 2
        by_id = {w["id"]: w for w in doc["workers"]}
        assert [(by_id[i]["node"], by_id[i]["local_rank"]) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        victim, sibling = by_id[0]["pid"], by_id[1]["pid"]
        assert {victim, sibling} <= set(job.pids())  # this test's workers
        os.kill(victim, signal.SIGKILL)
        after = job.wait_for("node 0 out in the JSON", lambda: (d := job.status())["members"] == [2, 3] and d, 20)
        nodes = {n["id"]: n for n in after["nodes"]}
        assert nodes[0]["state"] == "failed" and nodes[0]["ranks"] == [None, None]
        assert nodes[0]["failure"] == "worker 0 exited with -9" and nodes[1]["ranks"] == [0, 1]
        workers = {w["id"]: w for w in after["workers"]}
        assert workers[0]["state"] == "dead" and workers[1]["state"] == "evicted"
        assert any(f.get("node") == 0 and f.get("workers") == [1] for f in after["failures"])
        assert gone_within([sibling], 2.0) == []  # stopped with its node
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait() == 128 + signal.SIGTERM
        assert gone_within(job.pids(), 3.0) == []
    finally:
        job.close()


# ---- agents under `unison coordinator` --------------------------------------------------------
class Process:
    """A `unison` command this test started, its stderr read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "unison", *args], stderr=subprocess.PIPE, text=True, env=ENV
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def find(self, pattern: str, timeout: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout:.0f} s:\n" + "\n".join(self.lines[-30:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_agents_restart_their_node_and_leave_no_orphans(tmp_path):
    """`unison coordinator --nodes 2` and two agents of 2 processes. A worker of agent A's node is
    SIGKILLed: A stops its sibling and, under --respawn, starts the node again, which joins. Then
    agent A is SIGKILLed: its workers end themselves (no orphan), and B's node goes on. SIGTERM to
    agent B stops its workers and exits 143."""
    out = tmp_path / "out"
    out.mkdir()
    boss = Process("coordinator", "--nodes", "2", "--no-status")
    agents: list[Process] = []
    try:
        port = boss.find(r"the job's store listens on .*:(\d+)").group(1)
        ledger = [str(SCRIPT), "--out", str(out), "--steps", "100000", "--sleep", "0.05"]
        for name in ("A", "B"):
            extra = ["--respawn"] if name == "A" else []
            agent = [
                "launch",
                "--fault-tolerant",
                "--procs-per-node",
                "2",
                *extra,
                "--coordinator",
                f"127.0.0.1:{port}",
            ]
            agents.append(Process(*agent, *ledger))
        a, b = agents
        boss.find(r"regroup: epoch 1: members \[\d+, \d+, \d+, \d+\]", 60)
        # Kill once the four have built their models: a death inside DataParallel(...) is
        # test_fault_tolerance.py's test_a_member_killed_while_the_others_build_their_groups_...
        deadline = time.monotonic() + 60
        while len(list(out.glob("ready-*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        node_of = {}
        for p in out.glob("pid-*"):
            node_of[int(p.name.split("-")[1])] = int(p.read_text())
        children = {pid for pid in node_of if _parent(pid) == a.proc.pid}
        assert len(children) == 2
        victim = min(children)
        os.kill(victim, signal.SIGKILL)
        a.find(r"respawn: node \d+ failed; starting it again")
        assert gone_within(sorted(children), 2.0) == []  # the sibling was stopped with its node

        def healed() -> list[int]:  # the new node's processes, once they joined and healed
            ready = [int(p.name.split("-")[1]) for p in out.glob("ready-*")]
            return [pid for pid in ready if pid not in node_of and _parent(pid) == a.proc.pid]

        deadline = time.monotonic() + 60
        while len(healed()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        a_workers = healed()
        b_workers = [pid for pid in node_of if _parent(pid) == b.proc.pid]
        logs = "\n".join(["coordinator:", *boss.lines[-20:], "agent A:", *a.lines[-10:], "agent B:", *b.lines[-10:]])
        assert len(a_workers) == 2 and len(b_workers) == 2, logs

        a.proc.kill()  # SIGKILL: the agent cannot stop its workers
        a.proc.wait()
        assert gone_within(a_workers, 3.0) == []  # they ended themselves: no orphan
        boss.find(r"node \d+ taken out \(worker \d+ stopped answering\)", 15)
        boss.find(r"regroup: epoch \d+: members \[\d+, \d+\]", 15)
        assert all(alive(pid) for pid in b_workers)  # B's node trains on

        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(20) == 128 + signal.SIGTERM
        assert gone_within(b_workers, 1.0) == []
        assert boss.proc.wait(30) == 1  # nobody finished
    finally:
        for p in [*agents, boss]:
            p.close()
        for pid in (int(p.name.split("-")[1]) for p in out.glob("pid-*")):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ValueError):
        return -1


def test_bad_launch_options_are_refused_with_what_to_do(capsys):
    """Each refused before anything starts: the first as a user runs it (a fresh interpreter, its
    exit status), the others through the same ``unison.apps.cli.main`` in this process."""
    cases = [
        ((), "give --nproc N (processes, nodes of one) or --nodes N [--procs-per-node P]"),
        (("--nproc", "2", "--procs-per-node", "2"), "use --nodes N --procs-per-node P"),
        (("--nodes", "1", "--procs-per-node", "2", "--min-replicas", "3"), "--min-replicas 3 is more than the 2"),
        (("--procs-per-node", "2", "--coordinator", "h:1", "--min-replicas", "2"), "belong to `unison coordinator`"),
        (("--procs-per-node", "2", "--coordinator", "nohost"), "is not HOST:PORT"),
    ]
    for i, (args, words) in enumerate(cases):
        argv = ["launch", "--fault-tolerant", *args, str(SCRIPT), "--out", "unused"]
        if i == 0:
            done = subprocess.run(
                [sys.executable, "-m", "unison", *argv], capture_output=True, text=True, timeout=60, env=ENV
            )
            code, err = done.returncode, done.stderr
        else:
            code, err = cli_main(capsys, argv)
        assert code == 2 and words in err, (args, err)


def cli_main(capsys, argv: list[str]) -> tuple[object, str]:
    """``unison ARGV`` in this process: its exit status (returned, or raised by argparse) and stderr."""
    capsys.readouterr()
    try:
        code: object = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err
