"""Fault tolerance measured: how long a kill or a stop holds training up, how long a
replacement takes to heal in, what fault tolerance costs without faults, and the
goodput under chaos beside torchrun's restart-from-checkpoint path.

Real processes throughout (``benchmarks/fault_worker.py`` is the worker): a small
MLP (256-1024-1024-10, 1.3M parameters, batch 64 per worker, SGD with momentum,
one torch thread per worker), allreduce, under ``unison launch --fault-tolerant``.
Parts (``--only``, default all):

* ``kill``: 3 workers; at step ``--at`` the victim (worker ``run % 3``, rank 0
  too) arms a timer that fires a random part of one step later, notes
  ``time.time()`` and SIGKILLs itself. Latency: from that time until every
  survivor has committed its first step after its regroup, minus one fault-free
  step (the survivors' median step before the fault, same run). Target: at most
  0.5 s (+ that step), p95 at most 1 s.
* ``stop``: the same with SIGSTOP (evicted after the 2 s heartbeat timeout).
  Target: at most 2.5 s.
* ``heal``: 3 workers with ``--respawn``; worker 2 and then each replacement
  SIGKILL themselves after ``--chain-after`` steps of their own, so
  ``--repeats`` replacements heal in one after another, for each payload of
  ``--heal-mb`` MB of float32 parameters (momentum-free SGD, so the parameters
  are the payload; batch 16). Heal: from just before the joiner's
  ``DataParallel(...)`` to its first committed step (one step included). Also
  shown: process start (fork, read from /proc, to the script's first line),
  imports + admission (``unison.init()``; the joiner builds its model before),
  and the members' pause (their longest gap between two steps around the
  join, minus one step), and the whole of it: from the launcher's line that
  started the replacement to its first committed step. Target: at most 0.5 s +
  10 ms/MB. ``--preload MODULES`` forks the heal and goodput jobs' workers
  from a template that imported MODULES (``unison launch --preload``).
* ``overhead``: 2 workers; ``fault_tolerant=True`` against ``False`` for
  allreduce and diloco (period 16), beside ``compute`` (no communication), in
  fresh ``unison launch --fault-tolerant`` jobs of ``--rounds-per-job`` rounds:
  ``unison.init()`` there builds a plain gloo group over the membership, which
  ``fault_tolerant=False`` uses as it is. Every contender built afresh per
  round, rounds in alternating order, a warm-up of whole periods past each
  algorithm's own, windows of whole periods (at least two) with everything
  inside, ``flush()`` timed apart; the figure is the median over rounds of
  ft/plain. The member's heartbeat thread (it reads the store every 20 ms) runs
  under both there, so ``--overhead-jobs`` pairs of jobs also compare the plain
  contenders under torchrun against the ft ones under the coordinator (each
  job's contender / compute, paired by job). Targets: at most 5% (allreduce),
  2% (diloco).
* ``goodput``: 3 workers; ``--clean-seconds`` fault-free, then for
  ``--chaos-seconds`` a random live worker is SIGKILLed every 3 +- 1 s (the
  same schedule and draws for both contenders of a round; a kill due while no
  worker lives waits for the first to appear): ``unison launch --fault-tolerant
  --respawn`` against torchrun ``--max-restarts`` restarting the whole group
  from the ``unison.save`` checkpoint written every ``--checkpoint-every``
  steps. A step counts at the last time it was committed (a step redone after a
  restart counts when redone). Goodput: the chaos window's steps per second over
  the fault-free steps per second, which is the plain job's (torchrun, no fault
  tolerance) fault-free window in the same round, for both contenders. Target:
  at least 70% (fault tolerance). Also given: the same in samples (steps x
  world; on 2 cores a step of fewer workers is faster), and each job's chaos
  over its own fault-free window.

False failures: a worker notes each failure event no fault explains
(``Operation timed out!``, see ``Ledger.summary``). They are counted over every
fault-tolerant run and shown. A kill or stop run where one came before the
survivors resumed, and an overhead job with one, are spoiled: ended at once and
run again (kill and stop: at most 3 x ``--repeats`` runs; overhead: 3 tries).
In a heal run, and in a goodput run outside its chaos, the stuck worker is
SIGKILLed (it would wait a minute for a membership that never comes; a goodput
job's own fault-free figure is then dropped); during chaos they are left to
the next kill.

Every run builds its processes afresh; times are ``time.time()`` on one machine.
Medians and p95 (linear between order statistics) over the repeats; every raw
value is in the JSON. The full run (about 20 minutes on 2 cores)::

    python benchmarks/bench_faults.py

A tiny run: ``--only kill,heal --repeats 1 --heal-mb 1``. Prints a table;
writes benchmarks/results/faults.json (or ``--json PATH``).

``--against torchft`` runs, instead of the parts, the same workload under unison
and under torchft side by side (stall after a kill, replacement start to its
first step, ledger, goodput, fault-free step time against torch DDP): see
``benchmarks/against_torchft.py``. It needs torchft, a bench extra that is never a
dependency of the library, installed without touching torch::

    pip install --no-deps torchft==0.2.0 opentelemetry-api opentelemetry-sdk \\
        opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http \\
        opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common \\
        opentelemetry-exporter-http-transport opentelemetry-proto protobuf googleapis-common-protos

    python benchmarks/bench_faults.py --against torchft --repeats 3 --torchft-heartbeat-ms 5000,1000 \\
        --goodput-rounds 1 --chaos-seconds 20 --clean-seconds 5 --json benchmarks/results/faults_torchft.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from fault_jobs import HERE, Job, fresh, ft_command, load_json, med, median_step, p95, steps_of, torchrun_command

PARTS = ("kill", "stop", "heal", "overhead", "goodput")
LIMITS = {"allreduce": 0.05, "diloco": 0.02}  # the overhead targets: ft/plain at most 1 + this
TARGETS = {
    "kill": "median <= 0.5 s and p95 <= 1 s (after one step)",
    "stop": "median <= 2.5 s (after one step)",
    "heal": "<= 0.5 s + 10 ms/MB",
    "overhead": "<= 5% (allreduce), <= 2% (diloco)",
    "goodput": ">= 70% of fault-free steps/s",
}


# ---- false failures ---------------------------------------------------------------------
class Ledger:
    """Every fault-tolerant run's committed steps and the failures no fault explains in it."""

    def __init__(self) -> None:
        self.steps = 0
        self.notes: list[dict] = []
        self.stalled: list[dict] = []  # runs where a worker gave up after a minute without a membership
        self.runs = 0
        self.fault_free = {"runs": 0, "committed_steps": 0, "coordinator_failures": []}

    def add(self, part: str, job: Job) -> list[dict]:
        top = max((s for p in job.out.glob("steps-*.txt") for _, s, _ in steps_of(p)), default=0)
        notes = [{**n, "part": part, "run": job.out.name} for n in job.false_failures()]
        if part == "overhead":  # no fault is injected at all: any failure the coordinator saw is false
            self.fault_free["runs"] += 1
            self.fault_free["committed_steps"] += top
            self.fault_free["coordinator_failures"] += [
                {"run": job.out.name, "line": line} for _, line in job.lines if "unison coordinator: failure" in line
            ]
        self.steps, self.runs = self.steps + top, self.runs + 1
        self.notes += notes
        stalled = sum("no membership with this worker came within" in line for _, line in job.lines)
        if stalled:
            self.stalled.append({"part": part, "run": job.out.name, "workers": stalled})
        return notes

    def summary(self) -> dict:
        return {
            "count": len(self.notes),
            "runs": self.runs,
            "committed_steps": self.steps,
            "per_1000_steps": 1000 * len(self.notes) / max(self.steps, 1),
            "what": "a worker's failure event 'Operation timed out!' with no fault injected: a 20 ms wait "
            "slice of Member.wait that ran out taken for a failed collective (the bug fixed in db40553: "
            "46 in 12594 steps before it); counted in every fault-tolerant run",
            "fault_free_jobs": {
                **self.fault_free,
                "what": "the overhead part's jobs, where no fault is injected: every failure the coordinator "
                "noted (a death, an eviction) is a false one",
            },
            "notes": self.notes,
            "stalled_a_minute": self.stalled,
            "stalled_what": "runs where a worker raised RankFailure 'no membership with this worker came within "
            "60 s' (a failure it took for a membership change, noted or not: one during DataParallel(...) "
            "construction comes before the worker can see model.ft)",
        }


