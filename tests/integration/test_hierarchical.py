"""Hierarchical gradient algorithms on 4 gloo ranks as 2 nodes x 2 processes (``UNISON_NODES=2``):
reduce-scatter inside the node, each shard across nodes by the algorithm's scheme, all-gather.

Without compression hierarchical equals allreduce; PowerSGD is linear in the gradients it
averages, so its hierarchical run equals its flat one; with a lossy codec the node's sum is
what is compressed (checked bit for bit on the seam itself). Replicas stay identical, the
algorithm's state round-trips, and a run switches between flat and hierarchical."""

from __future__ import annotations

import copy
import os
import warnings

import launch
import pytest
import torch
import torch.distributed as dist
from models import MLP, batch
from scenarios import max_diff, sgd, spread_across_ranks, step

import unison
from unison.engine.exchange import Exchange, wire_bytes_8bit
from unison.engine.hierarchy import TwoLevel, aligned_bounds, even_bounds

NODES = {"UNISON_NODES": "2"}
#: name -> (flat options, the largest relative gap to allreduce after STEPS steps)
GRADIENT = {
    "allreduce": ({}, 1e-6),
    "nonblocking": ({}, 1e-6),
    "fp16": ({}, 1e-3),
    "bf16": ({}, 1e-2),
    "bytegrad": ({"error_feedback": True, "chunk_size": 64}, 2e-3),
    "powersgd": ({"rank": 2, "start_iter": 1}, 5e-2),
    "qadam": ({}, 0.2),  # against allreduce with QAdamOptimizer: 8-bit momenta after a warm-up of 2
}
STEPS = 5


def relative_gap(a, b) -> float:
    num = sum(((p - q) ** 2).sum().item() for p, q in zip(a.parameters(), b.parameters()))
    return (num / sum((p**2).sum().item() for p in a.parameters())) ** 0.5


def optimizer(name, model):
    if name == "qadam":
        return unison.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
    return sgd(model)


def wrap(name, net, opt, **options):
    return unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create(name, **options))


