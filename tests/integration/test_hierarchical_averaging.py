"""Hierarchical model averaging (``hierarchical=True``) on 4 gloo ranks as 2 nodes x 2
(``UNISON_NODES=2``): local_sgd, decentralized, low_precision_decentralized, diloco and
async average inside each node, cross nodes with one shard per local rank, and gather.

Each is checked against a reference that must agree (a hand-written average, or the flat
variant where 2 nodes make them the same), for what it promises about the replicas, its
state dict round trip, switches between flat and hierarchical, and its bytes across nodes.
"""

import copy
import time
import warnings

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import max_diff, spread_across_ranks

import unison
from unison.engine.comm import ring_bytes

NODES = {"UNISON_NODES": "2"}


def spread_in(group, net) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return (hi - lo).abs().max().item()


def wrap(base, spec, **options):
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create(spec, **options))
    return net, opt, model


def step(entries, s):
    x, y = batch(s, dist.get_rank())
    for _net, opt, model in entries:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def shard_nbytes(levels, flats) -> int:
    """Bytes of this process's shards of ``flats``' buffers (one per dtype and device)."""
    return sum(levels.shard_numel(p.flat.numel()) * p.flat.element_size() for p in flats.parts)


def average_in(net, group):
    with torch.no_grad():
        for p in net.parameters():
            dist.all_reduce(p, group=group)
            p.div_(dist.get_world_size(group))


# ---- local_sgd ----------------------------------------------------------------------------------


def local_sgd_against_hand():
    """Hierarchical local_sgd = local steps, the node's average every 2 steps, everyone's every 4."""
    topo = unison.topology()
    torch.manual_seed(0)
    base = MLP()
    hier = wrap(base, "local_sgd", period=4, local_period=2, hierarchical=True, fragments=1, delay=0)
    ref_net = copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.05)
    out = {"gaps": [], "node_spread": [], "spread": []}
    for s in range(8):
        step([hier], s)
        x, y = batch(s, topo.rank)
        ref_opt.zero_grad()
        F.mse_loss(ref_net(x), y).backward()
        ref_opt.step()
        if (s + 1) % 4 == 0:
            average_in(ref_net, None)
        elif (s + 1) % 2 == 0:
            average_in(ref_net, topo.intra_node_group)
        out["gaps"].append(max_diff(hier[0], ref_net))
        out["node_spread"].append(spread_in(topo.intra_node_group, hier[0]))
        out["spread"].append(spread_across_ranks(hier[0]))
    state = hier[2].algorithm_state
    shard = sum(shard_nbytes(state.levels, flats) for flats in state.node_flats)
    out["inter_bytes"], out["expected_inter"] = state.levels.inter_bytes, 2 * ring_bytes(shard, topo.num_nodes)
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    return out


def test_local_sgd_hierarchical_matches_hand_reference():
    for r in launch.run(local_sgd_against_hand, 4, env=NODES, timeout=120):
        assert max(r["gaps"]) < 1e-6, r["gaps"]
        assert r["node_spread"][1] == 0.0 and r["spread"][1] > 0  # the node's own average
        assert r["spread"][3] == 0.0 and r["spread"][7] == 0.0  # everyone's
        # two syncs; each process carries half the model across (a ring over 2 nodes sends its shard once)
        assert r["inter_bytes"] == r["expected_inter"]
        assert r["inter_bytes"] <= 2 * (r["model_bytes"] // 2 + 16)


# ---- decentralized -----------------------------------------------------------------------------


def decentralized_against_flat(peer_selection):
    """With 2 nodes every peer selection mixes the two node means: the flat 'all' round, streamed alike."""
    topo = unison.topology()
    torch.manual_seed(0)
    base = MLP()
    options = {"period": 2, "fragments": 2, "delay": 1}
    hier = wrap(base, "decentralized", peer_selection=peer_selection, hierarchical=True, **options)
    flat = wrap(base, "decentralized", peer_selection="all", **options)
    gaps, node_spreads = [], []
    for s in range(8):
        step([hier, flat], s)
        gaps.append(max_diff(hier[0], flat[0]))
    hier[2].average()
    flat[2].average()
    node_spreads.append(spread_in(topo.intra_node_group, hier[0]))
    return {"gaps": gaps, "final": max_diff(hier[0], flat[0]), "node_spreads": node_spreads}


@pytest.mark.parametrize("peer_selection", ["all", "ring", "shift_one"])
def test_decentralized_hierarchical_matches_flat_all_on_two_nodes(peer_selection):
    for r in launch.run(decentralized_against_flat, 4, peer_selection, env=NODES, timeout=120):
        assert max(r["gaps"]) < 1e-5, r["gaps"]
        assert r["final"] < 1e-5


# ---- low_precision_decentralized ---------------------------------------------------------------


def perturb(net, seed):
    g = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g))