LEDGER = Ledger()


# ---- kill and stop ---------------------------------------------------------------------
def latency_part(kind: str, args: argparse.Namespace, root: Path) -> dict:
    """SIGKILL or SIGSTOP one of 3 workers mid-step; time until every survivor commits again.
    A run spoiled by a false failure before the survivors resumed is ended and run again
    (at most 3 x --repeats runs); every run is in the JSON."""
    rows: list[dict] = []
    valid: list[dict] = []
    while len(valid) < args.repeats and len(rows) < 3 * args.repeats:
        r = len(rows)
        out = fresh(root, f"{kind}-{r}")
        victim = r % 3
        cmd = ft_command(
            3, out, "train", "--fault", kind, "--victim", victim, "--at", args.at, "--steps", args.at + 30, "--seed", r
        )
        job = Job(cmd, out, timeout=120)
        code = job.wait(on_false="end")
        false = LEDGER.add(kind, job)
        row: dict[str, Any] = {"run": r, "victim": victim, "exit_code": code, "false_failures": false}
        try:
            row.update(measure_latency(out, victim, args.at, false))
            valid.append(row)
        except Exception as exc:  # a run that went wrong is reported, not hidden
            row["error"] = f"{type(exc).__name__}: {exc}"
            if not false:
                row["error"] += f"; launcher said:\n{job.tail()}"
        rows.append(row)
        print(f"  {kind} {r}: " + (f"{row['latency_s']:.3f} s" if "latency_s" in row else row["error"]), flush=True)
    latencies = [row["latency_s"] for row in valid]
    summary = {
        "median_s": med(latencies),
        "p95_s": p95(latencies),
        "valid": len(valid),
        "runs": len(rows),
        "spoiled_by_false_failures": sum(bool(row["false_failures"]) and "error" in row for row in rows),
        "raw_median_s": med([row["raw_s"] for row in valid]),
        "to_regroup_median_s": med([row["to_regroup_s"] for row in valid]),
        "step_ms": 1000 * med([row["step_s"] for row in valid]),
        "target": TARGETS[kind],
        "repeats": rows,
    }
    complete = len(valid) == args.repeats
    if kind == "kill":
        summary["met"] = summary["median_s"] <= 0.5 and summary["p95_s"] <= 1.0 and complete
    else:
        summary["met"] = summary["median_s"] <= 2.5 and complete
    return summary


