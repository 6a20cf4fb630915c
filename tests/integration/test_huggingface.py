"""Hugging Face: ``UnisonTrainer`` and ``UnisonAccelerator`` with real transformers and accelerate,
2 processes under torchrun over gloo, a GPT-2 built from a small config (tests/scripts/hf_run.py:
one launch runs every contender; each rank writes what it ended with)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_run.py"
RUNS = [
    "refusals",
    "trainer-ddp",
    "trainer=diloco:period=4",
    "trainer=sparseloco:period=4",
    "accelerate=diloco:period=4",
]


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("hf")
    done = torchrun(str(SCRIPT), *RUNS, "--out", str(where), cwd=where, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    return where


def result(out: Path, name: str, rank: int) -> dict:
    return torch.load(out / f"{name}-rank{rank}.pt")


@pytest.mark.parametrize("precision", ["", "-bf16"])
def test_the_trainer_with_allreduce_ends_with_the_trainer_s_own_ddp_weights(out, precision):
    """20 steps, gradient accumulation 2, the same seed and data; in fp32 and under bf16 autocast."""
    for rank in (0, 1):
        ours, ddp = result(out, f"allreduce{precision}", rank), result(out, f"ddp{precision}", rank)
        assert ours["wrapped"] == "DataParallel" and ddp["wrapped"] == "DistributedDataParallel"
        torch.testing.assert_close(ours["weights"], ddp["weights"], rtol=0, atol=1e-6)
        assert ours["losses"] == pytest.approx(ddp["losses"], abs=1e-6)


def test_the_trainer_logs_what_unison_sent_beside_the_loss(out):
    logged = result(out, "allreduce", 0)["sent"]
    assert len(logged) == 4 and all(sent > 0 for sent in logged)  # a logging step every 5 steps
    assert len(set(logged)) == 1  # per logging step, not a running total (the same 5 steps each time)


@pytest.mark.parametrize("name", ["allreduce", "diloco", "sparseloco"])
def test_a_run_resumed_from_its_checkpoint_ends_with_the_unbroken_run_s_weights(out, name):
    """The checkpoint at step 10 is mid-period (period 4) for DiLoCo and SparseLoCo: each rank's
    drifted replica, optimizer state, outer momentum and error feedback must come back."""
    for rank in (0, 1):
        whole, resumed = result(out, name, rank), result(out, f"{name}-resumed", rank)
        assert torch.equal(whole["weights"], resumed["weights"])
        assert resumed["losses"] == whole["losses"]


@pytest.mark.parametrize("name", ["diloco", "sparseloco"])
def test_the_trainer_with_a_frontier_algorithm_trains_and_evaluates(out, name):
    for rank in (0, 1):
        run = result(out, name, rank)
        assert run["wrapped"] == "DataParallel"
        assert run["losses"][-1] < run["losses"][0] - 0.2, run["losses"]
        assert len(run["eval_losses"]) == 2  # at step 10 and at step 20
    # Averaged when training ends: every rank holds the same model.
    assert torch.equal(result(out, name, 0)["weights"], result(out, name, 1)["weights"])


def test_an_accelerate_loop_with_prepare_equals_the_loop_on_dataparallel_and_resumes_exactly(out):
    for rank in (0, 1):
        prepared = result(out, "accelerate", rank)
        assert prepared["wrapped"] == "DataParallel"
        torch.testing.assert_close(prepared["weights"], result(out, "direct", rank)["weights"], rtol=0, atol=0)
        assert torch.equal(prepared["weights"], result(out, "accelerate-resumed", rank)["weights"])


def test_what_cannot_work_is_refused_at_construction_with_the_reason(out):
    found = json.loads((out / "refusals.json").read_text())
    assert found["unknown algorithm"][0] == "ValueError" and "available: allreduce" in found["unknown algorithm"][1]
    assert "may not set optimizer" in found["the accelerator's own argument"][1]
    for case in ("an FSDP plugin", "the Trainer's fsdp"):
        kind, message = found[case]
        assert kind == "ValueError" and message.startswith("unison cannot train under FSDP"), message
    assert "prepare it in the same call as the model" in found["no optimizer in prepare"][1]


def test_importing_unison_imports_neither_transformers_nor_accelerate():
    code = (
        "import sys, unison, unison.integrations.huggingface as hf; "
        "print(any(m in sys.modules for m in ('transformers', 'accelerate')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
