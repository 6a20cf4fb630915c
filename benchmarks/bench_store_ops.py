"""Store operations per second of an idle fault-tolerant job (issue 29: a protocol that waits).

Runs ``unison launch --fault-tolerant --nproc N`` over a script that joins (``unison.init()``)
and then only sleeps: what remains is the protocol's own traffic (heartbeats, watching the
membership, the coordinator's looks at its workers). Every process (the launcher and each
worker) counts the calls it makes on its TCPStore clients: a ``sitecustomize`` put first on
PYTHONPATH replaces ``torch.distributed.TCPStore`` with a subclass that counts each method
call (set, get, add, check, wait, multi_get, ...; a blocking ``wait`` is one) and writes its
counts every 0.25 s. The figure is the growth of the sum over a window after every worker joined.

    python benchmarks/bench_store_ops.py                       # this checkout ("after")
    # "before": the protocol that polled every 20 ms (commit aa2bc60's unison)
    git worktree add /tmp/before aa2bc60 && python benchmarks/bench_store_ops.py --repo /tmp/before --label before

Writes benchmarks/results/store_ops.json (merging the runs under their labels).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT = HERE / "results" / "store_ops.json"

SITECUSTOMIZE = textwrap.dedent(
    """
    import json, os, threading, time
    OUT = os.environ["UNISON_COUNT_STORE_OPS"]
    import torch.distributed as dist

    _counts = {}
    _lock = threading.Lock()
    METHODS = ("set", "get", "add", "check", "wait", "multi_get", "multi_set", "delete_key", "compare_set",
               "num_keys", "append")

    def _counted(name):
        base = getattr(dist.TCPStore, name)
        def call(self, *args, **kwargs):
            with _lock:
                _counts[name] = _counts.get(name, 0) + 1
            return base(self, *args, **kwargs)
        return call

    CountedTCPStore = type("TCPStore", (dist.TCPStore,), {m: _counted(m) for m in METHODS if hasattr(dist.TCPStore, m)})
    dist.TCPStore = CountedTCPStore

    def _write():
        path = os.path.join(OUT, f"ops-{os.getpid()}.json")
        while True:
            with _lock:
                doc = {"time": time.time(), "counts": dict(_counts)}
            with open(path + ".tmp", "w") as f:
                json.dump(doc, f)
            os.replace(path + ".tmp", path)
            time.sleep(0.25)

    threading.Thread(target=_write, daemon=True).start()
    """
)

IDLE = textwrap.dedent(
    """
    import os, sys, time
    import unison
    out, seconds = sys.argv[1], float(sys.argv[2])
    unison.init()
    open(os.path.join(out, f"joined-{os.getpid()}"), "w").close()
    time.sleep(seconds)
    """
)


def totals(out: str) -> tuple[float, dict[str, int]]:
    """The summed counts of every process now, by method."""
    summed: dict[str, int] = {}
    for path in glob.glob(os.path.join(out, "ops-*.json")):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        for name, n in doc["counts"].items():
            summed[name] = summed.get(name, 0) + n
    return time.time(), summed


def measure(repo: Path, nproc: int, settle: float, window: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="unison-store-ops-") as tmp:
        site, out = os.path.join(tmp, "site"), os.path.join(tmp, "out")
        os.makedirs(site)
        os.makedirs(out)
        Path(site, "sitecustomize.py").write_text(SITECUSTOMIZE)
        script = Path(tmp, "idle.py")
        script.write_text(IDLE)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([site, str(repo)]), UNISON_COUNT_STORE_OPS=out, OMP_NUM_THREADS="1"
        )
        hold = settle + window + 60
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", str(nproc), "--no-status"]
        launcher = subprocess.Popen([*cmd, str(script), out, str(hold)], env=env, stderr=subprocess.DEVNULL, cwd=tmp)
        try:
            deadline = time.monotonic() + 120
            while len(glob.glob(os.path.join(out, "joined-*"))) < nproc:
                if time.monotonic() > deadline or launcher.poll() is not None:
                    raise RuntimeError("the workers did not all join")
                time.sleep(0.1)
            time.sleep(settle)
            t0, before = totals(out)
            time.sleep(window)
            t1, after = totals(out)
        finally:
            launcher.terminate()
            launcher.wait(30)
    per_s = {k: round((after.get(k, 0) - before.get(k, 0)) / (t1 - t0), 1) for k in after}
    return {
        "ops_per_s": round(sum(per_s.values()), 1),
        "by_method_per_s": {k: v for k, v in sorted(per_s.items()) if v},
        "window_s": round(t1 - t0, 2),
    }


def environment() -> dict:
    """Where and on what the figures were taken."""
    import platform

    import torch

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, timeout=30).stdout.strip()

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpus": os.cpu_count(),
        "load_at_start": list(os.getloadavg()),
        "git": {"commit": git("rev-parse", "HEAD"), "modified": git("status", "--porcelain", "--untracked-files=no")},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=ROOT, help="the tree whose unison runs (default: this checkout)")
    p.add_argument("--label", default="after", help="the name of this run in the JSON")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--settle", type=float, default=3.0, help="seconds after every worker joined before measuring")
    p.add_argument("--window", type=float, default=10.0, help="seconds measured")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    env = environment()
    runs = [measure(args.repo.resolve(), args.nproc, args.settle, args.window) for _ in range(args.repeats)]
    figures = sorted(r["ops_per_s"] for r in runs)
    run = {
        "command": " ".join(["python", "benchmarks/bench_store_ops.py", *sys.argv[1:]]),
        "repo": str(args.repo),
        "nproc": args.nproc,
        "median_ops_per_s": figures[len(figures) // 2],
        "runs": runs,
        **env,
    }
    doc = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    doc[args.label] = run
    RESULT.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({args.label: {"median_ops_per_s": run["median_ops_per_s"], "runs": figures}}))


if __name__ == "__main__":
    main()
