"""``bench_faults.py --against torchft``: the same workload under unison and under torchft, side by side.

The workload is bench_faults.py's (its MLP, batch 64, SGD with momentum, one torch
thread per worker, 3 workers). Contenders:

* ``unison``: ``unison launch --fault-tolerant --respawn --nproc 3`` running
  ``benchmarks/fault_worker.py train``;
* ``torchft``: a ``torchft_lighthouse`` (``--min_replicas 1 --quorum_tick_ms 100
  --join_timeout_ms 10000``, as torchft's README starts it, and
  ``--heartbeat_timeout_ms`` from ``--torchft-heartbeat-ms``: 5000 is torchft's
  default) and one replica group of one process per worker
  (``benchmarks/torchft_worker.py train``: Manager, ProcessGroupGloo, torchft's
  DistributedDataParallel and Optimizer); torchft has no launcher that starts a
  replacement, so this benchmark does it, as soon as it sees a worker die (polled
  every 20 ms);
* ``ddp``: plain torch DDP on gloo under torchrun, the fault-free baseline.

Parts:

* kill runs (``--repeats`` per contender, in rotating order): at step ``--at``
  the victim (worker ``run % 3``) SIGKILLs itself a random part of one step
  later (fault_worker.py's schedule); a replacement is started; the run stops
  ``--after-join`` steps after the replacement's first step. Figures: the
  fault-free step time (median gap between the survivors' steps of 3 workers
  before the kill) over torch DDP's; the stall, from the kill to the last
  survivor's first step under the new membership (unison: after its regroup;
  torchft: the first step of a new quorum), raw and minus one step; the
  replacement's start (its fork, from /proc) to its first step, and its imports;
  the kill to the replacement's first step; the ledger: per worker, steps
  redone (a step number at or below one it committed) and skipped, and the
  steps refused and recomputed (unison: failure events; torchft: steps its
  Manager did not commit).
* goodput (``--goodput-rounds``, each contender once a round): ``--clean-seconds``
  fault-free, then for ``--chaos-seconds`` a random live worker SIGKILLed every
  3 +- 1 s (the same draws for both), replacements started. A step counts at the
  last time it was committed. Goodput: the chaos window's steps/s over torch DDP's
  fault-free steps/s (the ddp runs' median).

The whole mode takes about 5 minutes with ``--repeats 3 --goodput-rounds 1
--chaos-seconds 20``. torchft is a bench extra (``pip install --no-deps
torchft==0.2.0`` and its small imports: see torchft_worker.py), never a
dependency of the library.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from fault_jobs import ENV, HERE, Job, fresh, ft_command, load_json, med, p95, steps_of

TORCHFT_WORKER = HERE / "torchft_worker.py"


def lighthouse_command() -> list[str]:
    """torchft's ``torchft_lighthouse`` console script, run by this interpreter (its Rust main reads
    the process's arguments past the interpreter's first, so ``python -c`` cannot stand in)."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise SystemExit("--against torchft: no torchft_lighthouse script (pip install --no-deps torchft==0.2.0)")
    return [sys.executable, found]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchftJob:
    """A Lighthouse and one replica group (one process) per worker, started by this benchmark, which
    also starts a replacement (a new worker id) when a worker dies, under ``respawn``. Only the
    processes it started are ever signalled."""

    def __init__(self, n: int, out: Path, worker_args: list, heartbeat_ms: int, respawn: bool, timeout: float) -> None:
        self.out, self.worker_args, self.respawn, self.timeout = out, [str(a) for a in worker_args], respawn, timeout
        self.started = time.time()
        port = free_port()
        self.addr = f"http://127.0.0.1:{port}"
        self.log = open(out / "lighthouse.log", "w")
        lighthouse = ["--min_replicas", "1", "--bind", f"127.0.0.1:{port}", "--quorum_tick_ms", "100"]
        lighthouse += ["--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(heartbeat_ms)]
        self.lighthouse = subprocess.Popen(
            [*lighthouse_command(), *lighthouse], stdout=self.log, stderr=subprocess.STDOUT, env=ENV
        )
        self.procs: dict[int, subprocess.Popen] = {}
        self.codes: dict[int, Optional[int]] = {}
        self.respawns: list[dict] = []
        self.ending = False
        self.lock = threading.RLock()  # end() is called under it too
        for wid in range(n):
            self._start(wid)
        self.next_id = n
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def _start(self, wid: int) -> None:
        cmd = [sys.executable, str(TORCHFT_WORKER), "train", "--out", str(self.out), "--replica", str(wid)]
        cmd += ["--lighthouse", self.addr, *self.worker_args]
        log = open(self.out / f"worker-{wid}.log", "w")
        self.procs[wid] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**ENV, "REPLICA_GROUP_ID": str(wid)}
        )
        log.close()

    def _watch(self) -> None:
        while not self.ending:
            with self.lock:
                for wid, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or wid in self.codes:
                        continue
                    self.codes[wid] = code
                    if code != 0 and self.respawn and not self.ending:
                        new = self.next_id
                        self.next_id += 1
                        self._start(new)
                        self.respawns.append({"time": time.time(), "failed": wid, "code": code, "worker": new})
            time.sleep(0.02)

    def workers(self) -> dict[int, str]:
        """Live workers: pid -> worker id."""
        with self.lock:
            return {p.pid: str(w) for w, p in self.procs.items() if p.poll() is None}

    def wait(self, grace: float = 30.0) -> bool:
        """Until every worker ended (True), or the time limit or ``grace`` seconds from now (False:
        everything is then ended)."""
        deadline = min(self.started + self.timeout, time.time() + grace)
        while time.time() < deadline:
            with self.lock:
                if all(p.poll() is not None for p in self.procs.values()):
                    self.end()
                    return True
            time.sleep(0.1)
        self.end()
        return False

    def end(self) -> None:
        self.ending = True
        with self.lock:
            for proc in [*self.procs.values(), self.lighthouse]:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        self.log.close()

    def tail(self, n: int = 10) -> str:
        lines = []
        for path in sorted(self.out.glob("worker-*.log")):
            lines += [f"{path.name}: {line}" for line in path.read_text().splitlines()[-n:]]
        return "\n".join(lines[-3 * n :])