def side_by_side(name: str, options: dict) -> dict:
    """allreduce, flat ``name`` and hierarchical ``name`` trained on the same batches."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP(hidden=64)
    nets = {k: copy.deepcopy(base) for k in ("ref", "flat", "hier")}
    opts = {k: optimizer(name, n) for k, n in nets.items()}  # the reference: allreduce, the same optimizer
    models = {
        "ref": wrap("allreduce", nets["ref"], opts["ref"]),
        "flat": wrap(name, nets["flat"], opts["flat"], **options),
        "hier": wrap(name, nets["hier"], opts["hier"], hierarchical=True, **options),
    }
    for s in range(STEPS):
        for k, model in models.items():
            step(model, opts[k], [(rank, *batch(s, rank))])
    for model in models.values():
        model.flush()
    out = {
        "to_ref": relative_gap(nets["ref"], nets["hier"]),
        "to_flat": relative_gap(nets["flat"], nets["hier"]),
        "flat_to_ref": relative_gap(nets["ref"], nets["flat"]),
        "spread": spread_across_ranks(nets["hier"]),
        "bytes": models["hier"].comm_stats["bytes_last_step"],
        "flat_bytes": models["flat"].comm_stats["bytes_last_step"],
        "state": models["hier"].algorithm_state,
    }
    out["state"] = type(out["state"]).__name__
    for model in models.values():
        model.switch_to("allreduce")  # stops the algorithms' threads
    return out


def all_gradient_algorithms() -> dict:
    return {name: side_by_side(name, options) for name, (options, _) in GRADIENT.items()}


def node_sum_is_compressed(by_owner: bool) -> dict:
    """The seam itself: the shard a process carries across nodes is its node's sum, compressed.
    ``by_owner``: gloo's first level (a reduce and a broadcast per shard), else reduce-scatter and
    all-gather (what other backends run)."""
    topo = unison.runtime.topology()
    two = TwoLevel(topo.intra_node_group, topo.inter_node_group, topo.local_rank, topo.local_world_size, 2)
    assert two.by_owner  # gloo
    two.by_owner = by_owner
    x = torch.randn(1001, generator=torch.Generator().manual_seed(topo.rank))
    codec = {}

    def eight_bit(shard, offset):
        codec.setdefault("ex", Exchange(shard.numel(), 2, 64, shard.device)).run(shard, topo.inter_node_group)

    out = two.run(x.clone(), eight_bit)
    node = x.clone()
    dist.all_reduce(node, group=topo.intra_node_group)
    lo, hi = two.shard(two.bounds(x.numel()))
    mine = node[lo:hi].clone()
    Exchange(mine.numel(), 2, 64, mine.device).run(mine, topo.inter_node_group)
    everywhere = out.clone()
    dist.broadcast(everywhere, 0)
    total = x.clone()
    dist.all_reduce(total)

    def plain(shard, offset):
        dist.all_reduce(shard, group=topo.inter_node_group)

    return {
        "shard_equal": torch.equal(out[lo:hi], mine),
        "same_everywhere": torch.equal(out, everywhere),
        "plain_gap": (two.run(x.clone(), plain) - total).abs().max().item(),
        "even_gap": (two.run(x[:1000].clone(), plain) - total[:1000]).abs().max().item(),  # equal shards
        "uneven_gap": (two.run(x.clone(), plain, [0, 600, 1001]) - total).abs().max().item(),
        "empty_shard_gap": (two.run(x.clone(), plain, [0, 1001, 1001]) - total).abs().max().item(),
    }


def state_round_trip() -> dict:
    """A hierarchical model's state dict (weights and the algorithm's rank-local state) restores exactly."""
    rank = dist.get_rank()
    out = {}
    for name, options in (("bytegrad", GRADIENT["bytegrad"][0]), ("powersgd", GRADIENT["powersgd"][0])):
        torch.manual_seed(0)
        net = MLP(hidden=64)
        opt = sgd(net)
        model = wrap(name, net, opt, hierarchical=True, **options)
        for s in range(3):
            step(model, opt, [(rank, *batch(s, rank))])
        saved, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        net2 = copy.deepcopy(net)
        opt2 = sgd(net2)
        opt2.load_state_dict(saved_opt)
        restored = wrap(name, net2, opt2, hierarchical=True, **options)
        restored.load_state_dict(saved)
        for s in range(3, 6):
            step(model, opt, [(rank, *batch(s, rank))])
            step(restored, opt2, [(rank, *batch(s, rank))])
        entry = saved["_unison_algorithm"]["state"]
        tensors = entry["residuals"]
        out[name] = {
            "diff": max_diff(net, net2),
            "keys": sorted(entry),
            "residual_nonzero": sorted(k for k, t in tensors.items() if t.abs().sum() > 0),
            "qs": sorted(entry.get("qs", {})),
        }
        model.switch_to("allreduce")
        restored.switch_to("allreduce")
    return out


SWITCHES = [
    ("bytegrad", True, {"error_feedback": True}),
    ("bytegrad", False, {"error_feedback": True}),
    ("powersgd", True, {"rank": 2, "start_iter": 0}),
    ("powersgd", False, {"rank": 2, "start_iter": 0}),
    ("fp16", True, {}),
    ("allreduce", True, {}),
    ("bf16", True, {}),
    ("bf16", False, {}),
]


def switching() -> dict:
    """Flat <-> hierarchical switches mid-run; the replicas stay identical."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP(hidden=64)
    opt = sgd(net)
    model = unison.DataParallel(net, optimizer=opt)
    names, spreads, s = [], [], 0
    for name, hier, options in SWITCHES:
        model.switch_to(unison.algorithms.create(name, hierarchical=hier, **options))
        for _ in range(2):
            step(model, opt, [(rank, *batch(s, rank))])
            s += 1
        names.append(model.algorithm.describe())
        spreads.append(spread_across_ranks(net))
    model.switch_to("allreduce")
    return {"names": names, "spreads": spreads}


def checkpoint_resume(path: str) -> dict:
    """``unison.save`` keeps every rank's share of the codec state: a resumed run goes on exactly."""
    rank = dist.get_rank()
    options = {"rank": 2, "start_iter": 1}
    torch.manual_seed(0)
    net = MLP(hidden=64)
    opt = sgd(net)
    model = wrap("powersgd", net, opt, hierarchical=True, **options)
    for s in range(3):
        step(model, opt, [(rank, *batch(s, rank))])
    unison.save(path, model, opt, step=3)
    torch.manual_seed(1)  # other weights: the checkpoint must restore them
    net2 = MLP(hidden=64)
    opt2 = sgd(net2)
    restored = wrap("powersgd", net2, opt2, hierarchical=True, **options)
    saved = unison.load(path, restored, opt2)
    for s in range(3, 6):
        step(model, opt, [(rank, *batch(s, rank))])
        step(restored, opt2, [(rank, *batch(s, rank))])
    model.switch_to("allreduce")
    restored.switch_to("allreduce")
    return {"step": saved["step"] if saved else None, "diff": max_diff(net, net2)}


