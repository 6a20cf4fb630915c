"""DASO's schedule alone (no processes): phases, the skip schedule, the plateau rule
and which batch sends or merges, as HeAT's DASO does them."""

from __future__ import annotations

import math

import pytest

from unison.algorithms.averaging.daso import FIRST_GLOBAL_SKIP, PATIENCE, PendingSync, Plan, Schedule


def skips(s: Schedule) -> tuple[int, int, int]:
    return (s.global_skip, s.local_skip, s.batches_to_wait)


@pytest.mark.parametrize(
    "warmup,cooldown,total,blocking",
    [
        (4, 4, None, [True] * 4 + [False] * 8),  # no total: no cool-down
        (1, 1, 4, [True, False, False, True]),
        (0, 2, 5, [False, False, False, True, True]),
        (2, 0, 3, [True, True, False]),
        (3, 3, 4, [True, True, True, True]),  # warm-up and cool-down overlap
    ],
)
def test_phases(warmup, cooldown, total, blocking):
    s = Schedule(warmup_epochs=warmup, cooldown_epochs=cooldown, total_epochs=total, nodes=2)
    assert [s.blocking_epoch(e) for e in range(len(blocking))] == blocking
    seen = []
    for _ in blocking:
        seen.append(s.global_skip == 0)
        s.end_epoch(1.0)
    assert seen == blocking


def test_entering_the_cycling_phase_sets_heats_first_skips():
    s = Schedule(warmup_epochs=1, cooldown_epochs=0, nodes=2)
    assert skips(s) == (0, 0, 0)
    s.end_epoch(1.0)
    assert skips(s) == (FIRST_GLOBAL_SKIP, 1, 1) == (4, 1, 1)
    assert skips(Schedule(warmup_epochs=0, max_global_skips=2)) == (2, 1, 1)  # capped by max_global_skips


def test_cool_down_sets_every_skip_to_zero():
    s = Schedule(warmup_epochs=0, cooldown_epochs=1, total_epochs=2, nodes=2)
    assert skips(s) == (4, 1, 1)
    s.end_epoch(1.0)
    assert skips(s) == (0, 0, 0)


def test_plateau_needs_patience_plus_one_epochs_without_improvement():
    s = Schedule(stability_level=0.05)
    assert not s.stable(1.0)  # the first loss improves on infinity
    assert s.plateau_best == 1.0
    results = [s.stable(0.96) for _ in range(PATIENCE + 1)]  # 4 % better: under the 5 % bar
    assert results == [False] * PATIENCE + [True]
    assert s.plateau_bad == 0  # the count restarts
    assert not s.stable(0.9) and s.plateau_best == 0.9  # 10 % better: an improvement
    assert not s.stable(0.9) and s.plateau_bad == 1
    assert not s.stable(0.5) and s.plateau_bad == 0  # an improvement restarts the count


def test_plateau_of_a_negative_loss_is_relative_to_its_magnitude():
    s = Schedule(stability_level=0.1)
    s.stable(-1.0)
    assert not s.stable(-1.05) and s.plateau_bad == 1  # 5 % lower: not 10 %
    assert not s.stable(-1.2) and s.plateau_best == -1.2 and s.plateau_bad == 0


def test_skip_schedule_halves_on_a_plateau_then_resets_at_one():
    """The sequence unison's 4-process test sees with a flat averaged loss (HeAT's rule)."""
    s = Schedule(warmup_epochs=0, max_global_skips=8, skip_reduction_factor=2, local_skip_factor=4, nodes=2)
    seen = [skips(s)]
    for _ in range(13):
        s.end_epoch(1.0)
        seen.append(skips(s))
    assert seen == [(4, 1, 1)] * 4 + [(2, 1, 1)] * 3 + [(1, 1, 1)] * 3 + [(8, 2, 2)] * 3 + [(4, 1, 1)]


def test_reset_when_global_skip_reaches_one():
    s = Schedule(warmup_epochs=0, max_global_skips=16, skip_reduction_factor=4, local_skip_factor=2)
    s.global_skip = s.local_skip = s.batches_to_wait = 1
    for _ in range(PATIENCE + 2):
        s.end_epoch(3.0)
    assert skips(s) == (16, 8, 8)  # max_global_skips, and max_global_skips // local_skip_factor twice
    for _ in range(PATIENCE + 1):
        s.end_epoch(3.0)
    assert skips(s) == (4, 2, 7)  # divided by 4, batches_to_wait one less
    tiny = Schedule(warmup_epochs=0, max_global_skips=1, local_skip_factor=4)
    assert skips(tiny) == (1, 1, 1)
    for _ in range(PATIENCE + 2):
        tiny.end_epoch(1.0)
    assert skips(tiny) == (1, 1, 1)  # reset: max(1, 1 // 4)


