"""fp16, bf16 and hierarchical allreduce, and switching algorithms mid-training,
on real gloo ranks."""

import copy

import launch
import pytest
import torch
import torch.distributed as dist
from models import MLP, batch
from scenarios import sgd, spread_across_ranks, step

import unison


def relative_gap(a, b) -> float:
    num = sum(((p - q) ** 2).sum().item() for p, q in zip(a.parameters(), b.parameters()))
    den = sum((p**2).sum().item() for p in a.parameters())
    return (num / den) ** 0.5


def against_allreduce(algorithm: str, options: dict, steps: int = 5) -> dict:
    """Train "allreduce" and ``algorithm`` side by side; report their gap and bytes."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP(hidden=64)
    ref = unison.DataParallel(copy.deepcopy(base))
    model = unison.DataParallel(copy.deepcopy(base), algorithm=unison.algorithms.create(algorithm, **options))
    oref, opt = sgd(ref), sgd(model)
    for s in range(steps):
        mine = [(rank, *batch(s, rank))]
        step(ref, oref, mine)
        step(model, opt, mine)
    out = {
        "gap": relative_gap(ref.module, model.module),
        "spread": spread_across_ranks(model.module),
        "bytes": model.comm_stats["bytes_last_step"],
        "ref_bytes": ref.comm_stats["bytes_last_step"],
    }
    model.switch_to("allreduce")  # releases the algorithm's thread, if any
    return out


def low_precision_runs():
    return {name: against_allreduce(name, {}) for name in ("fp16", "bf16")}


def hierarchical_runs():
    return against_allreduce("allreduce", {"hierarchical": True})


def switching():
    """allreduce -> fp16 -> hierarchical -> allreduce, while training goes on."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = unison.DataParallel(MLP())
    opt = sgd(model)
    names, spreads = [], []
    for s, algorithm in enumerate(
        ["fp16", unison.algorithms.create("allreduce", hierarchical=True), "bf16", "allreduce"]
    ):
        step(model, opt, [(rank, *batch(s, rank))])
        model.switch_to(algorithm)
        names.append(model.algorithm.describe())
        spreads.append(spread_across_ranks(model.module))
    step(model, opt, [(rank, *batch(9, rank))])
    spreads.append(spread_across_ranks(model.module))
    try:
        model.switch_to("fp16" if rank == 0 else "bf16")
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return {"names": names, "spreads": spreads, "mismatch": mismatch}


@pytest.fixture(scope="module")
def two_ranks():
    return launch.run(low_precision_runs, 2, timeout=90)


@pytest.mark.parametrize("name, bound", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_low_precision_tracks_allreduce(two_ranks, name, bound):
    for result in (r[name] for r in two_ranks):
        assert 0 < result["gap"] < bound  # compressed, but close
        assert result["spread"] == 0.0
        assert result["bytes"] * 2 == pytest.approx(result["ref_bytes"], rel=0.01)


def test_hierarchical_equals_flat_allreduce_on_simulated_nodes():
    for result in launch.run(hierarchical_runs, 4, env={"UNISON_NODES": "2"}, timeout=120):
        assert result["gap"] < 1e-6
        assert result["spread"] == 0.0
        assert result["bytes"] > 0


def test_switch_algorithms_mid_training():
    results = launch.run(switching, 2, timeout=90)
    for r in results:
        assert r["names"] == [
            "fp16(hierarchical=False)",
            "allreduce(autotune=False, hierarchical=True)",
            "bf16(hierarchical=False)",
            "allreduce(autotune=False, hierarchical=False)",
        ]
        assert all(s == 0.0 for s in r["spreads"])
        assert "fp16(hierarchical=False)" in r["mismatch"] and "bf16(hierarchical=False)" in r["mismatch"]


def test_bad_options():
    with pytest.raises(ValueError, match="hierarchical must be True or False"):
        unison.algorithms.create("allreduce", hierarchical="yes")
    with pytest.raises(ValueError, match="has no option 'rank'"):
        unison.algorithms.create("fp16", rank=2)
