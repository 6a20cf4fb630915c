"""unison's "allreduce" gives the same parameters as torch DDP and as one
process given the combined batch, in every situation DDP users meet."""

import launch
import pytest
from scenarios import SCENARIOS, run_scenarios

# Largest parameter difference allowed against DDP and against the single-process reference.
TOLERANCE = {"autocast": (1e-6, 5e-2), "torch_fp16_hook": (1e-6, 5e-3)}
DEFAULT = (1e-6, 1e-5)
NO_REFERENCE = {"state_dict_keys"}
# With negotiate_grads=False a parameter no rank used gets a zero gradient instead of None.
NONE_DIFFERS = {"negotiate_off"}


@pytest.fixture(scope="module")
def two_ranks():
    rank0, rank1 = launch.run(run_scenarios, 2, list(SCENARIOS), timeout=400)
    return rank0, rank1


@pytest.fixture(scope="module")
def three_ranks():
    return launch.run(run_scenarios, 3, ["plain", "branch_changes_each_step", "no_sync"], timeout=200)


def _check(result, name):
    assert "error" not in result, result.get("error")
    if name in NO_REFERENCE:
        return
    vs_ddp, vs_ref = TOLERANCE.get(name, DEFAULT)
    assert result["ddp"] <= vs_ddp, f"differs from torch DDP by {result['ddp']}"
    assert result["ref"] <= vs_ref, f"differs from the single-process reference by {result['ref']}"
    if name not in NONE_DIFFERS:
        assert result["grads_none_match"], "a parameter has grad None in one and not the other"
    assert result["spread"] == 0.0, f"replicas disagree by {result['spread']}"


@pytest.mark.parametrize("name", [n for n in SCENARIOS])
def test_same_as_ddp(two_ranks, name):
    for result in (r[name] for r in two_ranks):
        _check(result, name)


@pytest.mark.parametrize("name", ["plain", "branch_changes_each_step", "no_sync"])
def test_three_ranks(three_ranks, name):
    for r in three_ranks:
        _check(r[name], name)


def test_grads_live_in_buckets(two_ranks):
    assert all(r["plain"]["views"] for r in two_ranks)


def test_small_buckets_are_many(two_ranks):
    assert two_ranks[0]["many_buckets"]["buckets"] >= 4


def test_pfn_hook_sees_local_gradients_once_per_step(two_ranks):
    for r in two_ranks:
        assert r["pfn_hook"]["hook_calls"] == 4
        assert r["pfn_hook"]["hook_saw_local"]


def test_custom_functions_are_used(two_ranks):
    calls = two_ranks[0]["custom_functions"]["calls"]
    assert calls["reduce"] >= 4  # at least one bucket per step
    assert calls["broadcast"] >= 1 + 4  # construction, then buffers every step


def test_unused_everywhere_keeps_none(two_ranks):
    assert two_ranks[0]["unused_everywhere"]["grads_none_match"]


def test_negotiate_off_gives_zero_grads(two_ranks):
    assert all(r["negotiate_off"]["never_grad_zero"] for r in two_ranks)


def test_batchnorm_buffers_match_ddp_on_rank0(two_ranks):
    assert two_ranks[0]["batchnorm"]["buffers_vs_ddp_rank0"] == 0.0


def test_state_dict(two_ranks):
    for r in two_ranks:
        assert r["state_dict_keys"]["keys_match"]
        assert r["state_dict_keys"]["loaded"]


def test_buckets_replanned_from_real_gradient_order(two_ranks):
    result = two_ranks[0]["replanned"]
    assert result["plan_before"][0][0] == "inp.bias"  # reverse registration order
    assert result["plan_after"][0][:2] == ["out.bias", "out.weight"] or result["plan_after"][0][:2] == [
        "out.weight",
        "out.bias",
    ]
    assert result["plan_after"] == two_ranks[1]["replanned"]["plan_after"]