def weights(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def round_trip(spec, steps=3, **options):
    """Train ``steps``, save, restore into a fresh wrapper, train both ``steps`` more: equal to the bit."""
    torch.manual_seed(0)
    base = MLP()
    net, opt, model = wrap(base, spec, **options)
    for s in range(steps):
        step([(net, opt, model)], s)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    fresh = wrap(net, spec, **options)
    fresh[2].load_state_dict(saved["model"])
    fresh[1].load_state_dict(saved["opt"])
    for s in range(steps, 2 * steps):
        step([(net, opt, model), fresh], s)
    return max_diff(net, fresh[0]), saved["model"]["_unison_algorithm"]


def low_precision_rounds():
    topo = unison.topology()
    torch.manual_seed(0)
    net, opt, model = wrap(MLP(), "low_precision_decentralized", period=1, hierarchical=True, fragments=1, delay=0)
    perturb(net, 1)
    mine = weights(net)
    mean = mine.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    opt.zero_grad(set_to_none=True)
    opt.step()  # an idle round: the weights change by the mixing only
    out = {
        "spread": spread_across_ranks(net),  # 2 nodes: both mix the same two public copies
        "node_spread": spread_in(topo.intra_node_group, net),
        "off_mean": (weights(net) - mean).abs().max().item(),
    }
    out["round_trip"], out["state"] = round_trip(
        "low_precision_decentralized", period=2, hierarchical=True, fragments=2, delay=1
    )
    return out


def test_low_precision_decentralized_hierarchical():
    for r in launch.run(low_precision_rounds, 4, env=NODES, timeout=120):
        assert r["spread"] == 0.0 and r["node_spread"] == 0.0
        assert r["off_mean"] < 0.05  # the mean of the two node means, to 8 bits
        assert r["round_trip"] == 0.0
        assert r["state"]["state"]["nodes"]["layout"] == [2, 2, r["state"]["state"]["nodes"]["layout"][2]]


# ---- diloco -----------------------------------------------------------------------------------


def diloco_against_flat():
    """fp32: the hierarchical average of the pseudo-gradients is the flat one (streamed alike);
    int8: replicas equal after every outer step; both: exact state round trip."""
    torch.manual_seed(0)
    base = MLP()
    options = {"period": 4, "fragments": 2, "delay": 1}
    hier = wrap(base, "diloco", hierarchical=True, **options)
    flat = wrap(base, "diloco", **options)
    int8 = wrap(base, "diloco", hierarchical=True, wire_dtype="int8", period=2, fragments=1, delay=0)
    gaps, spreads = [], []
    for s in range(8):
        step([hier, flat, int8], s)
        gaps.append(max_diff(hier[0], flat[0]))
        spreads.append(spread_across_ranks(int8[0]))
    state = int8[2].algorithm_state
    out = {"gaps": gaps, "int8_spreads": spreads, "feedback": state.feedback[0].numel()}
    out["shard"] = state.levels.shards_numel(state.node_flats[0])
    out["round_trip"] = round_trip("diloco", hierarchical=True, **options)[0]
    out["round_trip_int8"] = round_trip("diloco", hierarchical=True, wire_dtype="int8", period=2, delay=1)[0]
    return out


def test_diloco_hierarchical():
    for r in launch.run(diloco_against_flat, 4, env=NODES, timeout=120):
        assert max(r["gaps"]) < 1e-5, r["gaps"]
        assert r["int8_spreads"][1] == 0.0 and r["int8_spreads"][3] == 0.0  # after each outer step
        assert r["int8_spreads"][2] > 0
        assert r["feedback"] == r["shard"]  # the error feedback of this rank's shard only
        assert r["round_trip"] == 0.0 and r["round_trip_int8"] == 0.0


# ---- async ------------------------------------------------------------------------------------


def async_rounds():
    """Rounds with nobody training pull every replica to one value; bytes across nodes are shards."""
    torch.manual_seed(0)
    net, opt, model = wrap(MLP(), "async", sync_interval_ms=5, hierarchical=True)
    for s in range(6):
        step([(net, opt, model)], s)
    state = model.algorithm_state
    thread, start, deadline = state.thread, state.rounds, time.monotonic() + 60
    while state.rounds < start + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    out = {"idle_spread": spread_across_ranks(net), "node_spread": spread_in(unison.topology().intra_node_group, net)}
    model.average()
    per_round = thread.buffers.inter_bytes  # every chunk's shard across the 2 nodes
    out.update(
        rounds=state.rounds, inter=state.levels.inter_bytes, per_round=per_round, spread=spread_across_ranks(net)
    )
    return out


def test_async_hierarchical():
    for r in launch.run(async_rounds, 4, env=NODES, timeout=120):
        assert r["idle_spread"] < 1e-6 and r["node_spread"] < 1e-6
        assert r["spread"] == 0.0
        assert r["rounds"] >= 3 and r["inter"] == r["rounds"] * r["per_round"]


# ---- switches and layouts ---------------------------------------------------------------------


SWITCHES = [
    ("local_sgd", {"period": 2, "local_period": 1, "hierarchical": True}),
    ("decentralized", {"period": 2, "peer_selection": "ring", "hierarchical": True}),
    ("decentralized", {"period": 2, "peer_selection": "ring"}),
    ("low_precision_decentralized", {"period": 2, "hierarchical": True}),
    ("low_precision_decentralized", {"period": 2}),
    ("diloco", {"period": 2, "wire_dtype": "int8", "hierarchical": True}),
    ("diloco", {"period": 2}),
    ("async", {"sync_interval_ms": 5, "hierarchical": True}),
    ("local_sgd", {"period": 2}),
]


def switch_mid_run():
    torch.manual_seed(0)
    net, opt, model = wrap(MLP(), "local_sgd", period=2)
    spreads, s = [], 0
    for name, options in SWITCHES:
        for _ in range(4):
            step([(net, opt, model)], s)
            s += 1
        model.switch_to(unison.algorithms.create(name, **options))
        spreads.append(spread_across_ranks(net))  # a switch averages the replicas
    for _ in range(4):
        step([(net, opt, model)], s)
        s += 1
    model.average()
    spreads.append(spread_across_ranks(net))
    return spreads


def test_switch_between_flat_and_hierarchical_mid_run():
    for spreads in launch.run(switch_mid_run, 4, env=NODES, timeout=180):
        assert max(spreads) < 1e-6, spreads


def one_process_per_node():
    torch.manual_seed(0)
    base = MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hier = wrap(base, "decentralized", hierarchical=True, period=1, fragments=1, delay=0)
    flat = wrap(base, "decentralized", period=1, fragments=1, delay=0)
    for s in range(3):
        step([hier, flat], s)
    return {
        "warned": [str(w.message) for w in caught if "one process per node" in str(w.message)],
        "flat": hier[2].algorithm_state.levels is None,
        "gap": max_diff(hier[0], flat[0]),
    }


def test_one_process_per_node_runs_flat_with_a_warning():
    for r in launch.run(one_process_per_node, 2, env=NODES, timeout=60):
        assert r["warned"] and r["flat"] and r["gap"] == 0.0


def shift_one_on_three_nodes() -> str:
    """shift_one pairs the nodes: 3 nodes of 2 processes are refused at construction, on every rank."""
    net = MLP()
    try:
        unison.DataParallel(
            net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
            algorithm=unison.algorithms.create("decentralized", hierarchical=True, peer_selection="shift_one"),
        )
    except ValueError as exc:
        return str(exc)
    return "built"


def test_shift_one_needs_an_even_number_of_nodes():
    for error in launch.run(shift_one_on_three_nodes, 6, env={"UNISON_NODES": "3"}, timeout=120):
        assert "even number of nodes, got 3" in error, error