def measure_latency(out: Path, victim: int, at: int, false: list[dict]) -> dict:
    fault = load_json(out / "fault.json")
    if fault is None:
        raise RuntimeError("the victim never fired")
    t_fault = fault["time"]
    resumed, regrouped, steps = [], [], []
    for wid in (i for i in range(3) if i != victim):
        timeline = load_json(out / f"timeline-{wid}.json")
        rows = steps_of(out / f"steps-{wid}.txt")
        if timeline is None or not any(s == at and world == 3 for _, s, world in rows):
            raise RuntimeError(f"survivor {wid} did not reach step {at} with 3 members")
        regroup = min((t for t, kind, _ in timeline["events"] if kind == "regroup" and t >= t_fault), default=None)
        if regroup is None:
            raise RuntimeError(f"survivor {wid} has no regroup after the fault")
        regrouped.append(regroup)
        resumed.append(min(t for t, _, _ in rows if t > regroup))
        steps.append(median_step(rows, 10, at))
    if any(n["time"] < max(resumed) for n in false):
        raise RuntimeError("a false failure came before the survivors resumed")
    step = statistics.median(steps)
    raw = max(resumed) - t_fault
    return {
        "latency_s": raw - step,
        "raw_s": raw,
        "step_s": step,
        "to_regroup_s": max(regrouped) - t_fault,
        "fault_time": t_fault,
    }


# ---- heal --------------------------------------------------------------------------------
def heal_part(args: argparse.Namespace, root: Path) -> dict:
    sys.path.insert(0, str(HERE))
    from fault_worker import hidden_for_mb

    sizes = {}
    for mb in args.heal_mb:
        out = fresh(root, f"heal-{mb:g}mb")
        hidden = hidden_for_mb(mb)
        cmd = ft_command(
            3,
            out,
            "train",
            "--hidden",
            hidden,
            "--batch",
            args.heal_batch,
            "--momentum",
            0,
            "--chain",
            args.repeats,
            "--chain-after",
            args.chain_after,
            respawn=True,
            preload=args.preload,
        )
        job = Job(cmd, out, timeout=90 + 20 * args.repeats * (1 + mb / 25))
        code = job.wait(on_false="rescue")
        false = LEDGER.add("heal", job)
        rows = heal_rows(out, job)
        errors = [] if code == 0 else [f"launcher exit code {code}:\n{job.tail()}"]
        if len(rows) < args.repeats:
            errors.append(f"{len(rows)} joiners healed in, not {args.repeats}")
        heals = [row["heal_s"] for row in rows]
        target = 0.5 + 0.01 * mb
        sizes[f"{mb:g}"] = {
            "mb": mb,
            "hidden": hidden,
            "payload_mb": next((row["payload_mb"] for row in rows), float("nan")),
            "heal_median_s": med(heals),
            "heal_p95_s": p95(heals),
            "target_s": target,
            "met": med(heals) <= target and not errors,
            "transfer_median_s": med([row["transfer_s"] for row in rows]),
            "dataparallel_median_s": med([row["dataparallel_s"] for row in rows]),
            "process_start_median_s": med([row["process_start_s"] for row in rows]),
            "started_to_first_step_median_s": med([row["started_to_first_step_s"] for row in rows]),
            "imports_median_s": med([row["imports_s"] for row in rows]),
            "admission_median_s": med([row["admission_s"] for row in rows]),
            "members_pause_median_s": med([row["members_pause_s"] for row in rows]),
            "step_ms": 1000 * med([row["step_s"] for row in rows]),
            "exit_code": code,
            "false_failures": false,
            "rescued": [n["worker"] for n in job.rescued],
            "errors": errors,
            "repeats": rows,
        }
        print(f"  heal {mb:g} MB: {med(heals):.3f} s over {len(heals)} joiners", flush=True)
    return {"target": TARGETS["heal"], "sizes": sizes}


