"""UnisonStrategy under the real PyTorch Lightning: 2 CPU processes joined by gloo.

One run of tests/scripts/lightning_run.py, started as a user would start it
(``python script.py``: Lightning's own launcher starts rank 1), fits a small
LightningModule many times in one process group: against DDPStrategy, with
gradient accumulation, with every algorithm (checkpointing each epoch), resumed
from checkpoints, switching algorithm from a callback. A second run, launched
torchrun-style, loses a rank mid-training. The checks compare what each rank wrote.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

# Found, not imported: only the runs import it (importing it here cost each pytest worker seconds at collection).
if importlib.util.find_spec("lightning") is None:
    pytest.skip("the Lightning integration's tests need lightning (pip install -e '.[test]')", allow_module_level=True)

import unison  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "lightning_run.py")
# Deterministic algorithms resumed from a checkpoint by the script (all but async, whose rounds follow the clock);
# sparseloco and demo carry rank-local state (error feedback, momentum) through the checkpoint.
RESUMED = (
    "allreduce",
    "local_sgd",
    "diloco",
    "powersgd",
    "bytegrad",
    "daso",
    "decentralized",
    "nonblocking",
    "sparseloco",
    "demo",
)
# Launch variables a surrounding launcher may have set; the runs set their own.
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "UNISON_NODES",
)


def _env(**extra: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SLURM_"))
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [env.get("PYTHONPATH"), root])
    )  # unison from this checkout unless installed
    env.update(extra)
    return env


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Every rank's results of the main run (2 simulated nodes of 1 process, so DASO syncs across nodes).
    It runs once: if it fails, every test using it fails at once with its output."""
    if "runs" not in _MAIN:
        _MAIN["runs"] = _main_run(tmp_path_factory.mktemp("lightning"))
    outcome = _MAIN["runs"]
    if isinstance(outcome, str):
        pytest.fail(outcome, pytrace=False)
    return outcome


_MAIN: dict = {}


