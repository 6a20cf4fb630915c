"""Fault tolerance inside the job: real workers under `unison launch --fault-tolerant`, killed
(SIGKILL), stopped (SIGSTOP), leaving and replaced, with the exactly-once ledger of
tests/scripts/ft_ledger.py: after T steps every weight must be exactly -1 (x (i+1)^2 with --square)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from launch import PRELOAD

import unison
from unison.fault import supported

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_ledger.py"
LIMIT_S = 60


def launch(
    tmp_path: Path, *args: str, nproc: int = 3, launcher: tuple = (), steps: int = 40, timeout=LIMIT_S, preload=PRELOAD
):
    """Run the ledger job (its workers forked from a template: ``PRELOAD``); return (launcher's
    exit code, its stderr, {worker id: result})."""
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", str(nproc), *preload, *launcher]
    cmd += [str(SCRIPT), "--out", str(out), "--steps", str(steps), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stderr, results(out)


def results(out: Path) -> dict[int, dict]:
    found = {}
    for path in out.glob("[0-9]*.json"):
        data = json.loads(path.read_text())
        found[data["id"]] = data
    return found


def ledger(steps: int, contributions: list[float]) -> list[float]:
    return [-c for c in contributions] if contributions else [-1.0] * steps


def kinds(result: dict) -> list[str]:
    return [kind for _, kind, _ in result["events"]]


# Killed before its backward (its round never started) for each gradient path: plain, a 16-bit cast
# (fp16 shares bf16's code), 8-bit codes, a node-level round on one-process nodes, completed at the next
# forward; killed after it (the others' round cut mid-way) for the plain and the coded paths.
@pytest.mark.parametrize(
    "when, algorithm",
    [("before", a) for a in ["allreduce", "bf16", "bytegrad", "bf16:hierarchical=True", "nonblocking"]]
    + [("after", "allreduce"), ("after", "bytegrad")],
)
def test_a_killed_rank_leaves_every_step_applied_exactly_once(tmp_path, algorithm, when):
    code, err, found = launch(tmp_path, "--algorithm", algorithm, "--kill", f"1@10:{when}")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2], err[-3000:]
    for result in found.values():
        assert result["step"] == 40 and result["world"] == 2
        assert result["w"] == [-1.0] * 40, result["w"]  # a doubled step shows -2, a lost one 0
        assert {"failure", "regroup", "redo"} <= set(kinds(result))
    assert "worker 1" in err and "exited with -9" in err


def test_rank_0_may_die(tmp_path):
    code, err, found = launch(tmp_path, "--kill", "0@7")
    assert code == 0, err[-3000:]
    assert sorted(found) == [1, 2]
    assert all(r["w"] == [-1.0] * 40 for r in found.values())
    assert all(r["members"] == [1, 2] for r in found.values())  # the oldest survivor is rank 0 now


def test_a_member_killed_while_the_others_build_their_groups_is_recovered_from(tmp_path):
    """Worker 2 dies inside DataParallel(...) as its gradient engine starts building its groups; the
    others, waiting in that group's rendezvous, regroup and train on (they used to raise the
    rendezvous' DistStoreError out of DataParallel(...) and end the job)."""
    code, err, found = launch(tmp_path, "--kill-building", "2", steps=10)
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 1], err[-3000:]
    for result in found.values():
        assert result["w"] == [-1.0] * 10 and result["world"] == 2
        assert {"failure", "regroup"} <= set(kinds(result))


def test_a_kill_equals_a_graceful_leave_bitwise(tmp_path):
    """Each worker's gradient differs ((id+1)^2 e_s), so who took part in each round shows."""
    killed = launch(tmp_path / "kill", "--square", "--kill", "1@10")
    left = launch(tmp_path / "leave", "--square", "--leave", "1@9")
    for code, err, found in (killed, left):
        assert code == 0, err[-3000:]
        assert {0, 2} <= set(found)
    expected = [-(1 + 4 + 9) / 3] * 10 + [-(1 + 9) / 2] * 30
    for wid in (0, 2):
        assert killed[2][wid]["w"] == left[2][wid]["w"]
        assert killed[2][wid]["w"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "algorithm",
    [
        "powersgd",
        "qadam",
        "local_sgd",
        "decentralized",
        "low_precision_decentralized",
        "async",
        "diloco",
        "daso",
        "sparseloco",
    ],
)
def test_every_supported_algorithm_goes_on_with_equal_replicas(tmp_path, algorithm):
    code, err, found = launch(tmp_path, "--algorithm", algorithm, "--kill", "1@10", "--average-at-end")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2]
    first, second = found[0], found[2]
    assert first["step"] == second["step"] == 40
    assert first["w"] == pytest.approx(second["w"], abs=1e-6)


