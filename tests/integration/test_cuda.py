"""Every algorithm on CUDA tensors: the checks that need a GPU (marker ``cuda``; skipped where torch
sees none, as in CI).

With one GPU, two ranks share it over gloo (NCCL refuses two ranks on one device), so these
tests check what unison does with CUDA tensors: where its buckets, wire buffers, codecs and
state live, host copies it should not make, autocast with a GradScaler, checkpoints of CUDA
state and offload to pinned host memory. ``test_nccl_world_of_one`` runs the NCCL path a world
of one can: ``unison.init()`` choosing NCCL and setting the device, and one wrapper over it.

Run on a GPU machine::

    python -m pytest tests/integration/test_cuda.py -m cuda -v
"""

from __future__ import annotations

import os

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scenarios import spread_across_ranks
from torch import nn

import unison
from unison.memory import live_tensor_bytes, parameter_bytes

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)"),
]

STEPS = 8
# Every algorithm, with periods short enough that 8 steps hold several syncs.
SPECS = [
    "allreduce",
    "fp16",
    "bf16",
    "nonblocking",
    "bytegrad",
    "bytegrad:error_feedback=True",
    "powersgd:rank=2,start_iter=2",
    "qadam",
    "local_sgd:period=2",
    "async:sync_interval_ms=20,warmup_steps=2",
    "decentralized",
    "decentralized:peer_selection=ring",
    "low_precision_decentralized",
    "diloco:period=2,fragments=1",
    "diloco:period=4,wire_dtype=int8",
    "daso:warmup_epochs=0",
    "sparseloco:period=2",
    "sparseloco:period=2,scale_dtype=bf16",
    "demo",
    "demo:sign=True,bits=2,topk=2,scale_dtype=bf16",
]
# gloo sends and receives host memory only: over it a point-to-point round in flight is staged on the
# host (what the ring's fragment and low_precision_decentralized's 8-bit messages weigh); NCCL would not.
HOST_STAGED_P = {"decentralized:peer_selection=ring": 0.55, "low_precision_decentralized": 0.15}
# Gradient algorithms that average exactly: the replicas stay equal at every step.
EQUAL_EVERY_STEP = {"allreduce", "fp16", "bf16", "nonblocking", "bytegrad", "powersgd", "qadam", "demo"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def train(spec: str, device: str, steps: int = STEPS) -> dict:
    """Train ``spec`` on ``device`` for ``steps`` steps; what it leaves where."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)) for _ in range(steps)]
    net = mlp().to(device)
    name = spec.partition(":")[0]
    if name == "qadam":
        opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    cpu_before = live_tensor_bytes(device="cpu")
    model = unison.DataParallel(net, optimizer=opt, algorithm=spec)
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (i + 1) % 4 == 0:
            model.end_epoch(losses[-1])  # DASO's schedule advances by epochs
    if device == "cuda":
        torch.cuda.synchronize()
    cpu_after = live_tensor_bytes([net], [opt], device="cpu")
    on = {str(p.device.type) for p in net.parameters()}
    on |= {str(t.device.type) for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    out = {
        "losses": losses,
        "devices": sorted(on),
        "cpu_grew_P": (cpu_after - cpu_before) / parameter_bytes(net),
        "spread": spread_across_ranks(net),
        "weights": [p.detach().to("cpu", copy=True) for p in net.parameters()],  # as they are now, before close
    }
    model.close()
    return out


def every_algorithm_on_cuda(spec: str) -> dict:
    torch.cuda.set_device(0)
    return train(spec, "cuda")


@pytest.mark.parametrize("spec", SPECS)
def test_every_algorithm_trains_on_cuda_tensors(spec):
    """Parameters, optimizer state and every tensor the algorithm keeps stay on the GPU (no host copy
    of a fraction of the parameters or more), the loss is finite, and the replicas agree as the
    algorithm promises."""
    results = launch.run(every_algorithm_on_cuda, 2, spec, timeout=240)
    for r in results:
        assert r["devices"] == ["cuda"], r["devices"]
        assert all(torch.isfinite(torch.tensor(r["losses"]))), r["losses"]
        host = HOST_STAGED_P.get(spec, 0.05)
        assert r["cpu_grew_P"] < host, f"{spec} keeps {r['cpu_grew_P']:.2f} P in host memory"
    if spec.partition(":")[0] in EQUAL_EVERY_STEP:
        assert results[0]["spread"] < 1e-5, results[0]["spread"]


def same_on_cuda_as_on_cpu(spec: str) -> float:
    torch.cuda.set_device(0)
    on_gpu = train(spec, "cuda")
    on_cpu = train(spec, "cpu")
    return max((a - b).abs().max().item() for a, b in zip(on_gpu["weights"], on_cpu["weights"]))


@pytest.mark.parametrize("spec", ["allreduce", "fp16", "local_sgd:period=2", "diloco:period=2,fragments=1"])
def test_the_same_weights_on_cuda_as_on_cpu(spec):
    """Exact algorithms give the CPU's weights on the GPU (to float rounding)."""
    gaps = launch.run(same_on_cuda_as_on_cpu, 2, spec, timeout=240)
    assert max(gaps) < 1e-4, gaps


def autocast_with_scaler(spec: str, device: str = "cuda") -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    net = mlp().to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=opt, algorithm=spec)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16)
    skipped = 0
    for i in range(6):
        x, y = torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)
        if i == 2 and rank == 1:
            x[0, 0] = float("inf")  # one rank's overflow: every rank must skip that step together
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale
    finite = bool(all(torch.isfinite(p).all() for p in net.parameters()))
    out = {"spread": spread_across_ranks(net), "skipped": skipped, "finite": finite}
    model.close()
    return out


