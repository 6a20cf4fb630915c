"""What a heal carries of an algorithm's state: rank-local entries (error feedback) are not a peer's."""

from __future__ import annotations

import torch

from unison.fault import rank_local


def test_a_fresh_worker_starts_its_error_feedback_at_zero_and_a_member_keeps_its_own():
    peer = {
        "steps": 7,
        "qs": {"w": torch.ones(2)},
        "residuals": {"w": torch.full((2,), 3.0)},
        "feedback": {0: torch.ones(1)},
    }
    fresh = rank_local(peer, None)
    assert fresh["steps"] == 7 and torch.equal(fresh["qs"]["w"], torch.ones(2))  # shared: the peer's
    assert torch.equal(fresh["residuals"]["w"], torch.zeros(2)) and torch.equal(fresh["feedback"][0], torch.zeros(1))
    own = {"residuals": {"w": torch.full((2,), -1.0)}}
    member = rank_local(peer, own)
    assert torch.equal(member["residuals"]["w"], torch.full((2,), -1.0)) and torch.equal(
        member["feedback"][0], torch.zeros(1)
    )
    assert torch.equal(peer["residuals"]["w"], torch.full((2,), 3.0))  # the peer's state is left alone