def test_powersgd_redoes_a_round_cut_between_buckets_from_the_residuals_before_it(tmp_path):
    """Two matrices, a bucket each, full-rank gradients (powersgd keeps a residual). Worker 1 dies in
    step 5's round once its first matrix's bucket is reduced: the survivors finished that bucket (its
    residual and Q moved on) and broke the next. The round done again on the two of them starts from
    the residuals and Q's as they were before it, so the run equals one where worker 1 left after
    step 4; from the moved-on residual the finished bucket's gradient would count twice."""
    common = ("--algorithm", "powersgd:rank=1,start_iter=2", "--square", "--matrices", "8", "--sleep", "0")
    killed = launch(tmp_path / "kill", *common, "--kill", "1@5:mid", steps=8)
    left = launch(tmp_path / "leave", *common, "--leave", "1@4", steps=8)
    for code, err, found in (killed, left):
        assert code == 0, err[-3000:]
        assert {0, 2} <= set(found), err[-3000:]
    assert "redo" in kinds(killed[2][0])
    for wid in (0, 2):
        assert killed[2][wid]["mats"] == pytest.approx(left[2][wid]["mats"], rel=1e-5, abs=1e-5)
    assert killed[2][0]["mats"] == killed[2][2]["mats"]  # equal replicas


def test_diloco_redoes_the_interrupted_outer_step_on_the_survivors(tmp_path):
    """Classic DiLoCo, outer SGD with lr 1: an outer step moves the snapshot by the members' mean
    progress. Worker 1 dies in the third period: its steps 8 and 9 go with it, the outer sync it
    broke is redone by the survivors one step later, and no other step is lost or doubled."""
    algorithm = "diloco:period=4,fragments=1,delay=0,outer_lr=1.0,outer_momentum=0,nesterov=False"
    code, err, found = launch(tmp_path, "--algorithm", algorithm, "--square", "--kill", "1@10")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2]
    expected = [-(1 + 4 + 9) / 3] * 8 + [-(1 + 9) / 2] * 32
    for result in found.values():
        assert result["w"] == pytest.approx(expected, rel=1e-6)
        assert "redo" in kinds(result)
    assert found[0]["w"] == found[2]["w"]  # equal replicas: the outer steps are shared


def sparseloco_ledger(steps: int, period: int, beta: float, killed: int, kill_step: int, interrupted: int) -> list:
    """SparseLoCo on the ramped, squared ledger, written by hand (top-1 of one chunk, sent exactly,
    outer_lr 1): worker ``killed`` dies before step ``kill_step``, the sync after local step
    ``interrupted`` breaks and is launched again one step later on the survivors, from the error
    feedback as it was before its first launch. Returns a survivor's weights."""
    glob = [0.0] * steps
    params = {i: [0.0] * steps for i in range(3)}
    error = {i: [0.0] * steps for i in range(3)}
    alive = [0, 1, 2]

    def sync() -> None:
        sent = []
        for i in alive:
            e = error[i]
            for j in range(steps):
                e[j] = beta * e[j] + glob[j] - params[i][j]
            first, second = sorted(range(steps), key=lambda j: -abs(e[j]))[:2]
            assert abs(e[first]) - abs(e[second]) >= 0.5  # no tie: the codec's choice is this one
            sent.append((first, e[first]))
            e[first] = 0.0
        for j, value in sent:
            glob[j] -= value / len(alive)
        for i in alive:
            params[i] = list(glob)

    redo = False
    for s in range(steps):
        if s == kill_step:
            alive.remove(killed)
        for i in alive:
            params[i][s] -= (i + 1) ** 2 * (steps - s)
        if redo:
            sync()
            redo = False
        if (s + 1) % period == 0:
            if s + 1 == interrupted:
                redo = True
            else:
                sync()
    return params[alive[0]]