def heal_rows(out: Path, job: Job) -> list[dict]:
    """Per joiner (a worker that healed in), its timeline and the members' pause around its join."""
    spawned_seen = {}
    for t, line in job.lines:
        m = re.search(r"respawn: worker (\d+) started", line)
        if m:
            spawned_seen[int(m.group(1))] = t
    logs = {int(p.stem.split("-")[1]): steps_of(p) for p in out.glob("steps-*.txt")}
    rows = []
    for path in out.glob("timeline-*.json"):
        tl = load_json(path)
        if tl is None or "first_commit" not in tl or tl["first_step"] == 0:
            continue
        wid = tl["id"]
        heal_recv = [d for _, kind, d in tl["events"] if kind == "heal_recv"]
        transfer = re.search(r"in ([0-9.]+) s", heal_recv[0]) if heal_recv else None
        pauses, steps = [], []
        for other, log in logs.items():
            before = [(t, s) for t, s, _ in log if t < tl["init_done"]]
            after = [(t, s) for t, s, _ in log if t >= tl["init_done"]]
            if other == wid or len(before) <= 20 or not after:
                continue
            step = median_step(log, before[-20][1], before[-1][1])
            steps.append(step)
            pauses.append(after[0][0] - before[-1][0] - step)
        rows.append(
            {
                "worker": wid,
                "ordinal": tl.get("ordinal"),
                "heal_s": tl["first_commit"] - tl["before_dp"],
                "dataparallel_s": tl["after_dp"] - tl["before_dp"],
                "transfer_s": float(transfer.group(1)) if transfer else float("nan"),
                "process_start_s": tl["script_start"] - tl["spawned"],
                "process_start_launcher_s": tl["script_start"] - spawned_seen.get(wid, float("nan")),
                "started_to_first_step_s": tl["first_commit"] - spawned_seen.get(wid, float("nan")),
                "imports_s": tl["imported"] - tl["script_start"],
                "admission_s": tl["init_done"] - tl["built"],
                "members_pause_s": max(pauses, default=float("nan")),
                "step_s": med(steps),
                "healed_at_step": tl["first_step"],
                "payload_mb": tl["payload_mb"],
            }
        )
    return sorted(rows, key=lambda row: row["worker"])


# ---- overhead ----------------------------------------------------------------------------
def overhead_job(root: Path, name: str, cmd_for, attempts: int = 3) -> dict:
    """One overhead job, run again (at most ``attempts`` times) if a false failure spoils it."""
    tries = []
    for a in range(attempts):
        out = fresh(root, f"{name}-try{a}")
        job = Job(cmd_for(out), out, timeout=600)
        code = job.wait(on_false="end")
        false = LEDGER.add("overhead", job) if "unison" in job.cmd else []
        result = load_json(out / "overhead.json")
        if result is not None and code == 0 and not false:
            return {**result, "spoiled_tries": tries}
        tries.append({"exit_code": code, "false_failures": false, "tail": job.tail() if not false else ""})
    return {"error": "every try failed", "spoiled_tries": tries}


def overhead_part(args: argparse.Namespace, root: Path) -> dict:
    window = ["--window", args.window, "--warmup", args.warmup]
    names = args.overhead_algorithms
    contenders = ",".join(["compute"] + [f"{n}{suffix}" for n in names for suffix in ("", "+ft")])
    jobs = []
    per_job = args.rounds_per_job
    for first in range(0, args.overhead_rounds, per_job):
        n = min(per_job, args.overhead_rounds - first)
        jobs.append(
            overhead_job(
                root,
                f"overhead-{first}",
                lambda out, first=first, n=n: ft_command(
                    2, out, "overhead", "--contenders", contenders, "--first-round", first, "--rounds", n, *window
                ),
            )
        )
    rounds = [r for j in jobs for r in j.get("rounds", [])]
    summary: dict[str, Any] = {"target": TARGETS["overhead"]}
    within = {}
    for name in names:
        limit = LIMITS[name]
        ratios = [r[f"{name}+ft"]["ms"] / r[name]["ms"] for r in rounds]
        within[name] = {
            "ft_vs_plain": med(ratios),
            "ft_vs_plain_rounds": ratios,
            "plain_vs_compute": med([r[name]["ms"] / r["compute"]["ms"] for r in rounds]),
            "ft_vs_compute": med([r[f"{name}+ft"]["ms"] / r["compute"]["ms"] for r in rounds]),
            "plain_ms": med([r[name]["ms"] for r in rounds]),
            "ft_ms": med([r[f"{name}+ft"]["ms"] for r in rounds]),
            "target": 1 + limit,
            "met": med(ratios) <= 1 + limit and len(rounds) == args.overhead_rounds,
        }
    summary["within_one_job"] = {
        "how": f"fresh `unison launch --fault-tolerant --nproc 2` jobs of {per_job} round(s) each; every round "
        "builds every contender afresh, in alternating order from round to round; plain DataParallel runs on the gloo group "
        "unison.init() built over the membership (the member's heartbeat thread runs under both); "
        "the figure is the median over rounds of ft/plain",
        "rounds_valid": len(rounds),
        "compute_ms": med([r["compute"]["ms"] for r in rounds]),
        "algorithms": within,
        "rounds": rounds,
        "spoiled_tries": [t for j in jobs for t in j["spoiled_tries"]],
    }
    common = [*window, "--rounds", 1]
    summary["across_launchers"] = across_launchers(args, root, common) if args.overhead_jobs else None
    return summary


