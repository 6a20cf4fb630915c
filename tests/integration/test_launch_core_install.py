"""`unison launch` on the core install (`pip install "torch==2.13.0" -e .`: torch alone, no rich):
the fault-tolerant job runs, and the coordinator's lines are plain log records, one per line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_ledger.py"


def without_rich(tmp_path: Path) -> dict[str, str]:
    """An environment where `import rich` fails in the launcher and in every worker it starts."""
    shim = tmp_path / "no-rich" / "rich"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("rich is not installed (the core install)")\n')
    path = os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def test_unison_launch_runs_without_rich_and_logs_plain_lines(tmp_path):
    env = without_rich(tmp_path)
    assert subprocess.run([sys.executable, "-c", "import rich"], env=env, capture_output=True).returncode != 0
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "3", str(SCRIPT)]
    cmd += ["--out", str(out), "--steps", "20", "--kill", "1@5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = {json.loads(p.read_text())["id"]: json.loads(p.read_text()) for p in out.glob("[0-9]*.json")}
    assert sorted(found) == [0, 2], done.stderr[-3000:]
    assert all(r["w"] == [-1.0] * 20 for r in found.values())  # every step applied once
    lines = done.stderr.splitlines()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "  # logs.PLAIN_FORMAT
    assert any(re.match(stamp + r"INFO unison\.launch: the job's store listens on [\d.]+:\d+$", x) for x in lines)
    assert any(re.match(stamp + r"INFO unison\.launch: regroup: epoch 1: members \[0, 1, 2\] \(", x) for x in lines)
    failure = stamp + r"WARNING unison\.launch: failure: worker 1 \(pid \d+\) exited with -9$"
    assert any(re.match(failure, x) for x in lines), done.stderr[-3000:]
    assert "ImportError" not in done.stderr and "rich" not in done.stderr
