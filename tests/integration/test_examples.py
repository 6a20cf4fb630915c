"""The README's example runs as written under torchrun, and alone."""

import os
import subprocess
import sys

import torch

from tests import launch

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.py")


def test_quickstart_under_torchrun(tmp_path):
    proc = launch.torchrun(EXAMPLE, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch") == 3  # rank 0 only
    state = torch.load(tmp_path / "quickstart.pt")
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_quickstart_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, EXAMPLE], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch") == 3