def across_launchers(args: argparse.Namespace, root: Path, common: list) -> dict:
    """Plain contenders under torchrun against ft ones under the coordinator, a pair of jobs at a time."""
    names = args.overhead_algorithms
    pairs = []
    for j in range(args.overhead_jobs):
        pair: dict[str, Any] = {}
        for kind in ("plain", "ft") if j % 2 == 0 else ("ft", "plain"):
            if kind == "plain":
                specs = "compute," + ",".join(names)
                launch = torchrun_command
            else:
                specs = "compute," + ",".join(f"{n}+ft" for n in names)
                launch = ft_command  # type: ignore[assignment]
            result = overhead_job(
                root,
                f"overhead-{kind}-{j}",
                lambda out, s=specs, f=launch, j=j: f(
                    2, out, "overhead", "--contenders", s, "--first-round", j, *common
                ),
            )
            if "rounds" not in result:
                pair[kind] = result
                continue
            suffix = "" if kind == "plain" else "+ft"
            r0 = result["rounds"][0]
            pair[kind] = {
                "launcher": result["launcher"],
                **{n: r0[n + suffix]["ms"] / r0["compute"]["ms"] for n in names},
                "compute_ms": r0["compute"]["ms"],
                "round": r0,
                "spoiled_tries": result["spoiled_tries"],
            }
        pairs.append(pair)
    ok = [p for p in pairs if "error" not in p["plain"] and "error" not in p["ft"]]
    return {
        "algorithms": list(names),
        "how": "pairs of fresh jobs in alternating order: the plain contenders under torchrun, the ft ones under "
        "`unison launch --fault-tolerant` (coordinator and heartbeat thread included); per job, contender/compute "
        "in that job; the figure is the median over pairs of ft/plain",
        **{f"{n}_ft_vs_plain": med([p["ft"][n] / p["plain"][n] for p in ok]) for n in names},
        **{f"{n}_pairs": [p["ft"][n] / p["plain"][n] for p in ok] for n in names},
        "jobs": pairs,
    }


# ---- goodput under chaos -----------------------------------------------------------------
def goodput_part(args: argparse.Namespace, root: Path) -> dict:
    rounds = []
    for r in range(args.goodput_rounds):
        rng = random.Random(args.seed * 7919 + r)
        schedule, t = [], 0.0
        while True:
            t += rng.uniform(2.0, 4.0)
            if t >= args.chaos_seconds:
                break
            schedule.append(t)
        draws = [rng.random() for _ in schedule]
        measured: dict[str, dict] = {}
        for kind in ("ft", "elastic") if r % 2 == 0 else ("elastic", "ft"):
            measured[kind] = chaos_run(kind, fresh(root, f"goodput-{kind}-{r}"), args, schedule, draws)
        plain = measured["elastic"]
        for kind, m in measured.items():  # the fault-free rate: the plain job's, without fault tolerance
            if "chaos_steps_per_s" in m and plain.get("clean_steps_per_s"):
                m["goodput"] = m["chaos_steps_per_s"] / plain["clean_steps_per_s"]
                m["samples_goodput"] = m["chaos_samples_per_s"] / plain["clean_samples_per_s"]
            shown = f"{m['goodput']:.2f}" if "goodput" in m else m.get("error", "?")
            print(f"  goodput {kind} {r}: {shown}", flush=True)
        rounds.append({"schedule_s": schedule, **measured})
    out: dict[str, Any] = {"target": TARGETS["goodput"], "rounds": rounds}
    for kind in ("ft", "elastic"):
        good = [r[kind] for r in rounds if "goodput" in r[kind]]
        out[kind] = {
            "goodput_median": med([g["goodput"] for g in good]),
            "samples_goodput_median": med([g["samples_goodput"] for g in good]),
            "same_job_median": med([g["same_job"] for g in good]),
            "same_job_valid": sum(g["same_job"] == g["same_job"] for g in good),
            "clean_steps_per_s_median": med([g["clean_steps_per_s"] for g in good]),
            "chaos_steps_per_s_median": med([g["chaos_steps_per_s"] for g in good]),
            "false_failure_stall_s_median": med([g.get("false_failure_stall_s", 0.0) for g in good]),
            "valid": len(good),
        }
    both = [r for r in rounds if "goodput" in r["ft"] and "goodput" in r["elastic"]]
    out["ft_vs_elastic_chaos"] = med([r["ft"]["chaos_steps_per_s"] / r["elastic"]["chaos_steps_per_s"] for r in both])
    out["met"] = out["ft"]["goodput_median"] >= 0.7 and out["ft"]["valid"] == args.goodput_rounds
    return out


