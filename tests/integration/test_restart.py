"""Elastic restarts with real kills: a worker dies mid-epoch, the group restarts from the
last checkpoint and finishes exactly as an uninterrupted run does."""

import json
import os
import subprocess
import sys

import launch
import pytest
import torch

from unison.apps import cli

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "resume_train.py")
TRAIN = ["train", "--epochs", "3", "--checkpoint-every", "10"]  # 23 steps per epoch


def unison_cli(*args: str, env: dict = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "unison", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def weights(path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def test_train_killed_mid_epoch_restarts_and_ends_exactly_as_uninterrupted(tmp_path):
    """SIGKILL rank 1 after step 25 (epoch 2): the group restarts from step 20's checkpoint;
    the final weights, loss and accuracy are those of the run that was never killed."""
    straight = unison_cli(*TRAIN, "--checkpoint-dir", str(tmp_path / "a"), "--json", str(tmp_path / "a.json"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = unison_cli(
        *TRAIN,
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--max-restarts",
        "1",
        "--json",
        str(tmp_path / "b.json"),
        env={"UNISON_TEST_KILL": "1:25"},
    )
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "SIGKILL" in killed.stderr  # the kill was real, and the launcher saw it
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert (a["resumed_from_step"], a["restarts"]) == (None, 0)
    assert (b["resumed_from_step"], b["restarts"]) == (20, 1)
    assert "resumed from step" in killed.stdout
    assert a["steps"] == b["steps"] == 69
    assert b["test_accuracy"] == a["test_accuracy"] > 0.9
    assert b["final_loss"] == a["final_loss"]
    wa, wb = weights(tmp_path / "a" / "checkpoint.pt"), weights(tmp_path / "b" / "checkpoint.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_train_without_restarts_fails_clearly_and_resumes_when_run_again(tmp_path):
    """With no restarts left the kill ends the run with an error naming the rank; running the
    same command again resumes from the checkpoint (a model-averaging algorithm, per-epoch checkpoints)."""
    args = [
        "train",
        "--epochs",
        "2",
        "--algorithm",
        "local_sgd",
        "--checkpoint-dir",
        str(tmp_path),
        "--json",
        str(tmp_path / "s.json"),
    ]
    failed = unison_cli(*args, env={"UNISON_TEST_KILL": "1:30"})
    assert failed.returncode == 1
    assert "a worker process failed" in failed.stderr and "SIGKILL" in failed.stderr
    assert "unison train: rank " in failed.stderr  # the closing line names the first failed rank
    again = unison_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["resumed_from_step"] == 23  # the end of epoch 1's checkpoint
    assert summary["steps"] == 46 and summary["test_accuracy"] > 0.9
    done = unison_cli(*args)  # a finished run's checkpoint: nothing left to train, the same figures
    assert done.returncode == 0, done.stderr[-3000:]
    rerun = json.loads((tmp_path / "s.json").read_text())
    assert rerun["resumed_from_step"] == rerun["steps"] == 46
    assert (rerun["test_accuracy"], rerun["final_loss"]) == (summary["test_accuracy"], summary["final_loss"])
    changed = unison_cli(
        "train", "--epochs", "2", "--algorithm", "local_sgd", "--batch-size", "16", "--checkpoint-dir", str(tmp_path)
    )
    assert changed.returncode == 1 and "batch_size=32, but this one has batch_size=16" in changed.stderr


def test_checkpoint_options_are_checked_before_any_process_starts(tmp_path, capsys):
    proc = unison_cli("train", "--checkpoint-every", "5", timeout=60)
    assert proc.returncode == 2 and "--checkpoint-every needs --checkpoint-dir" in proc.stderr
    # The same command line in this process (a fresh interpreter each costs seconds):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--max-restarts", "-1"])
    assert exit_.value.code == 2 and "must be at least 0" in capsys.readouterr().err


def straight_script_run(ckpt: str, out: str) -> None:
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import resume_train

    resume_train.main(ckpt, out)


def test_torchrun_restarts_a_script_from_its_checkpoint(tmp_path):
    """torchrun --max-restarts 1 over the README's pattern: rank 1 calls os._exit(1) after step 13,
    torchrun restarts both, they resume from step 10 and end where an unkilled run ends."""
    args = [SCRIPT, str(tmp_path / "ckpt.pt"), str(tmp_path / "killed.pt"), "13"]
    proc = launch.torchrun("--max-restarts", "1", *args, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exitcode: 1" in proc.stderr  # the worker really left, and torchrun restarted the group
    killed = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert killed["resumed_from"] == 10 and killed["steps"] == 32

    launch.run(straight_script_run, 2, str(tmp_path / "fresh.pt"), str(tmp_path / "straight.pt"), timeout=120)
    straight = torch.load(tmp_path / "straight.pt", weights_only=True)
    assert straight["resumed_from"] is None
    assert all(torch.equal(a, b) for a, b in zip(straight["params"], killed["params"]))