def test_sparseloco_launches_the_interrupted_sync_again_from_the_error_feedback_before_it(tmp_path):
    """SparseLoCo's launch folds the pseudo-gradient into the error feedback (``e = beta e + delta``)
    and subtracts what it sends. Worker 1 dies in the third period: the survivors' sync after step 11
    breaks and is launched again after step 12 from the error feedback as it was before the broken
    launch; folded twice (the pseudo-gradient counted twice, beta applied twice, what the broken
    launch sent subtracted though never applied) the weights differ by hundreds."""
    algorithm = "sparseloco:period=4,fragments=1,delay=0,layout=flat,chunk=40,topk=1,beta=0.5,outer_lr=1.0,quantizer=max,mean=world"
    code, err, found = launch(tmp_path, "--algorithm", algorithm, "--square", "--ramp", "--kill", "1@10")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2]
    expected = sparseloco_ledger(40, 4, 0.5, killed=1, kill_step=10, interrupted=12)
    for result in found.values():
        assert result["w"] == pytest.approx(expected, rel=1e-5, abs=1e-4)
        assert "redo" in kinds(result)
    assert found[0]["w"] == found[2]["w"]  # equal replicas: the outer steps are shared


def dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (row k: frequency k), written from its definition."""
    return torch.tensor(
        [
            [math.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n) for j in range(n)]
            for k in range(n)
        ],
        dtype=torch.float64,
    )


def demo_ledger(steps: int, rounds: list, chunk: int, topk: int, beta: float) -> list:
    """DeMo with SGD at lr 1 on the ramped ledger, written by hand. ``rounds[s]`` is ``(kind, parts)``:
    ``parts`` maps each participant of step s's round (a worker; a node when hierarchical) to its
    gradient's factor (the gradient is factor (steps - s) e_s; 0: it takes part with no gradient);
    kind ``"allreduce"``: that step averaged the gradients. In ``"demo"`` steps each participant
    folds its gradient into its own momentum once (m = beta m + g), sends each chunk's top-k DCT
    coefficients and keeps the rest; the weights step by the inverse DCT of the mean of what was sent."""
    d, w, momenta = dct(chunk), torch.zeros(steps, dtype=torch.float64), {}
    for s, (kind, parts) in enumerate(rounds):
        if kind == "allreduce":
            w[s] -= sum(parts.values()) / len(parts) * (steps - s)
            continue
        sent_sum = torch.zeros(steps // chunk, chunk, dtype=torch.float64)
        for who, factor in parts.items():
            m = momenta.setdefault(who, torch.zeros(steps, dtype=torch.float64))
            m.mul_(beta)[s] += factor * (steps - s)
            coeffs = m.view(-1, chunk) @ d.T
            top = coeffs.abs().topk(topk + 1, dim=1)
            kth, next_ = top.values[:, topk - 1], top.values[:, topk]
            assert ((kth - next_ > 1e-3) | (kth < 1e-2)).all()  # no near tie where it matters: the codec's choice
            sent = torch.zeros_like(coeffs).scatter_(1, top.indices[:, :topk], coeffs.gather(1, top.indices[:, :topk]))
            m.copy_(((coeffs - sent) @ d).reshape(-1))
            sent_sum += sent
        w -= ((sent_sum / len(parts)) @ d).reshape(-1)
    return w.tolist()


def redone(result: dict) -> tuple:
    """From a survivor's events: the (0-based) step whose gradient round was redone (None if none
    was) and the worker ids that were between steps then (they take part with no gradient)."""
    step, idle = None, []
    for _, kind, detail in result["events"]:
        found = re.search(r"gradient round of step (\d+) on", detail)
        if kind == "redo" and found:
            step = int(found.group(1)) - 1
        found = re.search(r"of rank\(s\) (\[[0-9, ]*\]), which were between steps", detail)
        if kind == "lost" and found:
            idle = [result["members"][r] for r in json.loads(found.group(1))]
    return step, idle


DEMO = "demo:chunk=4,topk=1,beta=0.5,mean=world,sign=false,bits=32"


@pytest.mark.parametrize(
    "kill, switch, demo_steps",
    [
        ("1@10", "allreduce@30", range(0, 30)),  # demo from the start, killed before a reduction, then allreduce
        ("1@10:after", f"{DEMO}@4", range(4, 40)),  # allreduce, then demo, killed after a step
    ],
)
def test_demo_redoes_an_interrupted_round_from_the_momentum_before_it(tmp_path, kill, switch, demo_steps):
    """DeMo folds each gradient into its rank's momentum as its round starts (m = beta m + g). Worker 1
    dies (before its reduction, or after its step): the survivors' round breaks and is done again
    from their saved gradients and the momentum as it was before the broken round, so every
    gradient is folded once; switched into and out of under fault tolerance. Folded twice (beta
    applied twice, the gradient counted twice, the coefficients sent by the broken round removed
    though never applied) the weights differ by tens."""
    first = "allreduce" if switch.startswith(DEMO) else DEMO
    code, err, found = launch(
        tmp_path, "--algorithm", first, "--switch-to", switch, "--square", "--ramp", "--kill", kill
    )
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2], err[-3000:]
    assert found[0]["w"] == found[2]["w"]  # equal replicas: every rank decodes the same messages
    step, idle = redone(found[0])
    assert step is not None and redone(found[2]) == (step, idle)
    rounds = []
    for s in range(40):
        alive = [0, 2] if s >= step else [0, 1, 2]
        parts = {i: 0.0 if s == step and i in idle else float((i + 1) ** 2) for i in alive}
        rounds.append(("demo" if s in demo_steps else "allreduce", parts))
    expected = demo_ledger(40, rounds, chunk=4, topk=1, beta=0.5)
    assert found[0]["w"] == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_a_failure_during_average_is_recovered_and_the_average_done_again(tmp_path):
    """Worker 1 dies after its last step, as the others call model.average(): they regroup and
    average over the two of them (local SGD replicas differ until then)."""
    code, err, found = launch(tmp_path, "--algorithm", "local_sgd:period=8", "--kill", "1@39:after", "--average-at-end")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2]
    assert found[0]["w"] == found[2]["w"] == [-1.0] * 40
    assert "regroup" in kinds(found[0])


def test_no_replacement_is_started_once_the_job_is_ending(tmp_path):
    """Worker 1 dies two steps before the end: its replacement, forked at once, heals in or finds
    the job over; no replacement of the replacement is started, and the job ends well. Admitted
    just as a member finishes, the membership with it can never be built: the member's "done"
    ends it and the others regroup without it (benchmarks/stress_fault_end.py repeats this)."""
    started = time.time()
    code, err, found = launch(tmp_path, "--kill", "1@38", launcher=("--respawn",))
    assert code == 0, err[-3000:]
    assert {0, 2} <= set(found) <= {0, 2, 3}, err[-3000:]  # the replacement (3) finishes if it healed in
    assert all(r["w"] == [-1.0] * 40 for r in found.values()), err[-3000:]
    assert err.count("respawn: worker") <= 1, err[-3000:]
    assert "terminate called" not in err
    assert time.time() - started < 30


@pytest.mark.parametrize("algorithm", ["local_sgd:period=4,warmup_steps=20", "async:warmup_steps=20"])
def test_a_warm_up_step_interrupted_is_redone_exactly_once(tmp_path, algorithm):
    """The warm-ups run on the gradient engine: a kill at step 10 of 20 leaves the ledger of the
    warm-up exact (later steps are local, and averaging equal values keeps them)."""
    code, err, found = launch(tmp_path, "--algorithm", algorithm, "--kill", "1@10", "--average-at-end")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2]
    for result in found.values():
        assert result["w"][:20] == [-1.0] * 20
        assert "redo" in kinds(result)


def test_two_ranks_killed_at_once_with_min_replicas_met(tmp_path):
    code, err, found = launch(tmp_path, "--kill", "1@10", "--kill", "2@10", nproc=4, launcher=("--min-replicas", "2"))
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 3]
    assert all(r["w"] == [-1.0] * 40 and r["world"] == 2 for r in found.values())


def test_when_every_holder_of_the_state_is_gone_fresh_joiners_raise_instead_of_starting_over(tmp_path):
    """Both workers die at step 10 and are replaced: the replacements have nobody to heal from.
    Training on from their initial weights would be silently wrong: they raise RankFailure."""
    code, err, found = launch(
        tmp_path,
        "--kill",
        "0@10",
        "--kill",
        "1@10",
        "--sleep",
        "0.02",
        nproc=2,
        launcher=("--respawn", "--min-replicas", "1", "--join-timeout", "5"),
        steps=200,
        timeout=LIMIT_S,
    )
    assert code != 0
    assert found == {}, err[-3000:]
    failures = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("failed-*.json")]
    assert failures and all("held the job's state is gone" in f["message"] for f in failures), err[-3000:]


def test_too_few_members_ends_the_job_with_rank_failure(tmp_path):
    started = time.time()
    code, err, found = launch(
        tmp_path, "--kill", "1@10", "--kill", "2@10", launcher=("--min-replicas", "2", "--join-timeout", "2"), steps=400
    )
    assert code != 0
    assert found == {}
    failures = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("failed-*.json")]
    assert len(failures) == 1 and "--min-replicas 2" in failures[0]["message"], err[-3000:]
    assert time.time() - started < LIMIT_S


def test_a_respawned_worker_heals_from_a_live_peer(tmp_path):
    code, err, found = launch(tmp_path, "--kill", "1@10", "--sleep", "0.03", launcher=("--respawn",), steps=250)
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2, 3], err[-3000:]
    joiner = found[3]
    start = joiner["first_step"]
    assert 10 < start < 250
    # Right after the heal it holds exactly the members' weights at that step.
    assert joiner["healed"] == [-1.0] * start + [0.0] * (250 - start)
    assert "heal_recv" in kinds(joiner)
    assert any("heal_send" in kinds(r) for r in (found[0], found[2]))
    for result in found.values():
        assert result["w"] == [-1.0] * 250 and result["world"] == 3


def _pid_of(out: Path, worker: str) -> int:
    for path in out.glob("pid-*"):
        if path.read_text() == worker:
            return int(path.name.split("-")[1])
    raise AssertionError(f"no pid for worker {worker}")


@contextlib.contextmanager
def stopped_job(out: Path, *args: str) -> Iterator[tuple[subprocess.Popen, float, int, float]]:
    """The ledger job with ``args`` (a ``--stop``: the victim SIGSTOPs itself), once the victim has
    stopped: (the launcher, when it stopped, the victim's pid, the test's deadline). The launcher
    is killed if it still runs at the end."""
    out.mkdir()
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "3", *PRELOAD, str(SCRIPT)]
    launcher = subprocess.Popen(
        [*cmd, "--out", str(out), *args], stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        deadline = time.time() + LIMIT_S
        while not (out / "stopped").exists() and time.time() < deadline:
            time.sleep(0.05)
        yield launcher, float((out / "stopped").read_text()), _pid_of(out, "1"), deadline
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()


def test_a_stopped_worker_is_evicted_and_never_rejoins_an_old_membership(tmp_path):
    out = tmp_path / "out"
    with stopped_job(out, "--steps", "300", "--stop", "1@10") as (launcher, stopped_at, victim, deadline):
        time.sleep(4.0)  # past the eviction (2 s of silence), while the others train on
        os.kill(victim, signal.SIGCONT)
        _, err = launcher.communicate(timeout=deadline - time.time())
    found = results(out)
    assert sorted(found) == [0, 2], err[-3000:]
    for result in found.values():
        assert result["w"] == [-1.0] * 300
        regroup = next(t for t, kind, _ in result["events"] if kind == "regroup")
        assert regroup - stopped_at < 2.5  # evicted, and the survivors regrouped
    failures = [json.loads(p.read_text()) for p in out.glob("failed-*.json")]
    assert len(failures) == 1 and "evicted" in failures[0]["message"]


def test_a_stopped_worker_s_eviction_ends_the_async_rounds_waiting_on_it(tmp_path):
    """A SIGSTOPped worker keeps its sockets open: the survivors' averaging threads, inside a round
    with it, get no error from gloo. They must end that round when the membership moves (the
    eviction), or the survivors' regroup waits for them (it stops the thread) until the job's timeout."""
    out = tmp_path / "out"
    args = ("--steps", "60", "--algorithm", "async", "--stop", "1@10", "--average-at-end")
    with stopped_job(out, *args) as (launcher, stopped_at, victim, deadline):
        # The victim stays stopped (its sockets open) until both survivors have written their results.
        while len(results(out)) < 2 and time.time() < deadline - 15 and launcher.poll() is None:
            time.sleep(0.1)
        finished = time.time()
        os.kill(victim, signal.SIGCONT)
        _, err = launcher.communicate(timeout=max(1.0, deadline - time.time()))
    found = results(out)
    assert sorted(found) == [0, 2], err[-3000:]
    first, second = found[0], found[2]
    assert first["step"] == second["step"] == 60
    assert first["w"] == pytest.approx(second["w"], abs=1e-6)
    assert finished - stopped_at < 30, err[-3000:]  # not held until a backstop timeout


def test_when_the_coordinator_dies_every_worker_raises_rank_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "2", *PRELOAD, str(SCRIPT)]
    cmd += ["--out", str(out), "--steps", "2000"]
    launcher = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    pids: list[int] = []
    try:
        deadline = time.time() + LIMIT_S
        while len(list(out.glob("ready-*"))) < 2 and time.time() < deadline:  # both built their models
            time.sleep(0.05)
        pids = [int(p.name.split("-")[1]) for p in out.glob("pid-*")]
        time.sleep(1.0)  # training is under way
        launcher.kill()
        launcher.wait()
        killed_at = time.time()
        while len(list(out.glob("failed-*.json"))) < 2 and time.time() < killed_at + 10:
            time.sleep(0.05)
        failures = [json.loads(p.read_text()) for p in out.glob("failed-*.json")]
    finally:
        for pid in pids:  # the workers the launcher started, by pid, if they outlived the check
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(failures) == 2
    for failure in failures:
        assert "coordinator" in failure["message"]
        assert failure["time"] - killed_at < 2.0


def test_the_job_s_own_group_may_be_passed_and_a_smaller_one_is_refused(tmp_path):
    # DDP code passing process_group=dist.group.WORLD: the job's group, built again at each regroup.
    code, err, found = launch(tmp_path / "world", "--group", "world", "--kill", "1@10")
    assert code == 0, err[-3000:]
    assert sorted(found) == [0, 2] and all(r["w"] == [-1.0] * 40 for r in found.values())
    # A group of some of the members cannot follow a membership that changes: refused on every rank.
    code, err, found = launch(tmp_path / "two", "--group", "first-two", steps=4)
    assert code != 0 and not found
    assert err.count("was given a process_group that is not the job's whole group (2 of the job's 3") == 2, err[-3000:]
    assert err.count("process_group that is not the job's whole group (this process is not in it)") == 1


def test_an_algorithm_without_recovery_is_refused_at_construction_and_at_a_switch(tmp_path):
    # no_recovery: allreduce declaring no Recovery, registered by the ledger script.
    refused = "fault_tolerant=True does not support algorithm 'no_recovery'"
    code, err, found = launch(tmp_path / "built", "--algorithm", "no_recovery", steps=4)
    assert code != 0 and not found
    assert err.count(refused) == 3, err[-3000:]
    code, err, found = launch(tmp_path / "switched", "--switch-to", "no_recovery@3", steps=6)
    assert code != 0 and not found
    assert err.count(refused) == 3, err[-3000:]
    assert "switch_to" in err  # raised by the switch, before the running algorithm stopped
    for name in supported():
        assert unison.algorithms.get(name).recovery is not None


def test_fault_tolerant_needs_the_launcher_and_a_supported_algorithm():
    import torch

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="unison launch --fault-tolerant"):
        unison.DataParallel(net, optimizer=opt, fault_tolerant=True)
    assert {"allreduce", "demo", "nonblocking"} <= set(supported())


SAMPLER_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_sampler.py"


def test_the_sampler_re_deals_the_epoch_and_a_joiner_resumes_its_position(tmp_path):
    """3 workers, 240 indices, batches of 4: worker 1 dies before step 5 and a replacement joins
    mid-run. In every epoch no index is trained twice; only the batches the events call lost
    and at most world-1 indices per re-deal (cut for equal shards) are missing."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "3", "--respawn", *PRELOAD]
    cmd += [str(SAMPLER_SCRIPT), "--out", str(out), "--epochs", "4", "--sleep", "0.05", "--kill", "1@5"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=LIMIT_S, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = results(out)
    assert sorted(found) == [0, 2, 3], done.stderr[-3000:]
    joiner_epoch, joiner_step = found[3]["first"]
    assert joiner_step > 5
    steps: dict[int, set] = {}
    trained: dict[int, list] = {}
    for log in out.glob("*.jsonl"):
        for line in log.read_text().splitlines():
            epoch, step, batch = json.loads(line)
            trained.setdefault(epoch, []).extend(batch)
            steps.setdefault(step, set()).add(log.stem)
    # Lost: a batch of 4 per worker named in a "lost" event (the dead one mid-step, or a member that
    # noticed the change between steps and never drew that step's batch); cut: world-1 per re-deal.
    events = found[0]["events"]
    lost = sum(
        4 * len(json.loads(detail[detail.index("[") : detail.index("]") + 1])) for _, k, detail in events if k == "lost"
    )
    cut = 2 * sum(k == "reshard" for _, k, _ in events)
    missing = 0
    for epoch, indices in trained.items():
        assert len(indices) == len(set(indices)), f"epoch {epoch}: an index trained twice"
        missing += 240 - len(indices)
    assert missing <= lost + cut, f"{missing} indices missing, {lost} lost and {cut} cut said"
    # The joiner trained from the step after its heal, in the members' epoch, alongside them.
    assert min(s for s, who in steps.items() if "3" in who) == joiner_step + 1
    assert all({"0", "2", "3"} <= who for s, who in steps.items() if s > joiner_step)
    assert any(kind == "lost" for _, kind, _ in found[0]["events"])
