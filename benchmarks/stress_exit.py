"""The end of a plain job, run again and again: every job under torchrun exits 0 and no process aborts.

A scheduler (SLURM, Kubernetes, a CI) judges a job by its exit status, so a correct job that
aborts at its end ("terminate called without an active exception": a thread torn down inside
torch's C++ code at the interpreter's end) looks failed. This runs the examples a new user runs
first, ``examples/quickstart.py`` and ``examples/model_averaging.py``, each under
``torchrun --standalone --nproc-per-node 2``, ``--parallel`` jobs at a time (a busy machine makes
the race at the end likelier), ``--jobs`` in all, alternating the two scripts, each job in a
fresh folder, capped at ``--timeout`` seconds (then SIGTERM, then SIGKILL, to its launcher
only). A job passes when torchrun exits 0 and no output of it holds "terminate called".

Run from another checkout's folder with ``PYTHONPATH`` set to it, the same jobs measure that
tree (the report names the unison the jobs imported and its commit).

    python benchmarks/stress_exit.py --jobs 300 --json benchmarks/results/stress_exit.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import run_capped, write_report

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
SCRIPTS = {"quickstart": ["quickstart.py"], "model_averaging": ["model_averaging.py", "--epochs", "1"]}


def run_job(script: str, timeout: float) -> dict[str, Any]:
    """One torchrun job of ``script``: its exit code, seconds and what was wrong (empty: nothing)."""
    name, *args = SCRIPTS[script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(EXAMPLES / name), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        code, out, _, hung = run_capped(
            cmd, timeout, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
        )
        seconds = time.monotonic() - started
    problems = []
    if hung:
        problems.append(f"hung: torchrun had not ended after {timeout:.0f} s")
    elif code != 0:
        problems.append(f"torchrun exited with {code}")
    if "terminate called" in out:
        problems.append("a process aborted: 'terminate called' in the output")
    tail = out.strip().splitlines()[-15:] if problems else []
    return {"script": script, "exit": code, "seconds": round(seconds, 2), "problems": problems, "tail": tail}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=300, help="jobs in all, the scripts alternating")
    p.add_argument("--parallel", type=int, default=3, help="jobs at a time")
    p.add_argument("--scripts", default="quickstart,model_averaging", help="comma-separated: " + ", ".join(SCRIPTS))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a job may take before it counts as a hang")
    p.add_argument("--json", default=None, help="write the jobs and the counts here")
    args = p.parse_args(argv)
    scripts = [s for s in args.scripts.split(",") if s]
    unknown = [s for s in scripts if s not in SCRIPTS]
    if unknown:
        p.error(f"unknown script(s) {unknown}: choose from {sorted(SCRIPTS)}")
    began = time.time()
    order = [scripts[i % len(scripts)] for i in range(args.jobs)]
    jobs: list[dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for i, result in enumerate(pool.map(lambda s: run_job(s, args.timeout), order)):
            jobs.append(result)
            status = "ok" if not result["problems"] else "FAILED: " + "; ".join(result["problems"])
            print(f"{i + 1}/{args.jobs} {result['script']}: {result['seconds']:.1f} s, {status}", flush=True)
            for line in result["tail"]:
                print(f"  | {line}", flush=True)
    counts = {
        s: {
            "jobs": sum(j["script"] == s for j in jobs),
            "failed": sum(j["script"] == s and bool(j["problems"]) for j in jobs),
            "aborted": sum(j["script"] == s and any("terminate called" in q for q in j["problems"]) for j in jobs),
        }
        for s in scripts
    }
    write_report("stress_exit.py", argv, began, {"counts": counts, "jobs": jobs}, args.json)
    return 0 if all(c["failed"] == 0 for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