def parse(name: str) -> tuple[str, str, int]:
    """A contender's name: ``unison`` or ``torchft-<wrapper>-hb<heartbeat timeout ms>``."""
    if name == "unison":
        return "unison", "", 0
    _, wrapper, hb = name.split("-")
    return "torchft", wrapper, int(hb[2:])


def write_stop(out: Path, step: int) -> None:
    (out / "stop.tmp").write_text(str(step))
    os.replace(out / "stop.tmp", out / "stop")


def top_step(out: Path) -> int:
    return max((s for p in out.glob("steps-*.txt") for _, s, _ in steps_of(p)), default=0)


def steps_by_worker(out: Path) -> dict[str, list[tuple[float, int, int]]]:
    return {p.stem.split("-", 1)[1]: steps_of(p) for p in out.glob("steps-*.txt")}


# ---- the fault-free baseline -------------------------------------------------------------
def ddp_run(out: Path, steps: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    cmd += [str(TORCHFT_WORKER), "ddp", "--out", str(out), "--steps", str(steps)]
    job = Job(cmd, out, timeout=180)
    code = job.wait()
    logs = steps_by_worker(out)
    step = med([statistics.median(gaps(rows, 3, skip=10)) for rows in logs.values() if len(rows) > 12])
    result: dict[str, Any] = {"exit_code": code, "step_s": step, "steps_per_s": 1 / step if step else float("nan")}
    if code != 0:
        result["error"] = f"exit code {code}:\n{job.tail()}"
    return result


def gaps(rows: list[tuple[float, int, int]], world: int, skip: int = 5, before: float = float("inf")) -> list[float]:
    """Gaps between consecutive steps (numbers n-1, n) both of ``world`` workers, past the first ``skip``."""
    out = []
    for (t0, s0, w0), (t1, s1, w1) in zip(rows[skip:], rows[skip + 1 :]):
        if s1 == s0 + 1 and w0 == w1 == world and t1 < before:
            out.append(t1 - t0)
    return out or [float("nan")]


# ---- kill runs -----------------------------------------------------------------------------
def kill_run(name: str, r: int, args: argparse.Namespace, root: Path) -> dict:
    kind, wrapper, heartbeat_ms = parse(name)
    out = fresh(root, f"vs-{name}-{r}")
    victim = r % 3
    fault = ["--fault", "kill", "--victim", victim, "--at", args.at, "--seed", r]
    if kind == "unison":
        job: Any = Job(ft_command(3, out, "train", *fault, respawn=True), out, timeout=120)
    else:
        job = TorchftJob(3, out, [*fault, "--wrapper", wrapper], heartbeat_ms, respawn=True, timeout=120)
    limit = time.time() + 100
    try:
        while time.time() < limit:  # until the replacement has taken --after-join steps (or the limit)
            joined = [rows for wid, rows in steps_by_worker(out).items() if wid.isdigit() and int(wid) >= 3]
            if joined and len(joined[0]) >= args.after_join:
                break
            if isinstance(job, Job) and job.proc.poll() is not None:
                break
            time.sleep(0.05)
        write_stop(out, top_step(out) + 5)
        if isinstance(job, Job):
            code = job.wait()
            ok = code == 0
        else:
            ok = job.wait()
            code = 0 if ok else None
    finally:
        job.end()
    row: dict[str, Any] = {"run": r, "victim": victim, "exit_code": code}
    try:
        row.update(measure_kill(kind, out, victim))
    except Exception as exc:  # a run that went wrong is reported, not hidden
        row["error"] = f"{type(exc).__name__}: {exc}\n{job.tail()}"
    if not ok and "error" not in row:
        row["error"] = f"the job did not end cleanly (exit code {code}):\n{job.tail()}"
    if kind == "torchft":
        row["respawns"] = job.respawns
        row["survivors_crashed"] = sum(job.codes.get(w) not in (None, 0) for w in range(3) if w != victim)
        firsts = [rows[0][1] for w, rows in steps_by_worker(out).items() if w.isdigit() and int(w) >= 3 and rows]
        row["replacements_first_step"] = sorted(firsts)
    shown = (
        f"stall {row['stall_s']:.3f} s, replacement {row['start_to_first_step_s']:.2f} s"
        if "stall_s" in row
        else row["error"]
    )
    print(f"  {name} {r}: {shown}", flush=True)
    return row


def measure_kill(kind: str, out: Path, victim: int) -> dict:
    fault = load_json(out / "fault.json")
    if fault is None:
        raise RuntimeError("the victim never fired")
    t_fault = fault["time"]
    logs = steps_by_worker(out)
    survivors = [str(w) for w in range(3) if w != victim]
    new_membership = "regroup" if kind == "unison" else "quorum"
    resumed, steps = [], []
    for wid in survivors:
        timeline = load_json(out / f"timeline-{wid}.json")
        rows = logs.get(wid, [])
        if timeline is None or not rows:
            raise RuntimeError(f"survivor {wid} left no timeline or steps")
        changed = min((t for t, k, _ in timeline["events"] if k == new_membership and t > t_fault), default=None)
        if changed is None:
            raise RuntimeError(f"survivor {wid} saw no new membership after the kill")
        after = [t for t, _, _ in rows if t >= changed]
        if not after:
            raise RuntimeError(f"survivor {wid} took no step after the kill")
        resumed.append(min(after))
        steps.append(statistics.median(gaps(rows, 3, before=t_fault)))
    step = statistics.median(steps)
    ids = sorted(int(w) for w in logs if w.isdigit() and int(w) >= 3)
    if not ids:
        raise RuntimeError("no replacement took a step")
    tl = load_json(out / f"timeline-{ids[0]}.json") or {}
    if "first_commit" not in tl:
        raise RuntimeError(f"replacement {ids[0]} left no first step in its timeline")
    redone = skipped = 0
    for wid, rows in logs.items():
        if wid == str(victim):
            continue
        for (_, s0, _), (_, s1, _) in zip(rows, rows[1:]):
            redone += s1 <= s0
            skipped += max(0, s1 - s0 - 1)
    refused = 0
    for wid in survivors:
        events = (load_json(out / f"timeline-{wid}.json") or {}).get("events", [])
        refused += sum(k in ("failure", "uncommitted") and t >= t_fault for t, k, _ in events)
    victim_last = max((s for _, s, _ in logs.get(str(victim), [])), default=0)
    first_joined = min(s for _, s, _ in logs[str(ids[0])])
    end_of_stall = max(resumed)
    pauses = []
    for wid in survivors:
        rows = [t for t, _, _ in logs[wid] if end_of_stall <= t <= tl["first_commit"] + 2.0]
        pauses += [b - a for a, b in zip(rows, rows[1:])]
    return {
        "fault_time": t_fault,
        "step_s": step,
        "stall_raw_s": end_of_stall - t_fault,
        "stall_s": end_of_stall - t_fault - step,
        "start_to_first_step_s": tl["first_commit"] - tl["spawned"],
        "imports_s": tl["imported"] - tl["script_start"],
        "kill_to_replacement_step_s": tl["first_commit"] - t_fault,
        "join_pause_s": max(pauses) - step if pauses else float("nan"),
        "replacement": ids[0],
        "replacement_first_step": first_joined,
        "victim_last_step": victim_last,
        "steps_redone": redone,
        "steps_skipped": skipped,
        "steps_refused_after_kill": refused,
        "exact": redone == 0 and skipped == 0,
    }


def summarize_kills(rows: list[dict], ddp_step: float) -> dict:
    good = [r for r in rows if "stall_s" in r]
    step = med([r["step_s"] for r in good])
    return {
        "valid": len(good),
        "runs": len(rows),
        "step_ms": 1000 * step,
        "vs_ddp": step / ddp_step if ddp_step else float("nan"),
        "stall_median_s": med([r["stall_s"] for r in good]),
        "stall_p95_s": p95([r["stall_s"] for r in good]),
        "stall_raw_median_s": med([r["stall_raw_s"] for r in good]),
        "start_to_first_step_median_s": med([r["start_to_first_step_s"] for r in good]),
        "imports_median_s": med([r["imports_s"] for r in good]),
        "kill_to_replacement_step_median_s": med([r["kill_to_replacement_step_s"] for r in good]),
        "join_pause_median_s": med([r["join_pause_s"] for r in good]),
        "steps_redone": sum(r["steps_redone"] for r in good),
        "steps_skipped": sum(r["steps_skipped"] for r in good),
        "steps_refused_after_kill": sum(r["steps_refused_after_kill"] for r in good),
        "ledger_exact_runs": sum(r["steps_redone"] == 0 and r["steps_skipped"] == 0 for r in good),
        "repeats": rows,
    }


# ---- goodput under chaos -------------------------------------------------------------------
def chaos_run(name: str, out: Path, args: argparse.Namespace, schedule: list[float], draws: list[float]) -> dict:
    kind, wrapper, hb = parse(name)
    limit = args.clean_seconds + args.chaos_seconds + 120
    if kind == "unison":
        job: Any = Job(ft_command(3, out, "train", respawn=True), out, timeout=limit)
    else:
        job = TorchftJob(3, out, ["--wrapper", wrapper], hb, respawn=True, timeout=limit)
    kills: list[dict] = []
    try:
        t_first = None
        while t_first is None and time.time() < job.started + 120:
            logs = [rows for rows in steps_by_worker(out).values() if rows]
            t_first = min((rows[0][0] for rows in logs), default=None)
            time.sleep(0.05)
        if t_first is None:
            return {"error": f"never trained:\n{job.tail()}"}
        t_clean = t_first + 2.0
        t_chaos = t_clean + args.clean_seconds
        t_end = t_chaos + args.chaos_seconds
        for offset, draw in zip(schedule, draws):
            while time.time() < t_chaos + offset:
                time.sleep(0.01)
            while time.time() < t_end:
                live = sorted(job.workers().items())
                if live:
                    pid, tag = live[int(draw * len(live))]
                    os.kill(pid, signal.SIGKILL)  # a child of this benchmark's launcher, or of this benchmark
                    kills.append({"time": time.time(), "at_s": offset, "pid": pid, "worker": tag, "live": len(live)})
                    break
                time.sleep(0.02)
        while time.time() < t_end:
            time.sleep(0.05)
        write_stop(out, top_step(out) + 10)
        if isinstance(job, Job):
            code = job.wait(on_false="rescue")
        else:
            code = 0 if job.wait() else None
    finally:
        job.end()
    final: dict[int, tuple[float, int]] = {}
    for rows in steps_by_worker(out).values():
        for t, s, world in rows:
            if s not in final or t > final[s][0]:
                final[s] = (t, world)

    def progress(until: float) -> int:
        return sum(t <= until for t, _ in final.values())

    c0, c1, c2 = progress(t_clean), progress(t_chaos), progress(t_end)
    clean, chaos = (c1 - c0) / args.clean_seconds, (c2 - c1) / args.chaos_seconds
    result = {
        "exit_code": code,
        "clean_steps_per_s": clean,
        "chaos_steps_per_s": chaos,
        "same_job": chaos / clean if clean else float("nan"),
        "kills": kills,
        "final_step": max(final, default=0),
    }
    if kind == "torchft":
        result["respawns"] = len(job.respawns)
    if code != 0:
        result["error"] = f"exit code {code}:\n{job.tail()}"
    return result


# ---- the mode --------------------------------------------------------------------------------
def run(args: argparse.Namespace, root: Path) -> dict:
    """Every part of the side by side; the caller writes the JSON."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"--against torchft needs torchft ({exc}): pip install --no-deps torchft==0.2.0, and its small "
            "pure-Python imports (see benchmarks/torchft_worker.py), never a plain install (it pulls another torch)"
        ) from exc
    heartbeats = [int(h) for h in str(args.torchft_heartbeat_ms).split(",") if h]
    wrappers = [w for w in args.torchft_wrappers.split(",") if w]
    contenders = ["unison"] + [f"torchft-{w}-hb{h}" for w in wrappers for h in heartbeats]
    kills: dict[str, list[dict]] = {c: [] for c in contenders}
    ddp: list[dict] = []
    for r in range(args.repeats):
        order = ["ddp", *contenders]
        order = order[r % len(order) :] + order[: r % len(order)]
        for c in order:
            if c == "ddp":
                ddp.append(ddp_run(fresh(root, f"vs-ddp-{r}"), args.at + 40))
                print(f"  ddp {r}: {1000 * ddp[-1]['step_s']:.1f} ms a step", flush=True)
            else:
                kills[c].append(kill_run(c, r, args, root))
    ddp_step = med([d["step_s"] for d in ddp])
    result: dict[str, Any] = {
        "workers": 3,
        "ddp": {"step_ms": 1000 * ddp_step, "runs": ddp},
        "kill": {c: summarize_kills(rows, ddp_step) for c, rows in kills.items()},
    }
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
        measured = {}
        chaos = ["unison"] + [f"torchft-{w}-hb{heartbeats[0]}" for w in wrappers if w != "ddp"]
        for c in chaos if r % 2 == 0 else chaos[::-1]:
            m = chaos_run(c, fresh(root, f"vs-goodput-{c}-{r}"), args, schedule, draws)
            if "chaos_steps_per_s" in m:
                m["goodput"] = m["chaos_steps_per_s"] * ddp_step
            measured[c] = m
            print(f"  goodput {c} {r}: {m.get('goodput', m.get('error', '?'))}", flush=True)
        rounds.append({"schedule_s": schedule, **measured})
    result["goodput"] = {
        "rounds": rounds,
        **{
            c: {
                "goodput_median": med([r[c]["goodput"] for r in rounds if "goodput" in r[c]]),
                "same_job_median": med([r[c]["same_job"] for r in rounds if "same_job" in r[c]]),
            }
            for c in (rounds[0] if rounds else {})
            if c != "schedule_s"
        },
    }
    result["table"] = table(result, contenders)
    return result


def table(result: dict, contenders: list[str]) -> list[str]:
    k, g = result["kill"], result["goodput"]
    lines = [f"{'3 workers, one SIGKILL mid-step, a replacement started':58}" + "".join(f"{c:>16}" for c in contenders)]

    def row(name: str, fmt: str, values: list[Any]) -> None:
        lines.append(f"{name:58}" + "".join(f"{format(v, fmt) if v == v else '-':>16}" for v in values))

    row(
        f"fault-free step time vs torch DDP ({result['ddp']['step_ms']:.1f} ms)",
        ".2f",
        [k[c]["vs_ddp"] for c in contenders],
    )
    row("kill to the survivors' next step - 1 step, median (s)", ".3f", [k[c]["stall_median_s"] for c in contenders])
    row("  the same, raw (s)", ".3f", [k[c]["stall_raw_median_s"] for c in contenders])
    row(
        "replacement start to its first step, median (s)",
        ".2f",
        [k[c]["start_to_first_step_median_s"] for c in contenders],
    )
    row("  of which imports (s)", ".2f", [k[c]["imports_median_s"] for c in contenders])
    row(
        "kill to the replacement's first step, median (s)",
        ".2f",
        [k[c]["kill_to_replacement_step_median_s"] for c in contenders],
    )
    row(
        "members' pause when the replacement joins - 1 step (s)",
        ".3f",
        [k[c]["join_pause_median_s"] for c in contenders],
    )
    row("ledger exact (runs)", "", [f"{k[c]['ledger_exact_runs']}/{k[c]['valid']}" for c in contenders])
    row("steps redone / skipped", "", [f"{k[c]['steps_redone']}/{k[c]['steps_skipped']}" for c in contenders])
    row("steps refused and recomputed after the kill", "d", [k[c]["steps_refused_after_kill"] for c in contenders])
    if g["rounds"]:
        nan = {"goodput_median": float("nan"), "same_job_median": float("nan")}
        row(
            "goodput under chaos (steps/s over DDP's fault-free)",
            ".2f",
            [g.get(c, nan)["goodput_median"] for c in contenders],
        )
        row("  chaos over its own fault-free window", ".2f", [g.get(c, nan)["same_job_median"] for c in contenders])
    row(
        "survivors crashed (torchft), all runs",
        "",
        [str(sum(r.get("survivors_crashed", 0) for r in k[c]["repeats"])) for c in contenders],
    )
    return lines
