"""End-to-end checks of ``unison train``: a short real run through the elastic launcher, and argument errors."""

import json
import subprocess
import sys

from unison import algorithms


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``python -m unison ARGS`` in a fresh interpreter, as a user would."""
    return subprocess.run([sys.executable, "-m", "unison", *args], capture_output=True, text=True, timeout=timeout)


def test_train_three_epochs_writes_summary(tmp_path):
    """Three epochs on 2 processes learn the digits well and report the communication."""
    out = tmp_path / "s.json"
    proc = run_cli("train", "--epochs", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.exists()
    summary = json.loads(out.read_text())
    assert summary["test_accuracy"] > 0.90
    assert summary["world_size"] == 2
    assert summary["epochs"] == 3
    assert summary["algorithm"] == "allreduce"
    assert summary["bytes_per_step"] > 0
    assert summary["samples_per_s"] > 0 and summary["wall_time_s"] > 0
    assert "test accuracy" in proc.stdout


def test_unknown_algorithm_is_refused_naming_the_allowed_ones():
    """argparse stops a bad --algorithm before any process starts, listing the choices."""
    proc = run_cli("train", "--algorithm", "no-such-algorithm", timeout=60)
    assert proc.returncode != 0
    assert "no-such-algorithm" in proc.stderr
    for name in algorithms.names():
        assert name in proc.stderr
