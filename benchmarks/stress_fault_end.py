"""The end of a fault-tolerant job, run again and again: no hang, no abort, exact ledgers.

Two cases, each ``--runs`` times in a row, under ``unison launch --fault-tolerant --preload``
(workers forked from a template: a replacement is admitted within a fraction of a second):

* ``kill``: 3 workers, ``--respawn``; worker 1 SIGKILLs itself two steps before the end of 40
  (``--kill 1@38``, as test_fault_tolerance.py's test does). Its replacement, forked within
  0.3 s, is admitted after the end (it finds the job over), or just as the others take their
  last steps: the race where a member finishes while the others gather in a membership that
  counts it (``raced``).
* ``leave``: 3 workers under powersgd; worker 1 leaves after step 4 of 8 (``--leave 1@4``):
  the survivors' membership is published as they finish, while their watcher threads wait.

A run passes when the launcher exits 0 within ``--timeout`` seconds, the survivors' ledgers
are exact (tests/scripts/ft_ledger.py: every step applied once), and no process printed
"terminate called" (a thread torn down inside torch's C++ code at the interpreter's end).
``raced`` counts the runs where the coordinator saw the race (a member finished before the
membership the others gathered in was built). Run from another checkout's folder with
``PYTHONPATH`` set to it, the same runs measure that tree (the launcher, its template and the
workers import it; the report names the unison it imported and its commit).
The launcher is stopped with SIGTERM past its time (it stops its workers), then SIGKILL.

    python benchmarks/stress_fault_end.py --runs 20 --json benchmarks/results/stress_fault_end.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import run_capped, write_report

HERE = Path(__file__).resolve().parent
LEDGER = HERE.parent / "tests" / "scripts" / "ft_ledger.py"
PRELOAD = ("--preload", "torch,torch._dynamo,unison")

#: Each case: the launcher's options, the ledger's, and each survivor's expected weights.
CASES: dict[str, dict[str, Any]] = {
    "kill": {"launcher": ("--respawn",), "ledger": ("--steps", "40", "--kill", "1@38"), "expected": [-1.0] * 40},
    "leave": {
        "launcher": (),
        "ledger": (
            *("--steps", "8", "--algorithm", "powersgd:rank=1,start_iter=2", "--square"),
            *("--matrices", "8", "--sleep", "0", "--leave", "1@4"),
        ),
        "expected": [-(1 + 4 + 9) / 3] * 5 + [-(1 + 9) / 2] * 3,
    },
}


def run_once(case: str, timeout: float) -> dict[str, Any]:
    """One job of ``case``: its exit code, seconds, survivors and what was wrong (empty: nothing)."""
    spec = CASES[case]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "3", *PRELOAD]
        cmd += [*spec["launcher"], str(LEDGER), "--out", str(out), *spec["ledger"]]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        code, _, err, hung = run_capped(cmd, timeout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        seconds = time.monotonic() - started
        found = {}
        for path in out.glob("[0-9]*.json"):
            data = json.loads(path.read_text())
            found[data["id"]] = data
    problems = []
    if hung:
        problems.append(f"hung: the launcher had not ended after {timeout:.0f} s")
    elif code != 0:
        problems.append(f"the launcher exited with {code}")
    if "terminate called" in err:
        problems.append("a process aborted: 'terminate called' in the output")
    if not {0, 2} <= set(found):
        problems.append(f"survivors 0 and 2 expected, results from {sorted(found)}")
    for wid in (0, 2):
        w = found.get(wid, {}).get("w")
        if w is not None and any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(w, spec["expected"])):
            problems.append(f"worker {wid}'s ledger is not exact: {w}")
    tail = err.strip().splitlines()[-25:] if problems else []
    # The race itself: a member finished before the membership the others gathered in was built.
    raced = "finished before membership" in err
    return {
        "case": case,
        "exit": code,
        "seconds": round(seconds, 2),
        "raced": raced,
        "problems": problems,
        "tail": tail,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs of each case, in a row")
    p.add_argument("--cases", default="kill,leave", help="which cases, comma-separated: kill, leave")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--json", default=None, help="write the runs and the counts here")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}: choose from {sorted(CASES)}")
    began = time.time()
    runs, counts = [], {}
    for case in cases:
        passed = 0
        for i in range(args.runs):
            result = run_once(case, args.timeout)
            runs.append(result)
            passed += not result["problems"]
            status = "ok" if not result["problems"] else "FAILED: " + "; ".join(result["problems"])
            status += " (a member finished as the others regrouped)" if result["raced"] else ""
            print(f"{case} {i + 1}/{args.runs}: {result['seconds']:.1f} s, {status}", flush=True)
            for line in result["tail"]:
                print(f"  | {line}", flush=True)
        raced = sum(r["raced"] for r in runs if r["case"] == case)
        counts[case] = {"runs": args.runs, "passed": passed, "raced": raced}
    write_report("stress_fault_end.py", argv, began, {"counts": counts, "runs": runs}, args.json)
    return 0 if all(c["passed"] == c["runs"] for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