def bagua_hierarchical(member: str, native: str, **options) -> dict:
    """Bagua's QuantizeAllReduce and Decentralize are hierarchical by default (Bagua's rule), and
    ``hierarchical_reduce=True`` says so: unison's ``native`` algorithm on its two levels."""
    from unison.compat.bagua.bagua_define import DistributedAlgorithm
    from unison.compat.bagua.torch_api.distributed import bagua_init

    rank = dist.get_rank()
    nets, hierarchical = [], []
    for how in ("default", "true", "native"):
        torch.manual_seed(0)
        net = MLP(hidden=64)
        opt = sgd(net)
        if how == "native":
            model = wrap(native, net, opt, hierarchical=True, **options)
        else:
            flag = {"hierarchical_reduce": True} if how == "true" else {}
            model, _ = bagua_init(net, opt, DistributedAlgorithm[member], **flag)
            state = model.bagua_module.algorithm_state
            hierarchical.append(getattr(state, "levels", None) is not None)
        for s in range(3):
            step(model, opt, [(rank, *batch(s, rank))])
        nets.append(net)
        (model if how == "native" else model.bagua_module).switch_to("allreduce")
    return {"hierarchical": hierarchical, "diff": max(max_diff(nets[0], nets[2]), max_diff(nets[1], nets[2]))}


def optimizer_side() -> dict:
    """DistributedOptimizer runs the same hierarchical reduction as DataParallel."""
    rank = dist.get_rank()
    nets = []
    for side in ("model", "optimizer"):
        torch.manual_seed(0)
        net = MLP(hidden=64)
        alg = unison.algorithms.create("bytegrad", hierarchical=True, error_feedback=True)
        if side == "model":
            opt = sgd(net)
            wrapped = unison.DataParallel(net, optimizer=opt, algorithm=alg)
        else:
            opt = unison.DistributedOptimizer(sgd(net), named_parameters=net.named_parameters(), algorithm=alg)
            wrapped = net
        for s in range(3):
            step(wrapped, opt, [(rank, *batch(s, rank))])
        nets.append(net)
    return {"diff": max_diff(*nets), "spread": spread_across_ranks(nets[1])}


def on_four_ranks() -> dict:
    return {
        "algorithms": all_gradient_algorithms(),
        "seam": {mode: node_sum_is_compressed(mode) for mode in (True, False)},
        "round_trip": state_round_trip(),
        "switching": switching(),
        "resume": checkpoint_resume(os.path.join(os.environ["H_CKPT_DIR"], "run.pt")),
        "bagua": {
            "quantize": bagua_hierarchical("QuantizeAllReduce", "bytegrad"),
            "decentralize": bagua_hierarchical("Decentralize", "decentralized", peer_selection="all", period=1),
        },
        "optimizer_side": optimizer_side(),
    }


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("hierarchical"))
    return launch.run(on_four_ranks, 4, env={**NODES, "H_CKPT_DIR": ckpt}, timeout=600)


def test_checkpoint_resumes_exactly(four):
    for r in four:
        assert r["resume"] == {"step": 3, "diff": 0.0}


def test_distributed_optimizer_reduces_the_same_way(four):
    for r in four:
        assert r["optimizer_side"] == {"diff": 0.0, "spread": 0.0}


def test_bagua_quantize_and_decentralize_are_hierarchical_by_default(four):
    for r in four:
        assert r["bagua"]["quantize"] == {"hierarchical": [True, True], "diff": 0.0}
        assert r["bagua"]["decentralize"] == {"hierarchical": [True, True], "diff": 0.0}


@pytest.mark.parametrize("name", list(GRADIENT))
def test_replicas_identical_and_close_to_allreduce(four, name):
    for r in four:
        result = r["algorithms"][name]
        assert result["spread"] == 0.0, name
        assert result["to_ref"] < GRADIENT[name][1], result
        assert result["bytes"] > 0


