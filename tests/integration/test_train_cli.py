"""End-to-end checks of ``unison train``: a short real run through the elastic launcher, and argument errors."""

import json
import subprocess
import sys

import pytest
import torch

import unison
from unison import algorithms
from unison.apps import cli, train


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


def test_algorithm_takes_options_as_bench_does(tmp_path):
    """``--algorithm powersgd:rank=2,start_iter=2`` (bench's syntax) runs with those options: compressed from
    the third step at rank 2, it sends far less than the full gradients (104,488 bytes a step) and less than
    rank 4 would (about 18,600 a step averaged over this epoch of 23 steps)."""
    out = tmp_path / "s.json"
    proc = run_cli("train", "--algorithm", "powersgd:rank=2,start_iter=2", "--epochs", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["algorithm"] == "powersgd:rank=2,start_iter=2"
    assert summary["steps"] == 23
    assert 10_000 < summary["bytes_per_step"] < 16_000


@pytest.mark.parametrize(
    "spec, words",
    [
        ("powersgd:rank=0", "rank must be a positive integer"),
        ("powersgd:bogus=1", "has no option 'bogus'"),
        ("powersgd:rank", "write name:key=value"),
        ("nccl_magic:rank=2", "unknown algorithm 'nccl_magic'"),
    ],
)
def test_a_bad_algorithm_spec_is_refused_before_anything_starts(capsys, spec, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--algorithm", spec])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --algorithm" in err and words in err
    for name in algorithms.names():
        assert name in err


def test_qadam_with_the_option_syntax_gets_its_own_optimizer():
    params = torch.nn.Linear(2, 2).parameters()
    assert isinstance(train.build_optimizer(train.TrainConfig(algorithm="qadam:"), params), unison.QAdamOptimizer)


@pytest.mark.parametrize("module, package", [("rich", "rich"), ("sklearn", "scikit-learn")])
def test_train_without_the_demo_extra_says_what_to_install(module, package):
    """The core install has torch alone: ``unison train`` names what is missing before any process starts."""
    code = f"import sys; sys.modules[{module!r}] = None; from unison.apps import cli; sys.exit(cli.main(['train']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"unison train: {package} is not installed" in proc.stderr and 'pip install "unison[demo]"' in proc.stderr
