"""unison.compat.bagua: Bagua's documented API on real gloo ranks.

The ModelSwitchWrapper example follows unison's allreduce -> decentralized ->
allreduce switches exactly; every DistributedAlgorithm member follows its
unison algorithm; each documented argument is seen to act (or refused where
unison lacks it); autotuning follows the scores the ranks report, agreed."""

from __future__ import annotations

import os
import warnings

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, BNNet, batch, image_batch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import unison

STEPS = 4


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def spread(t: torch.Tensor) -> float:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def train(model, optimizer, steps=STEPS, start=0, data=batch):
    rank = dist.get_rank()
    for s in range(start, start + steps):
        x, y = data(s, rank)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def native(stages, make=MLP, **dp_kwargs) -> torch.Tensor:
    """unison.DataParallel switched through ``stages`` (algorithms), STEPS steps each."""
    torch.manual_seed(0)
    net = make()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = unison.DataParallel(net, optimizer=opt, algorithm=stages[0], **dp_kwargs)
    for i, stage in enumerate(stages):
        if i:
            model.switch_to(stage)
        train(model, opt, start=i * STEPS)
    return flat(net)


def bagua_run(member, **kwargs):
    from unison.compat.bagua.torch_api.distributed import bagua_init

    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = bagua_init(net, opt, member, **kwargs)
    train(model, optimizer)
    return model, flat(net)


def count_buckets(model, optimizer) -> int:
    """Buckets reduced in one backward, seen by a torch comm hook."""
    seen = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model.bagua_module.register_comm_hook(None, hook)
    train(model, optimizer, steps=1, start=50)
    return len(seen)


