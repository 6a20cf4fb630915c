"""unison.compat.torch.DistributedDataParallelCPU, and pytorch-pfn-extras' one-line move,
on real gloo ranks."""

from __future__ import annotations

import warnings

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, BNNet, batch, image_batch

import unison


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def spread(t: torch.Tensor) -> float:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def train(model, opt, steps=5, data=batch):
    rank = dist.get_rank()
    for s in range(steps):
        x, y = data(s, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def check_ddp_cpu() -> dict:
    from unison.compat.torch import DistributedDataParallelCPU

    rank = dist.get_rank()
    out = {}
    torch.manual_seed(0)
    net = MLP()
    model = DistributedDataParallelCPU(net)  # the seed's usage
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train(model, opt)
    torch.manual_seed(0)
    ref = MLP()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    train(unison.DataParallel(ref), ref_opt)
    out["gap"] = (flat(net.parameters()) - flat(ref.parameters())).abs().max().item()
    out["delay_reduce"] = model.delay_reduce

    # The gradients after backward are the average of the ranks' local gradients.
    local = MLP()
    local.load_state_dict(net.state_dict())
    x, y = batch(7, rank)
    F.mse_loss(local(x), y).backward()
    mine = flat(p.grad for p in local.parameters())
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    opt.zero_grad()
    before = model.comm_stats["steps"]
    F.mse_loss(model(x), y).backward()
    out["grad_gap"] = (flat(p.grad for p in net.parameters()) - sum(gathered) / len(gathered)).abs().max().item()
    F.mse_loss(model(x), y).backward()
    out["reductions"] = model.comm_stats["steps"] - before  # once per forward/backward

    # sync_parameters gives every rank rank 0's parameters.
    with torch.no_grad():
        for p in net.parameters():
            p.add_(float(rank))
    out["perturbed"] = spread(flat(net.parameters()))
    model.sync_parameters()
    out["synced"] = spread(flat(net.parameters()))

    # Buffers are not kept in sync, as in the seed.
    torch.manual_seed(0)
    bn = BNNet()
    m = DistributedDataParallelCPU(bn)
    train(m, torch.optim.SGD(m.parameters(), lr=0.05), data=image_batch)
    out["buffers"] = spread(flat(bn.buffers()).float())
    out["params"] = spread(flat(bn.parameters()))
    return out


def check_pfn() -> dict:
    """pytorch-pfn-extras' documented DistributedDataParallel, with only the import changed."""
    from unison import DataParallel as DistributedDataParallel

    out = {}
    calls = {"reduce": 0, "broadcast": 0, "hook": 0}

    def reduce_function(tensors, group):
        calls["reduce"] += 1
        for t in tensors:
            dist.all_reduce(t, group=group)
            t.div_(dist.get_world_size(group))

    def broadcast_function(tensors, group):
        calls["broadcast"] += 1
        for t in tensors:
            dist.broadcast(t, src=0, group=group)

    torch.manual_seed(0)
    net = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DistributedDataParallel(
            net,
            broadcast_buffers=True,
            negotiate_grads=True,
            process_group=None,
            reduce_function=reduce_function,
            broadcast_function=broadcast_function,
            check_reduction=True,  # a torch DDP keyword pfn passes on: torch's deprecation warning
        )
    out["warned"] = [str(w.message) for w in caught]
    handle = model.register_comm_hook(lambda m: calls.__setitem__("hook", calls["hook"] + 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with model.no_sync():
        x, y = batch(0, dist.get_rank())
        F.mse_loss(model(x), y).backward()
    train(model, opt, steps=3)
    handle.remove()
    train(model, opt, steps=1)
    out["calls"] = dict(calls)
    out["spread"] = spread(flat(net.parameters()))
    return out


def check_all() -> dict:
    return {"cpu": check_ddp_cpu(), "pfn": check_pfn()}


@pytest.fixture(scope="module")
def results():
    return launch.run(check_all, 2, timeout=120)


def test_ddp_cpu_averages_once_per_backward_like_allreduce(results):
    for r in results:
        c = r["cpu"]
        assert c["gap"] == 0.0
        assert c["delay_reduce"] is True
        assert c["grad_gap"] < 1e-6
        assert c["reductions"] == 2


def test_ddp_cpu_sync_parameters_and_buffers(results):
    for r in results:
        c = r["cpu"]
        assert c["perturbed"] > 0.5
        assert c["synced"] == 0.0
        assert c["buffers"] > 0.0
        assert c["params"] == 0.0


def test_pfn_usage_is_one_import(results):
    for r in results:
        p = r["pfn"]
        assert any("check_reduction" in w for w in p["warned"])
        # construction broadcasts (the MLP has no buffers to broadcast after each step);
        # 4 synchronized backwards reduce (not the no_sync one); the hook saw 3 of them
        assert p["calls"] == {"reduce": 4, "broadcast": 1, "hook": 3}
        assert p["spread"] == 0.0
