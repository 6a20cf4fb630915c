"""A wrapper's life: hooks at a world of one, switch_to returning the model, and a
wrapper that is closed, discarded or replaced leaving no hook, thread or stray event."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import unison
from tests import launch
from tests.models import MLP, batch

MODEL_AVERAGING = ["decentralized", "low_precision_decentralized", "diloco", "async", "local_sgd"]


def _train(model, opt, steps: int = 3, rank: int = 0) -> None:
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _hook_counts(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Hooks left on the parameters, the modules and the optimizer (torch's own registries)."""
    return {
        "param": sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters()),
        "forward_pre": sum(len(m._forward_pre_hooks) for m in net.modules()),
        "step_pre": len(opt._optimizer_step_pre_hooks),
        "step_post": len(opt._optimizer_step_post_hooks),
        "patched": int("step" in opt.__dict__ or "zero_grad" in opt.__dict__),
    }


CLEAN = {"param": 0, "forward_pre": 0, "step_pre": 0, "step_post": 0, "patched": 0}


# ---- a world of one: the hooks run (as torch DDP's do) ---------------------------
@pytest.mark.parametrize("algorithm", ["allreduce", *MODEL_AVERAGING])
def test_pfn_hook_runs_at_world_size_one(algorithm):
    assert not dist.is_initialized()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    calls = []
    handle = model.register_comm_hook(lambda m: calls.append(m is model))
    _train(model, opt, steps=3)
    assert calls == [True, True, True]
    handle.remove()
    _train(model, opt, steps=1)
    assert len(calls) == 3


def test_clip_grad_hook_clips_at_world_size_one():
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt)
    model.register_comm_hook(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3))
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    norm = torch.norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    assert norm <= 1e-3 * 1.0001


def test_ddp_comm_hook_and_reduce_function_at_world_size_one():
    torch.manual_seed(0)
    net = MLP()
    seen = []

    def hook(state, bucket):
        state.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)  # a hook that changes the gradient, to see it applied
        return fut

    model = unison.DataParallel(net)
    model.register_comm_hook(seen, hook)
    x, y = batch(0, 0)
    reference = MLP()
    reference.load_state_dict(net.state_dict())
    F.mse_loss(reference(x), y).backward()
    F.mse_loss(model(x), y).backward()
    assert seen
    for p, q in zip(net.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, 2 * q.grad)

    reduced = []
    model2 = unison.DataParallel(MLP(), reduce_function=lambda tensors, group: reduced.append(len(tensors)))
    F.mse_loss(model2(x), y).backward()
    assert reduced


def test_ddp_comm_hook_on_model_averaging_is_refused_not_ignored():
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt, algorithm="decentralized")
    with pytest.raises(RuntimeError, match="never averages gradients"):
        model.register_comm_hook(None, lambda state, bucket: None)


def test_switch_to_returns_the_model():
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt)
    assert model.switch_to("local_sgd") is model
    assert model.algorithm.name == "local_sgd"


# ---- closed, discarded, replaced: nothing left behind -------------------------------
@pytest.mark.parametrize("algorithm", ["allreduce", "nonblocking", "local_sgd", "async:warmup_steps=1"])
def test_close_and_garbage_collection_leave_no_hook(algorithm):
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    _train(model, opt)
    model.close()
    assert _hook_counts(net, opt) == CLEAN
    model.close()  # twice is harmless

    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    _train(model, opt)
    del model
    gc.collect()
    assert _hook_counts(net, opt) == CLEAN


def _replaced_wrapper(algorithm: str):
    """Wrap the same net and optimizer twice; the first wrapper is dropped without close()."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    first = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    _train(first, opt, steps=2, rank=rank)
    first.average()
    del first
    gc.collect()
    second = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    counts = _hook_counts(net, opt)
    _train(second, opt, steps=4, rank=rank)  # a stray after_step of the first would issue extra collectives
    second.average()
    state = second.algorithm_state
    result = {
        "counts": counts,
        "steps": getattr(state, "steps", None),
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("unison-async")),
        "weights": [p.detach().clone() for p in net.parameters()],
    }
    second.close()
    result["after_close"] = _hook_counts(net, opt)
    result["threads_after"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("unison-async"))
    return result


@pytest.mark.parametrize("algorithm", ["local_sgd:period=1", "async:sync_interval_ms=5"])
def test_a_replaced_wrapper_leaves_no_hook_thread_or_stray_event(algorithm):
    r0, r1 = launch.run(_replaced_wrapper, 2, algorithm, timeout=120)
    for r in (r0, r1):
        assert r["counts"]["step_pre"] == 1 and r["counts"]["step_post"] == 1  # the second wrapper's only
        assert r["after_close"] == CLEAN
        assert r["threads_after"] == []
    if algorithm.startswith("local_sgd"):
        assert r0["steps"] == r1["steps"] == 4
    for a, b in zip(r0["weights"], r1["weights"]):
        assert torch.equal(a, b)


def _optimizer_close():
    torch.manual_seed(0)
    net = MLP()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    opt = unison.DistributedOptimizer(inner, named_parameters=net.named_parameters())
    _train(net, opt, steps=2, rank=dist.get_rank())
    opt.close()
    return _hook_counts(net, inner)


def test_distributed_optimizer_close_leaves_no_hook():
    for counts in launch.run(_optimizer_close, 2):
        assert counts == CLEAN


def _after_shutdown():
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt)
    _train(model, opt, steps=2, rank=dist.get_rank())
    unison.shutdown()
    refused = {}
    for what, call in [("forward", lambda: model(batch(0, 0)[0])), ("switch_to", lambda: model.switch_to("local_sgd"))]:
        with pytest.raises(RuntimeError, match="this wrapper is closed") as info:
            call()
        refused[what] = str(info.value)
    return {"refused": refused, "hooks": _hook_counts(net, opt), "group": model.process_group}


def test_a_wrapper_after_shutdown_is_closed_and_says_so():
    """``unison.shutdown()`` releases every wrapper (runtime/ending.py): a later forward or switch
    raises that it is closed, on every rank, and no hook or group of it is left behind."""
    for r in launch.run(_after_shutdown, 2):
        assert set(r["refused"]) == {"forward", "switch_to"}
        assert r["hooks"] == CLEAN and r["group"] is None
