"""What a heal carries of an algorithm's state: rank-local entries (error feedback) are not a peer's."""

from __future__ import annotations

import torch

from unison.fault import Plan, rank_local


def test_a_fresh_worker_starts_its_error_feedback_at_zero_and_a_member_keeps_its_own():
    peer = {
        "steps": 7,
        "qs": {"w": torch.ones(2)},
        "residuals": {"w": torch.full((2,), 3.0)},
        "feedback": {0: torch.ones(1)},
    }
    keys = ("residuals", "feedback")  # what an algorithm's Recovery names rank-local
    fresh = rank_local(peer, None, keys)
    assert fresh["steps"] == 7 and torch.equal(fresh["qs"]["w"], torch.ones(2))  # shared: the peer's
    assert torch.equal(fresh["residuals"]["w"], torch.zeros(2)) and torch.equal(fresh["feedback"][0], torch.zeros(1))
    own = {"residuals": {"w": torch.full((2,), -1.0)}}
    member = rank_local(peer, own, keys)
    assert torch.equal(member["residuals"]["w"], torch.full((2,), -1.0)) and torch.equal(
        member["feedback"][0], torch.zeros(1)
    )
    assert torch.equal(peer["residuals"]["w"], torch.full((2,), 3.0))  # the peer's state is left alone


def test_a_member_healed_past_the_gradient_round_it_was_in_drops_its_pending_step():
    """The chaos run of seed 3362362937: a joiner came while rank 1 was still inside the round of
    step 127 that rank 0 had finished. Rank 1 is healed to step 127 and must not also apply its
    pending step (it did, and then ran one step ahead of the others: -2/3 and -4/3 in the ledger)."""
    plan = Plan.of([(127, "idle", 0), (126, "grad", 0), (0, "join", 0)])
    assert (plan.top, plan.source, plan.behind) == ((127, 0), 0, [1, 2])
    assert plan.contributors == [] and plan.overtaken == [1] and plan.idle == []


def test_a_round_some_members_are_in_is_redone_on_them_and_the_others_apply_it():
    plan = Plan.of([(127, "idle", 0), (127, "grad", 0), (126, "grad", 0), (0, "join", 0)])
    assert plan.source == 0 and plan.behind == [2, 3]
    assert plan.contributors == [1] and plan.overtaken == [] and plan.idle == [0]  # rank 2 applies the redo
    assert plan.holders == [0, 1]  # both at the top: each sends a share of the heal


def test_the_heal_comes_in_shards_from_every_member_at_the_top_and_only_those():
    plan = Plan.of([(50, "grad", 2), (50, "grad", 1), (49, "grad", 1), (0, "join", 0), (50, "idle", 2)])
    assert plan.top == (50, 2) and plan.holders == [0, 4] and plan.behind == [1, 2, 3]
    assert Plan.of([(0, "join", 0), (0, "join", 0), (0, "join", 0)]).holders == [0]  # joiners only: the first


def test_only_joiners_left_take_the_state_of_the_first_of_them():
    plan = Plan.of([(0, "join", 0), (0, "join", 0)])
    assert plan.source == 0 and plan.behind == [1] and plan.contributors == [] and plan.overtaken == []


def test_diloco_outer_rounds_decide_who_is_ahead_at_the_same_step():
    plan = Plan.of([(40, "drop", 4), (40, "drop", 5)])
    assert plan.top == (40, 5) and plan.source == 1 and plan.behind == [0]
