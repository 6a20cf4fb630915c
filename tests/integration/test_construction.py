"""Construction on real process groups: the cross-rank model check, the initial
broadcast, the topology's groups, and DataParallel on a subgroup."""

import copy
import time

import launch
import pytest
import torch
import torch.distributed as dist
from models import MLP, BNNet, batch
from scenarios import max_diff, sgd, spread_across_ranks, step
from torch.nn.parallel import DistributedDataParallel as DDP

import unison


def wrap_and_report(model_kwargs_by_rank, dp_kwargs_by_rank):
    """Wrap a model that may differ by rank; return the error message, if any, and the time taken."""
    rank = dist.get_rank()
    model = MLP(**model_kwargs_by_rank.get(rank, {}))
    start = time.monotonic()
    try:
        unison.DataParallel(model, **dp_kwargs_by_rank.get(rank, {}))
        return None, time.monotonic() - start
    except ValueError as exc:
        return str(exc), time.monotonic() - start


def mismatches():
    return {
        "shape": wrap_and_report({1: {"hidden": 33}}, {}),
        "count": wrap_and_report({1: {"depth": 4}}, {}),
        "setting": wrap_and_report({}, {1: {"bucket_cap_mb": 5}}),
        "same": wrap_and_report({}, {}),
    }


@pytest.fixture(scope="module")
def mismatch_results():
    return launch.run(mismatches, 2, timeout=60, pg_timeout=20)


def test_shape_mismatch_raises_on_every_rank(mismatch_results):
    for rank_result in mismatch_results:
        message, seconds = rank_result["shape"]
        assert "parameter 'layers.0.weight' (shape [32, 16], float32)" in message
        assert "(shape [33, 16], float32) on rank 1" in message
        assert seconds < 10


def test_count_mismatch_names_the_extra_parameter(mismatch_results):
    for rank_result in mismatch_results:
        message, _ = rank_result["count"]
        assert message is not None and "layers.2.weight" in message


def test_setting_mismatch_is_caught(mismatch_results):
    for rank_result in mismatch_results:
        message, _ = rank_result["setting"]
        assert message is not None and "bucket_cap_mb=5" in message


def test_same_model_is_accepted(mismatch_results):
    assert all(r["same"][0] is None for r in mismatch_results)


def broadcast_at_construction():
    torch.manual_seed(dist.get_rank())  # every rank starts different
    model = BNNet()
    with torch.no_grad():
        model.bn.running_mean.fill_(dist.get_rank())
    before = spread_across_ranks(model)
    unison.DataParallel(model)
    return before, spread_across_ranks(model), model.bn.running_mean.tolist()


def test_construction_broadcasts_rank0_state():
    for before, after, running_mean in launch.run(broadcast_at_construction, 2, timeout=60):
        assert before > 0
        assert after == 0.0
        assert running_mean == [0.0] * 4


def topology_and_subgroups():
    topo = unison.init()  # already initialized by the launcher: same object
    rank = topo.rank
    out = {"topo": (topo.rank, topo.world_size, topo.local_rank, topo.local_world_size, topo.node, topo.num_nodes)}
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=topo.intra_node_group)
    out["intra_sum"] = t.item()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=topo.inter_node_group)
    out["inter_sum"] = t.item()

    # DataParallel over a subgroup {1, 2}: group ranks, and the same result as DDP on it.
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        torch.manual_seed(0)
        a = MLP()
        b = copy.deepcopy(a)
        da, db = DDP(a, process_group=sub), unison.DataParallel(b, process_group=sub)
        oa, ob = sgd(a), sgd(b)
        for s in range(3):
            mine = [(rank, *batch(s, rank))]
            step(da, oa, mine)
            step(db, ob, mine)
        out["sub_diff"] = max_diff(a, b)
        out["sub_rank"] = db.rank
    dist.barrier()
    return out


def test_simulated_nodes_and_groups():
    results = launch.run(topology_and_subgroups, 4, env={"UNISON_NODES": "2"}, timeout=90)
    for rank, r in enumerate(results):
        node, local = divmod(rank, 2)
        assert r["topo"] == (rank, 4, local, 2, node, 2)
        assert r["intra_sum"] == sum(range(2 * node, 2 * node + 2))
        assert r["inter_sum"] == local + (local + 2)
    assert results[1]["sub_diff"] == 0.0 and results[2]["sub_diff"] == 0.0
    assert (results[1]["sub_rank"], results[2]["sub_rank"]) == (0, 1)


def test_node_count_must_divide_world():
    with pytest.raises(AssertionError, match="UNISON_NODES=3 does not divide the world of 4"):
        launch.run(topology_and_subgroups, 4, env={"UNISON_NODES": "3"}, timeout=60)
