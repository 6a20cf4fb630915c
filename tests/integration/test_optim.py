"""``unison.DistributedOptimizer`` against torch DDP, and the "qadam" algorithm with its optimizer.

Distributed checks run on 2 real gloo ranks, grouped into two launches; argument
errors and the single-process behaviour are checked in-process.
"""

import copy
import json
import subprocess
import sys
import warnings

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import max_diff, spread_across_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import unison
from unison.apps.train import QADAM_LR

STEPS = 4


def loss_of(model, x, y):
    return F.mse_loss(model(x), y)


def ranks_start_apart():
    """An MLP initialized differently on each rank (construction must broadcast rank 0's)."""
    torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return MLP(hidden=32, depth=4)


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


# ---- DistributedOptimizer on 2 ranks ----------------------------------------------


def same_as_ddp():
    """Several steps, small buckets: DistributedOptimizer and DDP end equal."""
    rank = dist.get_rank()
    base = ranks_start_apart()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a)
    oa = sgd(a)
    ob = unison.DistributedOptimizer(sgd(b), named_parameters=b.named_parameters(), bucket_cap_mb=0.002)
    for s in range(STEPS):
        x, y = batch(s, rank)
        for model, opt in ((da, oa), (b, ob)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    return {"diff": max_diff(a, b), "spread": spread_across_ranks(b), "buckets": len(ob._core.reducer.buckets)}


def accumulation_like_no_sync():
    """backward_passes_per_step=2 equals DDP with the first of two micro-batches under no_sync;
    stepping after only one of the two passes is refused."""
    rank = dist.get_rank()
    base = ranks_start_apart()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a)
    oa = sgd(a)
    ob = unison.DistributedOptimizer(sgd(b), named_parameters=b.named_parameters(), backward_passes_per_step=2)
    early_step_error = None
    for s in range(STEPS):
        x, y = batch(s, rank)
        oa.zero_grad()
        with da.no_sync():
            loss_of(da, x[:4], y[:4]).backward()
        loss_of(da, x[4:], y[4:]).backward()
        oa.step()
        ob.zero_grad()
        loss_of(b, x[:4], y[:4]).backward()
        if s == 1:
            try:
                ob.step()
            except RuntimeError as exc:
                early_step_error = str(exc)
        loss_of(b, x[4:], y[4:]).backward()
        ob.step()
    return {"diff": max_diff(a, b), "spread": spread_across_ranks(b), "early_step_error": early_step_error}


def lr_scheduler_works():
    """A StepLR drives the wrapped optimizer's rate and training still equals DDP's."""
    rank = dist.get_rank()
    base = ranks_start_apart()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a)
    oa = sgd(a, lr=0.1)
    inner = sgd(b, lr=0.1)
    ob = unison.DistributedOptimizer(inner, named_parameters=b.named_parameters())
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
        for s in range(STEPS):
            x, y = batch(s, rank)
            for model, opt, sched in ((da, oa, sa), (b, ob, sb)):
                opt.zero_grad()
                loss_of(model, x, y).backward()
                opt.step()
                sched.step()
    return {
        "diff": max_diff(a, b),
        "lr": inner.param_groups[0]["lr"],
        "ddp_lr": oa.param_groups[0]["lr"],
        "shared_groups": ob.param_groups is inner.param_groups,
        "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
        "state_keys": sorted(ob.state_dict()) == sorted(inner.state_dict()),
    }


def added_group_joins():
    """Parameters of a group added after wrapping are broadcast and averaged too."""
    rank = dist.get_rank()
    base = ranks_start_apart()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a)
    oa = sgd(a)
    named = list(b.named_parameters())
    ob = unison.DistributedOptimizer(
        torch.optim.SGD([p for _, p in named[:2]], lr=0.05, momentum=0.9), named_parameters=named
    )
    ob.add_param_group({"params": [p for _, p in named[2:]]})
    for s in range(STEPS):
        x, y = batch(s, rank)
        for model, opt in ((da, oa), (b, ob)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    return {"diff": max_diff(a, b), "averaged": len(ob._core.reducer.params)}


def mismatch_is_refused():
    """A parameter shaped differently on rank 1 raises on every rank, naming it."""
    torch.manual_seed(0)
    net = MLP(hidden=33 if dist.get_rank() == 1 else 32)
    try:
        unison.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters())
    except ValueError as exc:
        return str(exc)
    return None


