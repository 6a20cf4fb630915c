"""Training situations run inside each rank: torch DDP, unison and a single
process given the combined batch train the same model side by side, and each
scenario reports how far apart they ended.

Every scenario returns a dict of measurements; the tests assert on them.
"""

from __future__ import annotations

import copy
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import (
    MLP,
    BNNet,
    Branchy,
    Checkpointed,
    ReverseRegistered,
    Tied,
    batch,
    frozen_mlp,
    image_batch,
    token_batch,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

STEPS = 4


class Optimizers:
    """Several optimizers stepped together, for the several-optimizers case."""

    def __init__(self, *opts):
        self.opts = opts

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()

    def step(self):
        for o in self.opts:
            o.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def two_optimizers(model):
    params = list(model.parameters())
    return Optimizers(torch.optim.SGD(params[:2], lr=0.05), torch.optim.Adam(params[2:], lr=0.01))


def mse_loss(model, x, y, rank):
    return F.mse_loss(model(x), y)


def step(model, opt, items, loss_fn=mse_loss):
    """One optimizer step on the mean loss of ``items`` = [(rank, x, y), ...]."""
    opt.zero_grad()
    loss = sum(loss_fn(model, x, y, r) for r, x, y in items) / len(items)
    loss.backward()
    opt.step()


def max_diff(a, b) -> float:
    return max(((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())), default=0.0)


def spread_across_ranks(model) -> float:
    """Largest difference of a parameter or buffer between this rank and the others."""
    tensors = [t.detach().float().reshape(-1) for t in list(model.parameters()) + list(model.buffers())]
    flat = torch.cat(tensors)
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def side_by_side(
    make: Callable,
    data=batch,
    ddp_kwargs=None,
    unison_kwargs=None,
    make_opt=sgd,
    step_fn=step,
    loss_fn=mse_loss,
    steps=STEPS,
    between=None,
    setup=None,
):
    """Train DDP, unison and the single-process reference in lockstep."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = make()
    ref, a, b = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a, **(ddp_kwargs or {}))
    db = unison.DataParallel(b, **(unison_kwargs or {}))
    if setup:
        setup(da, db)
    oa, ob, oref = make_opt(a), make_opt(b), make_opt(ref)
    for s in range(steps):
        mine = [(rank, *data(s, rank))]
        step_fn(da, oa, mine, loss_fn)
        step_fn(db, ob, mine, loss_fn)
        step_fn(ref, oref, [(r, *data(s, r)) for r in range(world)], loss_fn)
        if between:
            between(da, db, s)
    none_match = all((p.grad is None) == (q.grad is None) for p, q in zip(a.parameters(), b.parameters()))
    return {
        "ddp": max_diff(a, b),
        "ref": max_diff(ref, b),
        "grads_none_match": none_match,
        "spread": spread_across_ranks(b),
        "model": db,
        "ddp_model": da,
    }


def branch_loss(model, x, y, rank):
    return F.mse_loss(model(x, branch="a" if rank == 0 else "b"), y)


def alternating_loss(model, x, y, rank):
    return F.mse_loss(model(x, branch="a" if (rank + int(x[0, 0] > 0)) % 2 else "none"), y)


def no_sync_step(model, opt, items, loss_fn):
    """Two micro-batches: the first under no_sync, the second synchronized."""
    opt.zero_grad()
    if hasattr(model, "no_sync"):
        (r, x, y) = items[0]
        with model.no_sync():
            loss_fn(model, x[:4], y[:4], r).backward()
        loss_fn(model, x[4:], y[4:], r).backward()
    else:
        loss = sum(loss_fn(model, x[:4], y[:4], r) + loss_fn(model, x[4:], y[4:], r) for r, x, y in items) / len(items)
        loss.backward()
    opt.step()


def lm_loss(model, x, y, rank):
    return F.cross_entropy(model(x).reshape(-1, 30), y.reshape(-1))


def autocast_loss(model, x, y, rank):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def eval_between(da, db, s):
    for m in (da, db):
        m.eval()
        with torch.no_grad():
            m(image_batch(100 + s, 0)[0])
        m.train()


def grads_are_bucket_views(model) -> bool:
    flats = [(b.flat.data_ptr(), b.flat.data_ptr() + b.nbytes) for b in model._core.reducer.buckets]
    return all(
        any(lo <= p.grad.data_ptr() < hi for lo, hi in flats) for p in model.module.parameters() if p.grad is not None
    )


# ---- scenarios: name -> function returning a dict ------------------------------


def plain():
    out = side_by_side(MLP)
    out["views"] = grads_are_bucket_views(out["model"])
    return out


def many_buckets():
    out = side_by_side(lambda: MLP(hidden=64, depth=5), unison_kwargs={"bucket_cap_mb": 0.004})
    out["buckets"] = len(out["model"]._core.reducer.buckets)
    return out


def bucket_names(model):
    reducer = model._core.reducer
    return [[reducer.names[i] for i in g] for g in reducer.groups]


def replanned():
    """Buckets follow the real gradient order after the first step: ``out`` arrives first."""
    plans = []
    out = side_by_side(
        ReverseRegistered, unison_kwargs={"bucket_cap_mb": 0.01}, setup=lambda da, db: plans.append(bucket_names(db))
    )
    out["plan_before"] = plans[0]
    out["plan_after"] = bucket_names(out["model"])
    return out


def set_to_zero():
    def zeroing(model):
        opt = sgd(model)
        opt.zero_grad = lambda set_to_none=False: torch.optim.SGD.zero_grad(opt, set_to_none=False)
        return opt

    return side_by_side(MLP, make_opt=zeroing)


def no_sync():
    return side_by_side(MLP, step_fn=no_sync_step)


def unused_everywhere():
    return side_by_side(
        Branchy, ddp_kwargs={"find_unused_parameters": True}, loss_fn=lambda m, x, y, r: F.mse_loss(m(x), y)
    )


def branch_per_rank():
    return side_by_side(Branchy, ddp_kwargs={"find_unused_parameters": True}, loss_fn=branch_loss)


def branch_changes_each_step():
    out = side_by_side(Branchy, ddp_kwargs={"find_unused_parameters": True}, loss_fn=alternating_loss, steps=6)
    return out


def frozen():
    return side_by_side(frozen_mlp)


def tied():
    return side_by_side(Tied, data=token_batch, loss_fn=lm_loss)


def checkpoint_reentrant():
    return side_by_side(lambda: Checkpointed(True))


def checkpoint_plain():
    return side_by_side(lambda: Checkpointed(False))


def autocast():
    return side_by_side(MLP, loss_fn=autocast_loss)


def several_optimizers():
    return side_by_side(MLP, make_opt=two_optimizers)


def batchnorm():
    out = side_by_side(BNNet, data=image_batch)
    a, b = out["ddp_model"].module, out["model"].module
    out["buffers_vs_ddp_rank0"] = max(
        (x.float() - y.float()).abs().max().item() for x, y in zip(a.buffers(), b.buffers())
    )
    return out


def eval_forwards():
    return side_by_side(BNNet, data=image_batch, between=eval_between)


def delay_reduce():
    return side_by_side(MLP, unison_kwargs={"delay_reduce": True})


def torch_allreduce_hook():
    return side_by_side(
        MLP, setup=lambda da, db: [m.register_comm_hook(None, default_hooks.allreduce_hook) for m in (da, db)]
    )


def torch_fp16_hook():
    return side_by_side(
        MLP, setup=lambda da, db: [m.register_comm_hook(None, default_hooks.fp16_compress_hook) for m in (da, db)]
    )


def pfn_hook():
    seen = []

    def hook(model):
        grads = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
        seen.append(grads.clone())

    out = side_by_side(MLP, setup=lambda da, db: db.register_comm_hook(hook))
    # Gradients the hook saw are local: they differ between ranks.
    local = seen[-1]
    other = local.clone()
    dist.all_reduce(other, op=dist.ReduceOp.MAX)
    out["hook_calls"] = len(seen)
    out["hook_saw_local"] = bool((other - local).abs().max() > 0)
    return out


def custom_functions():
    calls = {"reduce": 0, "broadcast": 0}

    def reduce_fn(tensors, group):
        calls["reduce"] += 1
        unison.engine.averaging.default_reduce(tensors, group)

    def broadcast_fn(tensors, group):
        calls["broadcast"] += 1
        unison.engine.comm.default_broadcast(tensors, group)

    out = side_by_side(
        BNNet, data=image_batch, unison_kwargs={"reduce_function": reduce_fn, "broadcast_function": broadcast_fn}
    )
    out["calls"] = calls
    return out


def negotiate_off():
    out = side_by_side(
        Branchy,
        ddp_kwargs={"find_unused_parameters": True},
        unison_kwargs={"negotiate_grads": False},
        loss_fn=lambda m, x, y, r: F.mse_loss(m(x), y),
    )
    never = out["model"].module.never.weight.grad
    out["never_grad_zero"] = never is not None and bool((never == 0).all())
    return out


def state_dict_keys():
    torch.manual_seed(0)
    model = unison.DataParallel(MLP())
    ddp = DDP(copy.deepcopy(model.module))
    keys = list(model.state_dict())
    fresh = unison.DataParallel(MLP())
    result = fresh.load_state_dict(ddp.state_dict())
    return {
        "keys_match": keys == list(model.module.state_dict()),
        "loaded": max_diff(fresh.module, model.module) == 0.0 and not result.missing_keys,
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        plain,
        many_buckets,
        replanned,
        set_to_zero,
        no_sync,
        unused_everywhere,
        branch_per_rank,
        branch_changes_each_step,
        frozen,
        tied,
        checkpoint_reentrant,
        checkpoint_plain,
        autocast,
        several_optimizers,
        batchnorm,
        eval_forwards,
        delay_reduce,
        torch_allreduce_hook,
        torch_fp16_hook,
        pfn_hook,
        custom_functions,
        negotiate_off,
        state_dict_keys,
    )
}


def run_scenarios(names):
    """Run each named scenario; a failure is reported as its traceback."""
    results = {}
    for name in names:
        try:
            out = SCENARIOS[name]()
            results[name] = {k: v for k, v in out.items() if not isinstance(v, torch.nn.Module)}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results
