"""Every code block of README.md and docs/*.md runs, unless marked as an excerpt
(tests/docs_blocks.py has the convention; CONTRIBUTING.md explains it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import docs_blocks, launch
from tests.integration import test_examples

BLOCKS = docs_blocks.all_blocks()
RUN = [b for b in BLOCKS if b.how not in ("excerpt", "example")]


def test_every_block_is_run_or_marked():
    unrunnable = [f"{b.id} ({b.lang or 'no language'})" for b in BLOCKS if b.how == "unrunnable"]
    assert not unrunnable, "mark these <!-- excerpt --> or make them run: " + ", ".join(unrunnable)


def test_included_examples_are_run():
    for b in BLOCKS:
        if b.how == "example":
            name = os.path.basename(b.include)
            assert os.path.exists(os.path.join(docs_blocks.ROOT, b.include)), b.id
            assert name in test_examples.RUNS, f"{b.id}: {b.include} is not run by test_examples.py"


def test_some_blocks_run():
    # The README's quickstart at least; a parser that found nothing would pass everything.
    assert any(b.path == "README.md" and b.how == "torchrun" for b in RUN)
    assert len(RUN) >= 10, [b.id for b in RUN]


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    script = tmp_path / ("block.sh" if block.how == "bash" else "block.py")
    script.write_text(block.code)
    if block.how == "torchrun":
        proc = launch.torchrun(str(script), cwd=tmp_path, timeout=120)
    elif block.how == "unison launch":
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "2", str(script)]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    elif block.how == "bash":
        proc = subprocess.run(
            ["bash", "-e", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
        )
    else:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env
        )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