@pytest.mark.parametrize("spec", ["allreduce", "daso:warmup_epochs=0"])
def test_autocast_fp16_with_grad_scaler(spec):
    """fp16 autocast with torch.amp.GradScaler: the overflow on one rank is skipped by all, the
    weights stay finite and equal."""
    results = launch.run(autocast_with_scaler, 2, spec, timeout=240)
    for r in results:
        assert r["finite"]
        assert r["skipped"] >= 1
    assert results[0]["spread"] < 1e-5


def checkpoint_cuda_state(path: str, device: str = "cuda") -> float:
    if device == "cuda":
        torch.cuda.set_device(0)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3 + rank)
    data = [(torch.randn(16, 64, generator=g).to(device), torch.randn(16, 8, generator=g).to(device)) for _ in range(8)]

    def make():
        net = mlp().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        return net, opt, unison.DataParallel(net, optimizer=opt, algorithm="diloco:period=2,fragments=1")

    def steps(model, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    net, opt, model = make()
    steps(model, opt, data[:3])
    unison.save(path, model, opt)
    steps(model, opt, data[3:])
    straight = [p.detach().clone() for p in net.parameters()]
    model.close()
    net, opt, model = make()
    unison.load(path, model, opt)
    steps(model, opt, data[3:])
    resumed = [p.detach().clone() for p in net.parameters()]  # before close, as the straight run's
    model.close()
    assert all(p.device.type == device for p in net.parameters())
    return max((a - b).abs().max().item() for a, b in zip(straight, resumed))


def test_save_and_load_cuda_state_resume_exactly(tmp_path):
    """unison.save/load of CUDA weights, optimizer and DiLoCo state: the resumed run is the straight one."""
    gaps = launch.run(checkpoint_cuda_state, 2, str(tmp_path / "ckpt"), timeout=240)
    assert max(gaps) == 0.0, gaps


def offloaded(spec: str) -> dict:
    import gc

    torch.cuda.set_device(0)
    net = mlp().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=opt, algorithm=spec)
    x, y = torch.randn(16, 64).cuda(), torch.randn(16, 8).cuda()
    for _ in range(4):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    gc.collect()
    pinned = {
        o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
        for o in gc.get_objects()
        if torch.is_tensor(o) and o.device.type == "cpu" and o.is_pinned()
    }
    out = {"host_P": sum(pinned.values()) / parameter_bytes(net), "spread": spread_across_ranks(net)}
    model.close()
    return out


@pytest.mark.parametrize(
    "spec", ["diloco:period=2,fragments=1,offload=True", "low_precision_decentralized:offload=True"]
)
def test_offload_keeps_the_state_in_pinned_host_memory(spec):
    """offload=True: the state lives in pinned host memory (whole copies of the parameters), not on the GPU."""
    results = launch.run(offloaded, 2, spec, timeout=240)
    for r in results:
        assert r["host_P"] >= 1.0, r  # pinned host tensors: at least a whole copy of the parameters


def nccl_world_of_one() -> dict:
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    topo = unison.init()
    net = mlp().cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=opt)
    x, y = torch.randn(16, 64).cuda(), torch.randn(16, 8).cuda()
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    out = {
        "backend": topo.backend,
        "device": torch.cuda.current_device(),
        "cuda": all(p.is_cuda for p in net.parameters()),
    }
    model.close()
    unison.shutdown()
    return out


def test_nccl_world_of_one():
    """A world of one on NCCL (what one GPU allows): unison adopts the group and trains on it."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        out = pool.apply(nccl_world_of_one)
    assert out == {"backend": "nccl", "device": 0, "cuda": True}, out


def test_ft_offload_leaves_the_gpu_what_it_holds_without_fault_tolerance(tmp_path):
    """Under fault tolerance the saved gradients are on the GPU; with ft_offload=True they are in
    host memory, one copy fewer on the GPU. demo and powersgd keep no copy of their own state for
    redoing a round (they undo it from the saved gradients), so theirs is the same one copy."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    specs = ["allreduce", "demo", "powersgd:rank=2,start_iter=2"]
    script = Path(__file__).resolve().parents[1] / "scripts" / "ft_memory.py"
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "2", "--no-status", str(script)]
    done = subprocess.run(
        [*cmd, str(tmp_path), *specs, *(s + "+offload" for s in specs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "FT_MEMORY_DEVICE": "cuda"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for path in tmp_path.glob("*.json"):
        found = json.loads(path.read_text())
        print(path.name, found["overheads"])
        over = found["overheads"]
        assert over["allreduce"] >= 0.9 and over["allreduce+offload"] <= 0.1, over
        for spec in specs[1:]:
            assert 0.9 <= over[spec] - over[spec + "+offload"] <= 1.1, (spec, over)  # the saved gradients (1 P)
        assert all(found["same_as_on_device"].values()), found["same_as_on_device"]