def chaos_run(kind: str, out: Path, args: argparse.Namespace, schedule: list[float], draws: list[float]) -> dict:
    """One job: fault-free, then chaos. A worker stuck by a false failure in the fault-free window is
    SIGKILLed (it would hold everyone up for a minute); that window then has no figure (``same_job``)."""
    limit = args.clean_seconds + args.chaos_seconds + 180
    if kind == "ft":
        job = Job(ft_command(3, out, "train", respawn=True, preload=args.preload), out, timeout=limit)
    else:
        worker = ["elastic", "--ckpt", out / "ckpt.pt", "--checkpoint-every", args.checkpoint_every]
        job = Job(torchrun_command(3, out, *worker, max_restarts=10000), out, timeout=limit)
    kills: list[dict] = []
    try:
        t_first = None
        while t_first is None and job.proc.poll() is None and time.time() < job.started + 120:
            logs = [steps_of(p) for p in out.glob("steps-*.txt")]
            t_first = min((rows[0][0] for rows in logs if rows), default=None)
            time.sleep(0.05)
        if t_first is None:
            return {"error": f"never trained; launcher said:\n{job.tail()}"}
        t_clean = t_first + min(2.0, args.clean_seconds)  # past the first steps' warm-up
        t_chaos = t_clean + args.clean_seconds
        t_end = t_chaos + args.chaos_seconds
        rescued: set[float] = set()
        for offset, draw in zip(schedule, draws):
            while time.time() < t_chaos + offset:
                for n in job.false_failures():
                    if n["time"] < t_chaos and n["time"] not in rescued and n["pid"] in job.workers():
                        rescued.add(n["time"])
                        os.kill(n["pid"], signal.SIGKILL)
                time.sleep(0.01)
            while job.proc.poll() is None:
                live = sorted(job.workers().items())
                if live:
                    pid, tag = live[int(draw * len(live))]
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"time": time.time(), "at_s": offset, "pid": pid, "worker": tag, "live": len(live)})
                    break
                time.sleep(0.02)  # between a group's end and the next one's start: kill the first to appear
        while time.time() < t_end:
            time.sleep(0.05)
        top = max((s for p in out.glob("steps-*.txt") for _, s, _ in steps_of(p)), default=0)
        (out / "stop.tmp").write_text(str(top + 20))
        os.replace(out / "stop.tmp", out / "stop")
        code = job.wait(on_false="rescue" if kind == "ft" else "note")
    finally:
        job.end()
    false = LEDGER.add("goodput", job) if kind == "ft" else []
    final: dict[int, tuple[float, int]] = {}
    for path in out.glob("steps-*.txt"):
        for t, s, world in steps_of(path):
            if s not in final or t > final[s][0]:
                final[s] = (t, world)

    def progress(until: float) -> tuple[int, int]:
        done = [world for t, world in final.values() if t <= until]
        return len(done), sum(done)

    (c0, w0), (c1, w1), (c2, w2) = progress(t_clean), progress(t_chaos), progress(t_end)
    clean, chaos = (c1 - c0) / args.clean_seconds, (c2 - c1) / args.chaos_seconds
    disturbed = any(n["time"] < t_chaos for n in false)
    result = {
        "exit_code": code,
        "clean_steps_per_s": clean,
        "chaos_steps_per_s": chaos,
        "clean_samples_per_s": (w1 - w0) / args.clean_seconds,
        "chaos_samples_per_s": (w2 - w1) / args.chaos_seconds,
        "same_job": chaos / clean if clean and not disturbed else float("nan"),
        "clean_window_disturbed": disturbed,
        "kills": kills,
        "deferred_kills": sum(k["time"] - t_chaos - k["at_s"] > 0.1 for k in kills),
        "false_failures": false,
        "final_step": max(final, default=0),
    }
    if kind == "ft":
        published = [t for t, line in job.lines if "regroup: epoch" in line]
        stalls = [
            min([t for t in published if t > n["time"]] + [t_end]) - n["time"] for n in false if n["time"] < t_end
        ]
        result["false_failure_stall_s"] = sum(max(0.0, s) for s in stalls)
        result["respawns"] = sum("respawn:" in line for _, line in job.lines)
        result["regroups"] = sum("regroup:" in line for _, line in job.lines)
        result["rescued"] = len(rescued) + len(job.rescued)
    else:
        result["restarts"] = len({p.read_text() for p in out.glob("pid-*")}) - 1
    if code != 0:
        result["error"] = f"exit code {code}:\n{job.tail()}"
    return result