def distributed_optimizer_checks():
    return {
        "ddp": same_as_ddp(),
        "accumulation": accumulation_like_no_sync(),
        "scheduler": lr_scheduler_works(),
        "added_group": added_group_joins(),
        "mismatch": mismatch_is_refused(),
    }


@pytest.fixture(scope="module")
def dopt_results():
    return launch.run(distributed_optimizer_checks, 2, timeout=90)


def test_same_parameters_as_ddp(dopt_results):
    for r in dopt_results:
        assert r["ddp"]["buckets"] >= 3
        assert r["ddp"]["diff"] <= 1e-6
        assert r["ddp"]["spread"] == 0.0


def test_backward_passes_per_step_accumulates_like_no_sync(dopt_results):
    for r in dopt_results:
        assert r["accumulation"]["diff"] <= 1e-6
        assert r["accumulation"]["spread"] == 0.0
        message = r["accumulation"]["early_step_error"]
        assert message is not None and "1 more backward pass" in message


def test_lr_scheduler_drives_the_wrapped_optimizer(dopt_results):
    for r in dopt_results:
        s = r["scheduler"]
        assert s["shared_groups"] and s["state_keys"]
        assert s["lr"] == s["ddp_lr"] == pytest.approx(0.1 * 0.5**STEPS)
        assert s["diff"] <= 1e-6
        assert s["warnings"] == []


def test_added_param_group_is_averaged(dopt_results):
    for r in dopt_results:
        assert r["added_group"]["averaged"] == 8
        assert r["added_group"]["diff"] <= 1e-6


def test_parameter_mismatch_raises_on_every_rank(dopt_results):
    for r in dopt_results:
        assert r["mismatch"] is not None
        assert "'layers.0.weight'" in r["mismatch"] and "[33, 16]" in r["mismatch"]


# ---- DistributedOptimizer in one process -------------------------------------------


