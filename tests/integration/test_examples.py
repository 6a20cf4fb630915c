"""Every script in examples/ runs as its docstring says, briefly: under torchrun on 2 gloo
processes, under ``unison launch --fault-tolerant``, or under Lightning, which starts its own."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests import launch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLES = os.path.join(ROOT, "examples")
QUICKSTART = os.path.join(EXAMPLES, "quickstart.py")

# Every example, with how the test below runs it (the docs may include one whole; see
# tests/integration/test_docs_examples.py). A script added to examples/ without a line here fails
# test_every_example_is_run.
RUNS = {
    "quickstart.py": ("torchrun", []),
    "gradient.py": ("torchrun", ["--epochs", "2", "--ckpt", "ckpt/gradient.pt"]),
    "model_averaging.py": ("torchrun", ["--epochs", "2"]),
    "heat_migration.py": ("torchrun", []),
    "fault_tolerant.py": ("unison launch", ["--epochs", "1"]),
    "lightning_classifier.py": ("python", ["--max-epochs", "1"]),
    "huggingface_trainer.py": ("torchrun", ["--steps", "40"]),
    "sharded.py": ("torchrun", ["--nodes", "2", "--epochs", "2"]),
    "sharded_fault_tolerant.py": ("unison launch", ["--epochs", "2"]),
}
#: torchrun's options where an example needs other than 2 processes
PROCESSES = {"sharded.py": 4}
#: ``unison launch``'s options where an example needs other than 2 processes of a node each
NODES = {"sharded_fault_tolerant.py": ["--nodes", "2", "--procs-per-node", "2"]}


def run_example(name: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    how, args = RUNS[name]
    script = os.path.join(EXAMPLES, name)
    if how == "torchrun":
        nproc = ["--nproc-per-node", str(PROCESSES[name])] if name in PROCESSES else []
        return launch.torchrun(*nproc, script, *args, cwd=cwd, timeout=timeout)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    if how == "unison launch":
        layout = NODES.get(name, ["--nproc", "2"])
        cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", *layout, script, *args]
    else:
        cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_every_example_is_run():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py"))
    assert scripts == sorted(RUNS), "add each script in examples/ to RUNS, with how to run it"


def test_quickstart_under_torchrun(tmp_path):
    proc = run_example("quickstart.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch") == 3  # rank 0 only
    state = torch.load(tmp_path / "quickstart.pt")
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_quickstart_alone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, QUICKSTART]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch") == 3


def test_gradient_trains_and_resumes_from_its_checkpoint(tmp_path):
    proc = run_example("gradient.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch ") == 2 and "skipped steps: 0" in proc.stdout
    assert (tmp_path / "ckpt" / "gradient.pt").exists()
    again = launch.torchrun(os.path.join(EXAMPLES, "gradient.py"), "--epochs", "3", cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("epoch ") == 1 and "epoch 2:" in again.stdout  # epochs 0-1 came from the file


def test_model_averaging_switches_and_ends_averaged(tmp_path):
    proc = run_example("model_averaging.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch 0 (diloco)" in proc.stdout and "epoch 1 (local_sgd)" in proc.stdout
    state = torch.load(tmp_path / "model_averaging.pt")
    assert {"0.weight", "0.bias", "2.weight", "2.bias", "_unison_algorithm"} == set(state)  # with local_sgd's state


def test_heat_migration(tmp_path):
    proc = run_example("heat_migration.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("epoch") == 3 and "first weight" in proc.stdout


def test_fault_tolerant_under_unison_launch(tmp_path):
    proc = run_example("fault_tolerant.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 64 members [0, 1]" in proc.stdout  # 4096 samples / (2 x 32), one epoch


def test_lightning_classifier(tmp_path):
    if importlib.util.find_spec("lightning") is None:  # found, not imported: only the example's processes import it
        pytest.skip("needs lightning")
    proc = run_example("lightning_classifier.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The two processes share stdout, so their lines may interleave.
    weights = re.findall(r"rank \d: first weight (-?\d+\.\d+)", proc.stdout)
    assert len(weights) == 2 and weights[0] == weights[1], proc.stdout  # one model on both ranks


def test_huggingface_trainer(tmp_path):
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs transformers and accelerate")
    proc = run_example("huggingface_trainer.py", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d+) unison sent [1-9]\d* bytes$", proc.stdout, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout  # rank 0 only, and it learns
    assert re.search(r"^step 40 eval loss \d+\.\d+$", proc.stdout, re.M), proc.stdout


def test_sharded_trains_fsdp2_inside_nodes_and_diloco_across(tmp_path):
    proc = run_example("sharded.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout  # rank 0 only, and it learns
    assert "sent" in proc.stdout and "bytes per step across the nodes" in proc.stdout
    weights = torch.load(tmp_path / "sharded.pt")  # the whole model, gathered from its shards
    assert weights["0.weight"].shape == (256, 32) and all(torch.isfinite(w).all() for w in weights.values())


def test_sharded_fault_tolerant_trains_fsdp2_nodes_under_the_coordinator(tmp_path):
    proc = run_example("sharded_fault_tolerant.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all(line.endswith("members [0, 1, 2, 3]") for line in epochs), proc.stdout
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in epochs]
    assert losses[1] < losses[0], proc.stdout  # it learns
    weights = torch.load(tmp_path / "sharded_fault_tolerant.pt")  # the whole model, gathered from its shards
    assert weights["0.weight"].shape == (256, 32) and all(torch.isfinite(w).all() for w in weights.values())