def test_reduction_keeps_every_skip_at_least_one():
    s = Schedule(warmup_epochs=0, max_global_skips=8, skip_reduction_factor=3)
    s.global_skip, s.local_skip, s.batches_to_wait = 2, 2, 1
    for _ in range(PATIENCE + 2):
        s.end_epoch(1.0)
    assert skips(s) == (1, 1, 1)


def test_a_blocking_epoch_syncs_after_every_batch_in_rotation():
    s = Schedule(warmup_epochs=1, local_size=3, nodes=2)
    plans = [s.end_batch() for _ in range(4)]
    assert plans == [Plan(blocking=0), Plan(blocking=1), Plan(blocking=2), Plan(blocking=0)]
    assert (s.batch, s.batches, s.syncs_blocking, s.syncs_sent) == (4, 4, 4, 0)
    assert s.sync_gradients()


def test_cycling_sends_every_global_skip_batches_and_merges_batches_to_wait_later():
    s = Schedule(warmup_epochs=0, local_size=2, nodes=2)
    s.global_skip, s.local_skip, s.batches_to_wait = 4, 2, 2
    plans, grads = [], []
    for _ in range(9):
        grads.append(s.sync_gradients())
        plans.append(s.end_batch())
    first, second, third = PendingSync(0, 2, 2), PendingSync(1, 2, 6), PendingSync(0, 2, 10)
    assert plans == [
        Plan(send=first),
        Plan(),
        Plan(merge=first),
        Plan(),
        Plan(send=second),
        Plan(),
        Plan(merge=second),
        Plan(),
        Plan(send=third),
    ]
    assert grads == [True, False] * 4 + [True]  # node averaging every local_skip-th batch
    assert s.pending_sync == third and (s.syncs_sent, s.syncs_received) == (3, 2)


def test_batches_to_wait_is_at_most_global_skip():
    s = Schedule(warmup_epochs=0, nodes=2)
    s.global_skip, s.local_skip, s.batches_to_wait = 2, 1, 5
    assert s.end_batch().send == PendingSync(0, 2, 2)
    assert s.end_batch() == Plan()
    assert s.end_batch() == Plan(merge=PendingSync(0, 2, 2), send=PendingSync(0, 2, 4))  # merge, then send


def test_one_node_has_no_global_syncs():
    s = Schedule(warmup_epochs=1, local_size=4, nodes=1)
    assert s.end_batch() == Plan()
    assert s.end_epoch(1.0) is None
    s.local_skip = 2
    assert all(s.end_batch() == Plan() and s.sync_gradients() for _ in range(5))
    assert (s.syncs_sent, s.syncs_blocking, s.batches) == (0, 0, 6)


def test_the_end_of_a_cycling_epoch_drops_the_sync_in_flight_and_blocks_once():
    s = Schedule(warmup_epochs=0, local_size=2, nodes=2)
    s.end_batch()
    assert s.pending_sync is not None
    assert s.end_epoch(None) == 1  # the next group in the rotation
    assert s.pending_sync is None and (s.epoch, s.batch, s.batches, s.syncs_blocking) == (1, 0, 1, 1)
    assert skips(s) == (4, 1, 1) and s.plateau_bad == 0  # no loss: no plateau step
    w = Schedule(warmup_epochs=2, nodes=2)
    assert w.end_epoch(1.0) is None  # a blocking epoch ends already in agreement


def test_state_dict_round_trip():
    s = Schedule(warmup_epochs=0, local_size=2, nodes=2)
    for _ in range(5):
        s.end_batch()
    s.stable(2.0)
    state = s.state_dict()
    assert state["pending_sync"] == {"local_rank": 1, "batches_to_wait": 1, "receive_at": 5}
    assert (state["batch"], state["send_rank"], state["plateau_best"], state["syncs_sent"]) == (5, 0, 2.0, 2)
    t = Schedule(warmup_epochs=0, local_size=2, nodes=2)
    t.load_state_dict(state)
    assert t.state_dict() == state and t.pending_sync == s.pending_sync
    assert math.isinf(Schedule().state_dict()["plateau_best"])
    with pytest.raises(ValueError, match="missing"):
        t.load_state_dict({"epoch": 1})