def test_bad_arguments_are_refused():
    net = MLP()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        unison.DistributedOptimizer(net)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="backward_passes_per_step must be a positive integer"):
            unison.DistributedOptimizer(sgd(net), backward_passes_per_step=bad)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        unison.DistributedOptimizer(sgd(net), bucket_cap_mb=0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        unison.DistributedOptimizer(sgd(net), algorithm="no-such-algorithm")
    with pytest.raises(ValueError, match="not in named_parameters"):
        unison.DistributedOptimizer(sgd(net), named_parameters=list(net.named_parameters())[1:])
    named = list(net.named_parameters())
    partial = unison.DistributedOptimizer(torch.optim.SGD([named[0][1]], lr=0.1), named_parameters=named[:1])
    with pytest.raises(ValueError, match="not in named_parameters"):
        partial.add_param_group({"params": [named[1][1]]})
    assert len(partial.param_groups) == 1
    with pytest.raises(TypeError, match="already a DistributedOptimizer"):
        unison.DistributedOptimizer(unison.DistributedOptimizer(sgd(net)))


def test_alone_it_is_the_wrapped_optimizer():
    """Without torch.distributed the wrapper steps exactly like the optimizer it wraps."""
    torch.manual_seed(0)
    a = MLP()
    b = copy.deepcopy(a)
    oa = sgd(a)
    ob = unison.DistributedOptimizer(sgd(b), backward_passes_per_step=2)
    assert isinstance(ob, torch.optim.Optimizer)
    for s in range(3):
        x, y = batch(s, 0)
        for model, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()
    assert max_diff(a, b) == 0.0
    fresh = unison.DistributedOptimizer(sgd(copy.deepcopy(b)))
    fresh.load_state_dict(ob.state_dict())
    assert fresh.state_dict()["param_groups"] == ob.state_dict()["param_groups"]


# ---- qadam on 2 ranks ---------------------------------------------------------------


def qadam_pair(net, warmup, lr=0.01):
    opt = unison.QAdamOptimizer(net.parameters(), lr=lr, warmup_steps=warmup)
    return unison.DataParallel(net, optimizer=opt, algorithm="qadam"), opt


def train_step(model, opt, x, y):
    opt.zero_grad()
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    return loss.item()


def warmup_is_adam():
    """During warm-up qadam + QAdamOptimizer equals torch Adam + DDP."""
    rank = dist.get_rank()
    base = ranks_start_apart()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    da = DDP(a)
    oa = torch.optim.Adam(a.parameters(), lr=0.01)
    db, ob = qadam_pair(b, warmup=10)
    for s in range(STEPS):
        x, y = batch(s, rank)
        train_step(da, oa, x, y)
        train_step(db, ob, x, y)
    return {"diff": max_diff(a, b), "bytes": db.comm_stats["bytes_last_step"]}


def regression(step, rank, n=32):
    """A noisy linear target, a fresh batch per step and rank."""
    g = torch.Generator().manual_seed(7)
    true = torch.randn(16, 4, generator=g)
    g.manual_seed(100 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, x @ true + 0.01 * torch.randn(n, 4, generator=g)


def held_out_loss(model):
    x, y = regression(10_000, 0, n=256)
    with torch.no_grad():
        return loss_of(model, x, y).item()


def after_warmup_and_round_trip():
    """Past warm-up the replicas stay identical and the loss keeps falling; a checkpoint
    of both states, loaded into fresh objects, continues with identical parameters."""
    rank = dist.get_rank()
    warmup, steps = 20, 60
    db, ob = qadam_pair(ranks_start_apart(), warmup=warmup)
    losses = {}
    for s in range(steps):
        if s == warmup:
            losses["switch"] = held_out_loss(db)
            bytes_warm = db.comm_stats["bytes_last_step"]
        train_step(db, ob, *regression(s, rank))
    losses["end"] = held_out_loss(db)
    out = {
        "losses": losses,
        "spread": spread_across_ranks(db),
        "bytes_warm": bytes_warm,
        "bytes_compressed": db.comm_stats["bytes_last_step"],
    }

    # The algorithm keeps no momentum of its own (it reads the optimizer's exp_avg); a checkpoint from
    # a version that saved a copy of it ("momentum") still loads.
    out["algorithm_state"] = db.algorithm_state.state_dict()
    old = {"momentum": {n: ob.state[p]["exp_avg"].clone() for n, p in db.module.named_parameters()}}
    db.algorithm_state.load_state_dict(old)

    model_state, opt_state = copy.deepcopy(db.state_dict()), copy.deepcopy(ob.state_dict())
    torch.manual_seed(123)
    fresh, fresh_opt = qadam_pair(MLP(hidden=32, depth=4), warmup=warmup)
    fresh.load_state_dict(model_state)
    fresh_opt.load_state_dict(opt_state)
    for s in range(steps, steps + 2):
        train_step(db, ob, *regression(s, rank))
        train_step(fresh, fresh_opt, *regression(s, rank))
    out["round_trip_diff"] = max_diff(db, fresh)
    out["round_trip_momentum"] = all(
        torch.equal(ob.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
        for p, q in zip(db.module.parameters(), fresh.module.parameters())
    )
    out["saved_momentum"] = len(model_state.get("_unison_algorithm", {}).get("state", {}).get("momentum", {}))
    return out


def with_distributed_optimizer():
    """qadam also runs under DistributedOptimizer: past warm-up every rank stays identical."""
    rank = dist.get_rank()
    net = ranks_start_apart()
    opt = unison.DistributedOptimizer(
        unison.QAdamOptimizer(net.parameters(), lr=0.01, warmup_steps=20), net.named_parameters(), algorithm="qadam"
    )
    for s in range(25):
        train_step(net, opt, *regression(s, rank))
    return spread_across_ranks(net)


def qadam_checks():
    return {
        "warmup": warmup_is_adam(),
        "after": after_warmup_and_round_trip(),
        "dopt_spread": with_distributed_optimizer(),
    }


@pytest.fixture(scope="module")
def qadam_results():
    return launch.run(qadam_checks, 2, timeout=90)


def test_qadam_warmup_equals_adam_with_ddp(qadam_results):
    for r in qadam_results:
        assert r["warmup"]["diff"] <= 1e-6


def test_qadam_after_warmup_keeps_replicas_identical_and_learns(qadam_results):
    for r in qadam_results:
        after = r["after"]
        assert after["spread"] == 0.0
        assert after["losses"]["end"] < 0.5 * after["losses"]["switch"]
    assert qadam_results[1]["dopt_spread"] == 0.0


def test_qadam_sends_fewer_bytes_after_warmup(qadam_results):
    after = qadam_results[0]["after"]
    assert 0 < after["bytes_compressed"] < 0.4 * after["bytes_warm"]


def test_qadam_state_round_trip(qadam_results):
    for r in qadam_results:
        after = r["after"]
        assert after["algorithm_state"] == {}
        assert after["saved_momentum"] == 0
        assert after["round_trip_diff"] == 0.0
        assert after["round_trip_momentum"]


def test_unison_train_runs_qadam(tmp_path):
    """`unison train --algorithm qadam` builds its QAdamOptimizer and learns (3 epochs: warm-up, then 8 bits)."""
    out = tmp_path / "q.json"
    proc = subprocess.run(
        [sys.executable, "-m", "unison", "train", "--algorithm", "qadam", "--epochs", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["algorithm"] == "qadam"
    assert summary["test_accuracy"] > 0.9
    assert summary["lr"] == QADAM_LR


# ---- qadam in one process ---------------------------------------------------------


def test_qadam_needs_its_optimizer():
    for optimizer in (None, torch.optim.Adam(MLP().parameters())):
        with pytest.raises(ValueError, match=r"qadam needs .*QAdamOptimizer.*algorithm='qadam'"):
            unison.DataParallel(MLP(), optimizer=optimizer, algorithm="qadam")
    net = MLP()
    partial = unison.QAdamOptimizer(list(net.parameters())[:2])
    with pytest.raises(ValueError, match="does not hold 'layers.1.weight'"):
        unison.DataParallel(net, optimizer=partial, algorithm="qadam")


def test_qadam_optimizer_arguments():
    params = MLP().parameters()
    for kwargs in ({"warmup_steps": 0}, {"warmup_steps": 2.5}, {"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1.0}):
        with pytest.raises(ValueError):
            unison.QAdamOptimizer(params, **kwargs)


def test_qadam_optimizer_alone_is_adam_then_freezes_the_variance():
    torch.manual_seed(0)
    a = MLP()
    b = copy.deepcopy(a)
    oa = torch.optim.Adam(a.parameters(), lr=0.01, foreach=False)
    ob = unison.QAdamOptimizer(b.parameters(), lr=0.01, warmup_steps=3)
    for s in range(3):
        for model, opt in ((a, oa), (b, ob)):
            train_step(model, opt, *batch(s, 0))
    assert max_diff(a, b) <= 1e-7
    frozen = [ob.state[p]["exp_avg_sq"].clone() for p in b.parameters()]
    moments = [ob.state[p]["exp_avg"].clone() for p in b.parameters()]
    before = copy.deepcopy(b)
    train_step(b, ob, *batch(3, 0))
    assert all(torch.equal(v, ob.state[p]["exp_avg_sq"]) for v, p in zip(frozen, b.parameters()))
    assert not all(torch.equal(m, ob.state[p]["exp_avg"]) for m, p in zip(moments, b.parameters()))
    assert max_diff(before, b) > 0
    assert ob.state_dict()["qadam_steps"] == 4
