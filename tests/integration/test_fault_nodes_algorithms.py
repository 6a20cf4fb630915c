"""Algorithms on nodes under fault tolerance (issue 29): the hierarchical variants of the gradient
algorithms (nonblocking's too; fp16 shares bf16's code) and of the averaging ones, and DASO, whose
failure domain is a node, on 3 nodes x 2 processes; worker 1 is SIGKILLed before its reduction, its
node leaves and the other two go on over the node layout of the new membership. Gradient algorithms
keep the exact ledger of tests/scripts/ft_ledger.py; averaging ones (sparseloco's too) and qadam
equal replicas."""

from __future__ import annotations

import pytest

from integration.test_fault_nodes import launch
from integration.test_fault_tolerance import DEMO, demo_ledger, redone

NODES = ("--nodes", "3", "--procs-per-node", "2")


def kinds(result: dict) -> list[str]:
    return [kind for _, kind, _ in result["events"]]


@pytest.mark.parametrize(
    "algorithm",
    [
        "allreduce:hierarchical=True",
        "bytegrad:hierarchical=True",
        "powersgd:hierarchical=True",
        "nonblocking:hierarchical=True",
    ],
)
def test_a_hierarchical_gradient_algorithm_keeps_the_ledger_exact_across_a_node_failure(tmp_path, algorithm):
    code, err, found = launch(tmp_path / "out", NODES, "--algorithm", algorithm, "--kill", "1@10")
    assert code == 0, err[-3000:]
    assert sorted(found) == [2, 3, 4, 5], err[-3000:]
    for result in found.values():
        assert result["step"] == 40 and result["world"] == 4
        assert result["w"] == [-1.0] * 40, result["w"]
        assert {"failure", "regroup", "redo"} <= set(kinds(result))
        rank = result["members"].index(result["id"])
        assert result["topology"] == [rank % 2, 2, rank // 2]  # two nodes of two: the levels have two nodes


@pytest.mark.parametrize(
    "algorithm",
    [
        "diloco:hierarchical=True",
        "local_sgd:hierarchical=True,period=4",
        "daso",
        "qadam:hierarchical=True",
        "sparseloco:hierarchical=True,period=4",
    ],
)
def test_a_node_aware_averaging_algorithm_goes_on_with_equal_replicas(tmp_path, algorithm):
    """Equal replicas and a finished run (qadam's Adam step makes no ledger: its weights are checked
    equal, as its flat form's in test_fault_tolerance.py)."""
    code, err, found = launch(tmp_path / "out", NODES, "--algorithm", algorithm, "--kill", "1@10", "--average-at-end")
    assert code == 0, err[-3000:]
    assert sorted(found) == [2, 3, 4, 5], err[-3000:]
    first = found[2]
    for result in found.values():
        assert result["step"] == 40 and result["world"] == 4
        assert result["w"] == pytest.approx(first["w"], abs=1e-6)
    assert "regroup" in kinds(first)


def test_hierarchical_demo_redoes_the_interrupted_round_from_each_shard_s_momentum_before_it(tmp_path):
    """Hierarchical DeMo: each node's mean gradient is folded, shard by shard, into the momentum its
    local ranks keep; only the top-k crosses nodes. Node 0 goes at step 10: the surviving nodes'
    broken round is done again from each shard's momentum as it was before it, so the run is flat
    DeMo over nodes whose gradient is their mean (a worker between steps then adds nothing)."""
    code, err, found = launch(
        tmp_path / "out", NODES, "--algorithm", f"{DEMO},hierarchical=true", "--square", "--ramp", "--kill", "1@10"
    )
    assert code == 0, err[-3000:]
    assert sorted(found) == [2, 3, 4, 5], err[-3000:]
    step, idle = redone(found[2])
    assert step is not None
    rounds = []
    for s in range(40):
        nodes = [1, 2] if s >= step else [0, 1, 2]
        factor = {
            n: sum(0.0 if s == step and i in idle else (i + 1) ** 2 for i in (2 * n, 2 * n + 1)) / 2 for n in nodes
        }
        rounds.append(("demo", factor))
    expected = demo_ledger(40, rounds, chunk=4, topk=1, beta=0.5)
    for result in found.values():
        assert result["w"] == found[2]["w"]  # equal replicas
        assert redone(result) == (step, idle)
    assert found[2]["w"] == pytest.approx(expected, rel=1e-5, abs=1e-4)