def check_bagua() -> dict:
    # The imports a Bagua script changes; the rest is Bagua's.
    from unison.compat.bagua import torch_api as bagua
    from unison.compat.bagua.bagua_define import DistributedAlgorithm
    from unison.compat.bagua.torch_api.distributed import (
        ModelSwitchWrapper,
        allreduce_parameters,
        bagua_init,
        broadcast_parameters,
    )

    bagua.init_process_group()
    rank = bagua.get_rank()
    out = {"ranks": (bagua.get_rank(), bagua.get_world_size(), bagua.get_local_rank(), bagua.get_local_size())}
    create = unison.algorithms.create

    # ModelSwitchWrapper's own example: allreduce A steps, decentralize B, allreduce again.
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ModelSwitchWrapper(
            model=model,
            optimizer=optimizer,
            broadcast_buffers=True,
            delay_reduce=False,
            hierarchical_reduce=None,
            message_size=10_000_000,
        ).switch_to(DistributedAlgorithm.GradientAllReduce)
        out["is_wrapper"] = type(model).__name__
        train(model, optimizer)
        model.switch_to(DistributedAlgorithm.Decentralize)
        decentralized = model.bagua_module.algorithm
        train(model, optimizer, start=STEPS)
        again = model.switch_to(DistributedAlgorithm.GradientAllReduce)
        train(model, optimizer, start=2 * STEPS)
    out["returns_self"] = again is model
    out["stage"] = model.stage
    out["flat_warning"] = [str(w.message) for w in caught if "hierarchical" in str(w.message)]
    out["decentralized_options"] = (decentralized.name, dict(decentralized.options))
    stages = [
        create("allreduce"),
        create("decentralized", peer_selection="all", communication_interval=1),
        create("allreduce"),
    ]
    out["example_gap"] = (flat(model.unwrap()) - native(stages)).abs().max().item()
    out["unwrap"] = model.unwrap() is model.module
    out["state_keys"] = sorted(model.state_dict()) == sorted(model.unwrap().state_dict())

    # bagua_init: (model, optimizer), each member on its unison algorithm.
    m, x = bagua_run(DistributedAlgorithm.GradientAllReduce)
    out["default"] = (m.bagua_module.algorithm.name, m.bagua_module.algorithm.options["hierarchical"])
    out["allreduce_gap"] = (x - native([create("allreduce")])).abs().max().item()
    m, x = bagua_run("sg-allreduce")
    out["sg"] = (m.bagua_module.algorithm.name, m.bagua_module.algorithm.options["hierarchical"])
    out["sg_gap"] = (x - native([create("allreduce", hierarchical=True)])).abs().max().item()
    m, x = bagua_run(DistributedAlgorithm.QuantizeAllReduce, hierarchical_reduce=False, error_feedback=True)
    out["quantize"] = (m.bagua_module.algorithm.name, m.bagua_module.algorithm.options["error_feedback"])
    out["quantize_gap"] = (x - native([create("bytegrad", error_feedback=True)])).abs().max().item()
    m, x = bagua_run(DistributedAlgorithm.QuantizeAllReduce, error_feedback=True)  # Bagua's rule: hierarchical
    out["quantize_hier"] = m.bagua_module.algorithm.options["hierarchical"]
    # one node: nothing crosses nodes, the hierarchical reduction runs flat
    out["quantize_hier_gap"] = (x - native([create("bytegrad", error_feedback=True)])).abs().max().item()
    m, x = bagua_run(
        DistributedAlgorithm.Decentralize,
        hierarchical_reduce=False,
        peer_selection_mode="shift_one",
        communication_interval=3,
    )
    out["decentralize"] = dict(m.bagua_module.algorithm.options)
    out["decentralize_gap"] = (
        (x - native([create("decentralized", peer_selection="shift_one", communication_interval=3)])).abs().max().item()
    )
    out["decentralize_spread"] = spread(x)  # 4 steps, mixing every 3rd: the replicas differ
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    m, o = bagua_init(net, opt, DistributedAlgorithm.GradientAllReduce, hierarchical_reduce=True, delay_reduce=True)
    out["same_optimizer"] = o is opt
    out["hier_delay"] = (m.bagua_module.algorithm.options["hierarchical"], m.bagua_module.delay_reduce)

    # What unison lacks is named, never ignored.
    for name, kwargs in (
        ("decentralize_hier", dict(distributed_algorithm=DistributedAlgorithm.Decentralize, hierarchical_reduce=True)),
        ("leader", dict(hierarchical_reduce=True, intra_comm_root_rank=1)),
    ):
        try:
            m, _ = bagua_init(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), **kwargs)
            out[name] = ("works", dict(m.bagua_module.algorithm.options))
        except NotImplementedError as exc:
            out[name] = ("not implemented", str(exc))
    m, _ = bagua_init(
        MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), intra_comm_root_rank=1
    )  # no hierarchy: no leader
    out["leader_flat"] = m.bagua_module.algorithm.options["hierarchical"]
    with pytest.raises(ValueError, match="intra_comm_root_rank"):
        ModelSwitchWrapper(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), intra_comm_root_rank=2)
    with pytest.raises(TypeError, match="fusion"):
        ModelSwitchWrapper(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), fusion=True)
    with pytest.raises(RuntimeError, match="switch_to"):
        ModelSwitchWrapper(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1))(torch.zeros(1, 16))

    # message_size: the minimum bytes of a bucket. One byte: one bucket per parameter.
    for size in (1, 10_000_000):
        torch.manual_seed(0)
        net = MLP()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        m, _ = bagua_init(net, opt, message_size=size)
        train(m, opt, steps=2)
        out[f"buckets_{size}"] = count_buckets(m, opt)

    # broadcast_buffers: buffers kept equal to rank 0's, or left to each rank.
    for flag in (True, False):
        torch.manual_seed(0)
        net = BNNet()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        m, _ = bagua_init(net, opt, broadcast_buffers=flag)
        train(m, opt, data=image_batch)
        out[f"buffers_{flag}"] = spread(torch.cat([b.float().reshape(-1) for b in net.buffers()]))

    # broadcast_parameters / allreduce_parameters on a plain module.
    torch.manual_seed(rank)
    net = BNNet()
    with torch.no_grad():
        net.bn.running_mean.fill_(float(rank))
    broadcast_parameters(net, broadcast_buffers=False)
    out["broadcast_params"] = spread(flat(net))
    out["buffers_untouched"] = net.bn.running_mean[0].item()
    broadcast_parameters(net)
    out["broadcast_buffers"] = net.bn.running_mean[0].item()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float(rank))
        net.bn.running_var.fill_(float(2 * rank))
    allreduce_parameters(net)
    out["allreduced"] = (flat(net).unique().tolist(), net.bn.running_var.unique().tolist())

    # Autotuning driven by reported scores: rank 0 and 1 disagree, their mean decides.
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    m, _ = bagua_init(net, opt)

    def score(size, hierarchical):  # best: 4 MB, hierarchical
        return 100.0 - abs(size - 4_000_000) / 1e6 + (5.0 if hierarchical else 0.0)

    tried, answers = [], []
    for i in range(10):
        setting = (m.message_size, m.bagua_module.algorithm.options["hierarchical"])
        tried.append(setting)
        bias = 50.0 * i * (1 if rank == 0 else -1)  # opposite per rank: only the mean is meaningful
        m.report_metrics([score(*setting) + bias] * 3)
        answers.append(m.ask_and_update_hyperparameters())
        train(m, opt, steps=1, start=100 + i)
    out["tried"] = tried
    out["answers"] = answers
    out["tuned"] = (
        m.message_size,
        m.bagua_module.algorithm.options["hierarchical"],
        m.bagua_module.bucket_cap_mb,
        m.autotune_flag,
    )
    out["tuned_spread"] = spread(flat(net))

    # BAGUA_AUTOTUNE: the forward itself reports the measured speed every AUTOTUNE_CYCLE steps.
    from unison.compat.bagua.torch_api import distributed

    os.environ["BAGUA_AUTOTUNE"] = "1"
    distributed.AUTOTUNE_CYCLE = 2
    try:
        torch.manual_seed(0)
        net = MLP()
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        m, _ = bagua_init(net, opt)
        flags = [m.autotune_flag]
        train(m, opt, steps=20, start=200)
        flags.append(m.autotune_flag)
        setting = torch.tensor([float(m.message_size), float(m.bagua_module.algorithm.options["hierarchical"])])
        out["auto"] = (flags, m.step_counter, spread(setting), spread(flat(net)))
    finally:
        del os.environ["BAGUA_AUTOTUNE"]
        distributed.AUTOTUNE_CYCLE = 100
    return out