def test_bytes_are_both_levels(four):
    # MLP(hidden=64): 5508 float32 values in one bucket, 6 parameters (one flag byte each).
    numel, flags, inside = 5508, 6, 2 * (2 - 1) * 2754 * 4  # reduce-scatter + all-gather of a half
    for r in four:
        a = r["algorithms"]
        # 2 x 2: 2(P-1)/P S + 2(M-1)/M S/P = 1.5 S = 2(N-1)/N S, the flat ring's
        assert a["allreduce"]["bytes"] == a["allreduce"]["flat_bytes"] == inside + 2754 * 4 + flags
        assert a["fp16"]["bytes"] == inside + 2754 * 2 + flags
        assert a["bytegrad"]["bytes"] == inside + wire_bytes_8bit(numel // 2, 2, 64) + flags
        assert a["bytegrad"]["flat_bytes"] == wire_bytes_8bit(numel, 4, 64) + flags


@pytest.mark.parametrize("name", ["allreduce", "nonblocking", "powersgd"])
def test_linear_algorithms_equal_their_flat_run(four, name):
    # no compression, or PowerSGD's power iteration (linear in the averaged gradients, residuals included)
    for r in four:
        assert r["algorithms"][name]["to_flat"] < 1e-5, r["algorithms"][name]


def test_lossy_codecs_stay_near_their_flat_run(four):
    for r in four:
        for name in ("fp16", "bf16", "bytegrad", "qadam"):
            result = r["algorithms"][name]
            assert result["to_flat"] < max(4 * result["flat_to_ref"], 1e-3), (name, result)


def test_the_node_sum_is_what_crosses_nodes(four):
    for r in four:
        for seam in r["seam"].values():
            assert seam["shard_equal"] and seam["same_everywhere"]
            assert seam["plain_gap"] < 1e-5 and seam["even_gap"] < 1e-5
            assert seam["uneven_gap"] < 1e-5 and seam["empty_shard_gap"] < 1e-5


def test_state_round_trips_exactly(four):
    for r in four:
        assert r["round_trip"]["bytegrad"]["diff"] == 0.0
        assert r["round_trip"]["powersgd"]["diff"] == 0.0
        assert r["round_trip"]["powersgd"]["keys"] == ["qs", "residuals", "steps"]
    # The codec state lives where the compression happens: each local rank keeps its own share.
    assert four[0]["round_trip"]["powersgd"]["qs"] != four[1]["round_trip"]["powersgd"]["qs"]
    assert four[0]["round_trip"]["powersgd"]["qs"] == four[2]["round_trip"]["powersgd"]["qs"]


def test_switch_between_flat_and_hierarchical(four):
    for r in four:
        assert all(s == 0.0 for s in r["switching"]["spreads"]), r["switching"]
        assert [("hierarchical=True" in n) for n in r["switching"]["names"]] == [h for _, h, _ in SWITCHES]


def layouts() -> dict:
    """One process per node runs flat with a warning; nodes of different sizes are refused, by every
    hierarchical algorithm (the gradient ones and the model-averaging ones: one check)."""
    rank = dist.get_rank()
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = unison.DataParallel(MLP(), algorithm=unison.algorithms.create("bytegrad", hierarchical=True))
    out["warnings"] = [str(w.message) for w in caught if "hierarchical" in str(w.message)]
    out["flat"] = model.algorithm_state.levels is None
    model.switch_to("allreduce")
    unison.runtime.forget_topology()
    os.environ.update(LOCAL_WORLD_SIZE="3" if rank < 3 else "1", LOCAL_RANK=str(rank if rank < 3 else 0))
    os.environ.pop("UNISON_NODES")
    topo = unison.init()
    out["uniform"] = topo.uniform
    try:
        unison.DataParallel(MLP(), algorithm=unison.algorithms.create("powersgd", hierarchical=True))
        out["uneven"] = None
    except ValueError as exc:
        out["uneven"] = str(exc)
    out["others"] = []
    averaging = ("decentralized", "low_precision_decentralized", "async", "diloco")
    cases = [("daso", {}), ("local_sgd", {"hierarchical": True, "local_period": 2, "period": 4})]
    for name, options in cases + [(name, {"hierarchical": True}) for name in averaging]:
        net = MLP()
        try:
            unison.DataParallel(net, optimizer=sgd(net), algorithm=unison.algorithms.create(name, **options))
            out["others"].append(None)
        except ValueError as exc:
            out["others"].append(str(exc))
    model = unison.DataParallel(MLP(), algorithm="bytegrad")  # flat algorithms still run
    opt = sgd(model)
    step(model, opt, [(rank, *batch(0, rank))])
    out["flat_spread"] = spread_across_ranks(model.module)
    return out


def test_layouts_it_cannot_use():
    for r in launch.run(layouts, 4, env={"UNISON_NODES": "4"}, timeout=120):
        assert r["flat"] and len(r["warnings"]) == 1 and "one process per node" in r["warnings"][0]
        assert r["uniform"] is False
        assert "same number of processes on every node" in r["uneven"] and "[3, 3, 3, 1]" in r["uneven"]
        assert all(m and "same number of processes on every node" in m for m in r["others"]), r["others"]
        assert r["flat_spread"] == 0.0


def test_bounds():
    assert even_bounds(10, 3) == [0, 4, 8, 10]
    assert even_bounds(1, 2) == [0, 1, 1]
    assert aligned_bounds([600, 1, 400], 2) == [0, 600, 1001]
    assert aligned_bounds([1000], 2) in ([0, 0, 1000], [0, 1000, 1000])  # one process carries it
    assert aligned_bounds([5, 5, 5, 5], 4) == [0, 5, 10, 15, 20]
