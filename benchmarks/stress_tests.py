"""Tests run again and again under a busy CPU: a test that fails one time in twenty shows here.

Each pytest node id given runs ``--runs`` times in a row, each run its own ``pytest`` process capped
at ``--timeout`` seconds (then SIGTERM, then SIGKILL, to that process only), while ``--load``
busy-loop processes (default: one per core) keep every core busy, as a loaded CI machine does. The
busy loops are this script's own children, stopped by pid at the end. A test passes a run when its
pytest exits 0; the report counts each test's passes and keeps the tail of every failure.

    python benchmarks/stress_tests.py --runs 30 --json benchmarks/results/stress_tests.json \\
        tests/integration/test_fault_liveness.py tests/integration/test_exit.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from typing import Any

from common import run_capped, write_report


def spin() -> None:
    """Keep one core busy until stopped."""
    while True:
        pass


def run_test(node: str, timeout: float) -> dict[str, Any]:
    """One pytest run of ``node``: its exit code, seconds and output tail on a failure."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", node]
    started = time.monotonic()
    code, out, _, hung = run_capped(cmd, timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = round(time.monotonic() - started, 1)
    problem = f"hung past {timeout:.0f} s" if hung else (f"pytest exited with {code}" if code != 0 else "")
    return {
        "test": node,
        "exit": code,
        "seconds": seconds,
        "problem": problem,
        "tail": out.splitlines()[-25:] if problem else [],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="+", help="pytest node ids (a file runs all its tests in one run)")
    p.add_argument("--runs", type=int, default=30, help="runs of each test, in a row")
    p.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy-loop processes meanwhile")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it counts as a hang")
    p.add_argument("--json", default=None, help="write the runs and the counts here")
    args = p.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        p.error("--runs must be at least 1 and --load at least 0")
    began = time.time()
    hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    runs: list[dict[str, Any]] = []
    try:
        for node in args.tests:
            for i in range(args.runs):
                result = run_test(node, args.timeout)
                runs.append(result)
                print(f"{node} {i + 1}/{args.runs}: {result['seconds']} s, {result['problem'] or 'passed'}", flush=True)
                for line in result["tail"]:
                    print(f"  | {line}", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join(5)
    counts = {
        node: {
            "runs": sum(r["test"] == node for r in runs),
            "failed": sum(r["test"] == node and bool(r["problem"]) for r in runs),
        }
        for node in args.tests
    }
    found = {"load": args.load, "counts": counts, "runs": runs}
    write_report("stress_tests.py", argv, began, found, args.json)
    return 0 if all(c["failed"] == 0 for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