@pytest.fixture(scope="module")
def results():
    return launch.run(check_bagua, 2, timeout=150)


def test_model_switch_wrapper_example_follows_unison_switches(results):
    for r in results:
        assert r["is_wrapper"] == "ModelSwitchWrapper"
        assert r["returns_self"] and r["stage"] == 3
        assert r["decentralized_options"][0] == "decentralized"
        assert r["decentralized_options"][1]["peer_selection"] == "all"
        assert r["example_gap"] == 0.0
        assert r["unwrap"] and r["state_keys"]
    assert sorted(r["ranks"] for r in results) == [(0, 2, 0, 2), (1, 2, 1, 2)]


def test_each_member_runs_its_unison_algorithm(results):
    for r in results:
        assert r["default"] == ("allreduce", False)
        assert r["allreduce_gap"] == 0.0
        assert r["sg"] == ("allreduce", True) and r["sg_gap"] == 0.0
        assert r["quantize"] == ("bytegrad", True) and r["quantize_gap"] == 0.0
        assert r["quantize_hier"] is True and r["quantize_hier_gap"] == 0.0
        d = r["decentralize"]
        assert (d["peer_selection"], d.get("communication_interval", d.get("period"))) == ("shift_one", 3)
        assert r["decentralize_gap"] == 0.0 and r["decentralize_spread"] > 0.0
        assert r["same_optimizer"] and r["hier_delay"] == (True, True)


def test_what_unison_lacks_is_named(results):
    for r in results:
        status, detail = r["decentralize_hier"]  # hierarchical: the node first, gossip between nodes
        assert status == "works" and detail["hierarchical"] is True
        assert r["flat_warning"] == []  # Bagua's default (hierarchical) Decentralize: one node, flat, silently
        status, detail = r["leader"]  # unison's hierarchical reduction has no leader: any root works
        assert status == "works" and detail["hierarchical"] is True
        assert r["leader_flat"] is False


def test_message_size_and_broadcast_buffers_act(results):
    for r in results:
        assert r["buckets_1"] == 6  # every parameter closes its own bucket
        assert r["buckets_10000000"] == 1
        assert r["buffers_True"] == 0.0
        assert r["buffers_False"] > 0.0


def test_broadcast_and_allreduce_parameters(results):
    for r in results:
        assert r["broadcast_params"] == 0.0
        assert r["broadcast_buffers"] == 0.0
        assert r["allreduced"] == ([0.5], [1.0])
    assert sorted(r["buffers_untouched"] for r in results) == [0.0, 1.0]


def test_autotuning_follows_the_agreed_scores(results):
    mb = 1024 * 1024
    first = results[0]
    for r in results:
        assert r["tried"] == first["tried"]  # the same settings on every rank
        assert r["tuned"] == (4_000_000, True, 4_000_000 / mb, False)
        assert r["tuned_spread"] == 0.0
        assert r["answers"][:5] == [True] * 5 and not any(r["answers"][5:])
        flags, steps, setting_spread, weights_spread = r["auto"]
        assert flags == [True, False] and steps == 20
        assert setting_spread == 0.0 and weights_spread == 0.0
    sizes = [s for s, _ in first["tried"][:5]]
    assert sizes == [10_000_000, 1_000_000, 4_000_000, 25_000_000, 64_000_000]
    assert first["tried"][5] == (4_000_000, True)


def test_distributed_algorithm_enum():
    from unison.compat.bagua.bagua_define import DistributedAlgorithm

    assert [m.value for m in DistributedAlgorithm] == ["allreduce", "sg-allreduce", "decentralize", "quantize"]
    assert DistributedAlgorithm.from_str("decentralize") is DistributedAlgorithm.Decentralize
    assert DistributedAlgorithm("quantize") is DistributedAlgorithm.QuantizeAllReduce
    with pytest.raises(ValueError, match="sg-allreduce"):
        DistributedAlgorithm.from_str("gossip")