def _main_run(outdir) -> "list[dict] | str":
    try:
        proc = subprocess.run(
            [sys.executable, SCRIPT, str(outdir), "main"],
            env=_env(UNISON_NODES="2"),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired as exc:
        return f"the Lightning run did not finish within {exc.timeout} s (hang):\n{exc.stderr!r}"[-6000:]
    if proc.returncode != 0:
        return f"the Lightning run failed (exit code {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    missing = [r for r in range(2) if not (outdir / f"main-{r}.pt").exists()]
    if missing:
        return f"rank(s) {missing} wrote no result:\n{proc.stderr[-6000:]}"
    return [torch.load(outdir / f"main-{r}.pt", weights_only=False) for r in range(2)]


def test_allreduce_matches_ddp_strategy(runs):
    for rank, r in enumerate(runs):
        gap = _diff(r["parity"]["weights"], r["ddp"]["weights"])
        assert gap <= 1e-6, f"rank {rank}: UnisonStrategy('allreduce') differs from DDPStrategy by {gap:.3g}"
    assert torch.equal(runs[0]["parity"]["weights"], runs[1]["parity"]["weights"])


def test_gradient_accumulation_matches_ddp_strategy(runs):
    for rank, r in enumerate(runs):
        gap = _diff(r["allreduce_accumulate"]["weights"], r["ddp_accumulate"]["weights"])
        assert gap <= 1e-6, (
            f"rank {rank}: with accumulate_grad_batches=3, UnisonStrategy differs from DDPStrategy by {gap:.3g}"
        )
    assert (
        _diff(runs[0]["allreduce_accumulate"]["weights"], runs[0]["parity"]["weights"]) > 1e-3
    )  # accumulation took effect
    # Backward passes inside an accumulation ran under no_sync: 9 synchronized passes instead of 24.
    sent, plain = runs[0]["allreduce_accumulate"]["bytes"], runs[0]["parity"]["bytes"]
    assert 0 < sent < 0.5 * plain, f"with accumulate_grad_batches=3 the wrapper sent {sent} bytes, without {plain}"
    assert torch.equal(runs[0]["allreduce_accumulate"]["weights"], runs[1]["allreduce_accumulate"]["weights"])


def test_manual_optimization_trains_as_automatic(runs):
    for r in runs:  # manual_backward averages the gradients, optimizer.step() fires the algorithm
        assert torch.equal(r["manual"]["weights"], r["parity"]["weights"])


def test_process_group_comes_from_unison_init_with_the_node_layout(runs):
    assert runs[0]["parity"]["nodes"] == 2  # UNISON_NODES=2 reached unison.init() through the strategy


@pytest.mark.parametrize("name", unison.algorithms.names())
def test_every_algorithm_fits_and_ends_with_one_model(runs, name):
    a, b = runs[0][name], runs[1][name]
    assert torch.equal(a["weights"], b["weights"]), (
        f"{name}: replicas differ by {_diff(a['weights'], b['weights']):.3g} after fit"
    )
    # Validation saw one model on every rank (drifting replicas are averaged first).
    assert len(a["val_weights"]) == 3
    for epoch, (x, y) in enumerate(zip(a["val_weights"], b["val_weights"])):
        assert torch.equal(x, y), (
            f"{name}: validation after epoch {epoch} saw replicas that differ by {_diff(x, y):.3g}"
        )
    # model.end_epoch got the epoch's logged training loss.
    assert a["end_epoch"] == a["epoch_losses"] and len(a["end_epoch"]) == 3
    # Teardown closed the wrapper: no algorithm thread is left behind.
    assert a["threads"] == [] and b["threads"] == [], f"{name}: threads left after fit: {a['threads']} {b['threads']}"


def test_without_averaging_before_eval_each_rank_validates_its_replica(runs):
    a, b = runs[0]["local_sgd_local_eval"], runs[1]["local_sgd_local_eval"]
    assert all(_diff(x, y) > 1e-4 for x, y in zip(a["val_weights"], b["val_weights"]))  # they drifted (period=100)
    assert torch.equal(a["weights"], b["weights"])  # and fit still ends with the average


@pytest.mark.parametrize("name", RESUMED)
def test_checkpoint_resume_gives_the_uninterrupted_weights(runs, name):
    for rank, r in enumerate(runs):
        resumed, straight = r[f"{name}_resumed"]["weights"], r[name]["weights"]
        assert torch.equal(resumed, straight), (
            f"{name}, rank {rank}: resumed from epoch 0 differs from the uninterrupted run by {_diff(resumed, straight):.3g}"
        )


def test_checkpoint_publishes_the_averaged_model(runs):
    for r in runs:
        ckpt = r["local_sgd_checkpoint"]
        assert ckpt["unison_ranks"] == 2  # every rank's replica, optimizer and algorithm state travel along
        assert torch.equal(ckpt["state_dict"], r["local_sgd"]["weights"])  # the last checkpoint holds the final average
        assert torch.equal(ckpt["validated"], ckpt["state_dict"])  # Trainer.validate(ckpt_path=...) evaluates it
    assert runs[0]["local_sgd_checkpoint"]["val_loss"] == runs[1]["local_sgd_checkpoint"]["val_loss"]


def test_switch_from_a_callback_and_resume_with_the_switched_algorithm(runs):
    for r in runs:
        assert r["switch"]["algorithm"].startswith("diloco(")
        assert r["switch_resumed"]["algorithm"].startswith(
            "diloco("
        )  # the checkpoint's algorithm, not the constructor's
        assert torch.equal(r["switch_resumed"]["weights"], r["switch"]["weights"])
    assert torch.equal(runs[0]["switch"]["weights"], runs[1]["switch"]["weights"])


def test_a_dead_rank_is_named_not_waited_for(tmp_path):
    """Launched torchrun-style (Lightning's TorchElastic environment; the store is this process's, as
    torchrun's agent's is): rank 1 exits at step 3."""
    from unison.runtime import client_env, serve_store

    store = serve_store()
    procs = []
    for rank in range(2):
        env = _env(
            **client_env(store),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, str(tmp_path), "fail"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 3, outputs[1][-3000:]
    result_path = tmp_path / "fail-0.pt"
    assert result_path.exists(), f"rank 0 wrote no result (exit code {procs[0].returncode}):\n{outputs[0][-4000:]}"
    result = torch.load(result_path, weights_only=False)
    assert result["raised"] == "RankFailure", result.get("message")
    assert result["ranks"] == [1] and "rank 1" in result["message"], result["message"]


def test_importing_unison_does_not_import_lightning():
    code = (
        "import sys, unison, unison.integrations; "
        "sys.exit(any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], env=_env(), timeout=120).returncode == 0