# ---- the report ----------------------------------------------------------------------------
def table(results: dict) -> list[str]:
    lines = [f"{'figure':52} {'measured':>10} {'target':>12}  met"]

    def row(name: str, value: str, target: str = "", met: Any = None) -> None:
        lines.append(f"{name:52} {value:>10} {target:>12}  {'' if met is None else 'yes' if met else 'NO'}")

    for part in PARTS:
        if "error" in results.get(part, {}):
            row(f"{part}: failed (see the JSON)", "-")
    results = {k: v for k, v in results.items() if not (isinstance(v, dict) and "error" in v)}
    for kind, limit in (("kill", "<= 0.5 s"), ("stop", "<= 2.5 s")):
        if kind in results:
            k = results[kind]
            name = f"{kind} latency - 1 step ({k['step_ms']:.0f} ms), median of {k['valid']}/{k['runs']} runs"
            row(name, f"{k['median_s']:.3f} s", limit, k["met"])
            if kind == "kill":
                row("kill latency - 1 step, p95", f"{k['p95_s']:.3f} s", "<= 1 s", k["p95_s"] <= 1.0)
    if "heal" in results:
        for s in results["heal"]["sizes"].values():
            n = len(s["repeats"])
            name = f"heal {s['mb']:g} MB (1 step: {s['step_ms']:.0f} ms), median of {n}"
            row(name, f"{s['heal_median_s']:.3f} s", f"<= {s['target_s']:.2f} s", s["met"])
            row(f"  {s['mb']:g} MB: heal p95", f"{s['heal_p95_s']:.3f} s")
            row(f"  {s['mb']:g} MB: process start (not in heal)", f"{s['process_start_median_s']:.3f} s")
            row(
                f"  {s['mb']:g} MB: imports + admission (not in heal)",
                f"{s['imports_median_s'] + s['admission_median_s']:.3f} s",
            )
            row(f"  {s['mb']:g} MB: members' pause - 1 step", f"{s['members_pause_median_s']:.3f} s")
            row(f"  {s['mb']:g} MB: launcher's start to its first step", f"{s['started_to_first_step_median_s']:.3f} s")
    if "overhead" in results:
        o = results["overhead"]
        w = o["within_one_job"]
        for name, a in w["algorithms"].items():
            label = f"overhead {name} ft/plain, median of {w['rounds_valid']} rounds"
            row(label, f"{a['ft_vs_plain']:.3f}", f"<= {a['target']:.2f}", a["met"])
        across = o.get("across_launchers")
        if across:
            for name in across["algorithms"]:
                limit = 1 + LIMITS[name]
                value = across[f"{name}_ft_vs_plain"]
                n = len(across[f"{name}_pairs"])
                row(
                    f"overhead {name} ft/plain, vs torchrun ({n} job pairs)",
                    f"{value:.3f}",
                    f"<= {limit:.2f}",
                    value <= limit,
                )
    if "goodput" in results:
        g = results["goodput"]
        ft, el = g["ft"], g["elastic"]
        row(
            f"goodput ft --respawn, chaos steps/s / fault-free ({ft['valid']} runs)",
            f"{ft['goodput_median']:.2f}",
            ">= 0.70",
            g["met"],
        )
        row("  the same in samples/s (steps x world)", f"{ft['samples_goodput_median']:.2f}")
        row(f"  chaos / its own fault-free window ({ft['same_job_valid']} runs)", f"{ft['same_job_median']:.2f}")
        row("  seconds stalled by false failures, per run", f"{ft['false_failure_stall_s_median']:.1f} s")
        row(f"goodput torchrun restarts, the same ({el['valid']} runs)", f"{el['goodput_median']:.2f}")
    if "false_failures" in results:
        f = results["false_failures"]
        label = f"false failures, no fault injected ({f['committed_steps']} ft steps)"
        row(label, f"{f['count']}", "0", f["count"] == 0)
        free = f.get("fault_free_jobs")
        if free and free["runs"]:
            label = f"  coordinator failures in fault-free jobs ({free['committed_steps']} steps)"
            row(label, f"{len(free['coordinator_failures'])}", "0", not free["coordinator_failures"])
    return lines


