"""Local SGD: synchronous warm-up, then periodic weight averaging (flat or per node first)."""

import copy

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import max_diff, spread_across_ranks

import unison


def spread_in(group, model) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return (hi - lo).abs().max().item()


def flat_run():
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    nets = {name: copy.deepcopy(base) for name in ("allreduce", "local_sgd")}
    opts = {k: torch.optim.SGD(n.parameters(), lr=0.05) for k, n in nets.items()}
    alg = unison.algorithms.create("local_sgd", period=3, warmup_steps=2, fragments=1, delay=0)
    models = {
        "allreduce": unison.DataParallel(nets["allreduce"], optimizer=opts["allreduce"]),
        "local_sgd": unison.DataParallel(nets["local_sgd"], optimizer=opts["local_sgd"], algorithm=alg),
    }
    out = {"gap_after_warmup": None, "spreads": []}
    for s in range(8):
        x, y = batch(s, rank)
        for name, model in models.items():
            opts[name].zero_grad()
            F.mse_loss(model(x), y).backward()
            opts[name].step()
        if s == 1:
            out["gap_after_warmup"] = max_diff(nets["allreduce"], nets["local_sgd"])
        out["spreads"].append(spread_across_ranks(nets["local_sgd"]))
    state = models["local_sgd"].state_dict()["_unison_algorithm"]
    out["state"] = state
    fresh = unison.DataParallel(
        copy.deepcopy(base), optimizer=torch.optim.SGD(base.parameters(), lr=0.05), algorithm="local_sgd"
    )
    fresh.load_state_dict(models["local_sgd"].state_dict())
    out["restored_steps"] = fresh.algorithm_state.steps
    models["local_sgd"].average()
    out["after_average"] = spread_across_ranks(nets["local_sgd"])
    out["bytes"] = models["local_sgd"].comm_stats["bytes_total"]
    return out


def sync_is_the_average():
    """A sync step leaves every replica at the mean of the replicas' post-step weights."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(
        net,
        optimizer=opt,
        algorithm=unison.algorithms.create("local_sgd", period=2, warmup_steps=0, fragments=1, delay=0),
    )
    x, y = batch(0, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()  # local step 1: no sync
    x, y = batch(1, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():  # what this rank's weights will be after step 2, before the sync
        expected = [p - 0.05 * p.grad for p in net.parameters()]
        for e in expected:
            dist.all_reduce(e)
            e.div_(dist.get_world_size())
    opt.step()  # local step 2: sync
    return max((p - e).abs().max().item() for p, e in zip(net.parameters(), expected))


def hierarchical_run():
    topo = unison.topology()
    rank = topo.rank
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    alg = unison.algorithms.create(
        "local_sgd", period=4, warmup_steps=0, hierarchical=True, local_period=2, fragments=1, delay=0
    )
    model = unison.DataParallel(net, optimizer=opt, algorithm=alg)
    rows = []
    for s in range(4):
        x, y = batch(s, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        rows.append((spread_in(topo.intra_node_group, net), spread_across_ranks(net)))
    return rows


@pytest.fixture(scope="module")
def flat():
    return launch.run(flat_run, 2, timeout=90)


def test_warmup_is_synchronous_gradient_averaging(flat):
    assert all(r["gap_after_warmup"] == 0.0 for r in flat)


def test_replicas_drift_then_meet_every_period(flat):
    spreads = flat[0]["spreads"]
    assert spreads[0] == spreads[1] == 0.0  # warm-up
    assert spreads[2] > 0 and spreads[3] > 0  # local steps
    assert spreads[4] == 0.0  # 3rd local step: sync
    assert spreads[5] > 0 and spreads[7] == 0.0


def test_state_and_final_average(flat):
    for r in flat:
        assert r["state"]["state"]["steps"] == 8
        assert r["restored_steps"] == 8
        assert r["after_average"] == 0.0
        assert r["bytes"] > 0


def test_sync_is_the_mean_of_the_replicas():
    assert all(d < 1e-6 for d in launch.run(sync_is_the_average, 2, timeout=60))


def test_hierarchical_averages_nodes_first():
    results = launch.run(hierarchical_run, 4, env={"UNISON_NODES": "2"}, timeout=90)
    for rows in results:
        assert rows[0][0] > 0  # step 1: nobody synced
        assert rows[1][0] == 0.0 and rows[1][1] > 0  # step 2: inside nodes only
        assert rows[2][0] > 0
        assert rows[3][1] == 0.0  # step 4: everyone


@pytest.mark.parametrize(
    "options, message",
    [
        ({"period": 0}, "period must be a positive integer"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer of at least 0"),
        ({"hierarchical": True, "local_period": 16}, "local_period .16. must be smaller than period"),
        ({"hierarchical": "yes"}, "hierarchical must be True or False"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        unison.algorithms.create("local_sgd", **options)


def test_needs_an_optimizer():
    with pytest.raises(ValueError, match="needs the optimizer"):
        unison.DataParallel(torch.nn.Linear(2, 2), algorithm="local_sgd")