def git_state() -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "modified": git("status", "--porcelain", "--untracked-files=no").splitlines(),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help="comma list of parts (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10, help="kills, stops and heals per size")
    parser.add_argument("--at", type=int, default=30, help="the step at which the victim fires")
    parser.add_argument("--heal-mb", default="1,10,50", help="payload sizes to heal, in MB")
    parser.add_argument("--heal-batch", type=int, default=16)
    parser.add_argument("--chain-after", type=int, default=20, help="steps a replacement takes before the next kill")
    parser.add_argument("--overhead-rounds", type=int, default=10, help="at least 3")
    parser.add_argument("--rounds-per-job", type=int, default=1, help="overhead rounds per fresh job")
    parser.add_argument("--overhead-algorithms", default="allreduce,diloco", help="of: %(default)s")
    parser.add_argument("--overhead-jobs", type=int, default=4, help="pairs of jobs torchrun/coordinator (0: none)")
    parser.add_argument("--window", type=int, default=64, help="timed steps (whole diloco periods of 16)")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--goodput-rounds", type=int, default=3)
    parser.add_argument("--clean-seconds", type=float, default=15.0)
    parser.add_argument("--chaos-seconds", type=float, default=60.0)
    parser.add_argument("--checkpoint-every", type=int, default=20, help="torchrun path: unison.save every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preload",
        default="",
        metavar="MODULES",
        help="heal and goodput parts: unison launch --preload MODULES (workers forked from a template)",
    )
    parser.add_argument("--keep", default=None, help="keep the runs' files in this directory")
    parser.add_argument("--json", default=str(HERE / "results" / "faults.json"))
    parser.add_argument(
        "--against", choices=["torchft"], default=None, help="the side by side (benchmarks/against_torchft.py)"
    )
    parser.add_argument("--torchft-heartbeat-ms", default="5000", help="--against torchft: Lighthouse timeouts, a list")
    parser.add_argument("--torchft-wrappers", default="ddp,grads", help="--against torchft: ddp (its DDP), grads")
    parser.add_argument("--after-join", type=int, default=10, help="--against: steps of the replacement per kill run")
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if args.overhead_rounds < 3:
        parser.error("--overhead-rounds must be at least 3: the figure is a median of paired ratios")
    args.heal_mb = [float(x) for x in args.heal_mb.split(",") if x]
    args.overhead_algorithms = [a for a in args.overhead_algorithms.split(",") if a]
    if set(args.overhead_algorithms) - set(LIMITS):
        parser.error(f"--overhead-algorithms: choose from {','.join(LIMITS)}")
    started = time.time()
    load_at_start = os.getloadavg()
    results: dict[str, Any] = {}
    if args.against:
        return against(args, given, started, load_at_start)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) / f"run-{int(started)}" if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for part in parts:
            print(f"{part} ...", flush=True)
            began = time.time()
            try:
                if part in ("kill", "stop"):
                    results[part] = latency_part(part, args, root)
                elif part == "heal":
                    results[part] = heal_part(args, root)
                elif part == "overhead":
                    results[part] = overhead_part(args, root)
                else:
                    results[part] = goodput_part(args, root)
            except Exception:  # the other parts' figures still count; this one says why it has none
                results[part] = {"error": traceback.format_exc()}
                print(results[part]["error"], flush=True)
            results[part]["seconds"] = round(time.time() - began, 1)
            results["false_failures"] = LEDGER.summary()
            write_report(args, given, started, load_at_start, results, complete=part == parts[-1])
    print("\n".join(results["table"]))
    print(f"wrote {args.json}")
    return 0


def against(args: argparse.Namespace, given: list[str], started: float, load: tuple) -> int:
    """``--against torchft``: the same workload under unison and under torchft (benchmarks/against_torchft.py)."""
    sys.path.insert(0, str(HERE))
    import against_torchft

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) / f"run-{int(started)}" if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results = {"against": args.against, **against_torchft.run(args, root)}
    write_report(args, given, started, load, results, complete=True)
    print("\n".join(results["table"]))
    print(f"wrote {args.json}")
    return 0


def write_report(args, given: list[str], started: float, load: tuple, results: dict, complete: bool) -> None:
    """The JSON, after every part (``complete``: false until the last part is in)."""
    if "against" not in results:  # the side by side draws its own table
        results["table"] = table(results)
    report = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_faults.py", *given]),
        "complete": complete,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "load_at_start": load, "load_at_end": os.getloadavg()},
        "git": git_state(),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "keep")},
        **results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    sys.exit(main())
