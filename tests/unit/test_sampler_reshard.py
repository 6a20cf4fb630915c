"""ShardSampler.reshard: the rest of an epoch re-dealt over a new membership (what fault
tolerance calls after every change), one process playing every rank in lockstep."""

from __future__ import annotations

import pytest

import unison


def batches(iterators, ranks, n):
    """Each of ``ranks`` takes one batch of ``n`` indices, in lockstep."""
    return {r: [next(iterators[r]) for _ in range(n)] for r in ranks}


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_failure_re_deals_the_rest_of_the_epoch_without_repeats(drop_last):
    data = list(range(101))
    samplers = [unison.ShardSampler(data, num_replicas=3, rank=r, seed=5, drop_last=drop_last) for r in range(3)]
    for s in samplers:
        s.set_epoch(2)
    iterators = [iter(s) for s in samplers]
    done = [i for batch in batches(iterators, (0, 1, 2), 4).values() for i in batch]
    in_flight = batches(iterators, (0, 1, 2), 4)
    lost = in_flight.pop(1)  # rank 1 dies with its batch in hand; the others' batches are applied
    done += in_flight[0] + in_flight[2]
    assert "left, dealt over 2" in samplers[0].reshard(0, 2)
    assert "left, dealt over 2" in samplers[2].reshard(1, 2)  # the old rank 2 is rank 1 now
    rest = [list(iterators[0]), list(iterators[2])]
    assert len(rest[0]) == len(rest[1])  # equal shards: the same number of steps on every member
    everything = done + rest[0] + rest[1]
    left = 101 - 24
    if drop_last:
        assert len(everything) == len(set(everything)) == 24 - 4 + left - left % 2  # no index twice
    else:
        assert len(everything) == 24 - 4 + left + left % 2  # padded with one repeat, as an epoch's end is
        assert len(set(everything)) == 24 - 4 + left
    assert len(set(data) - set(everything) - set(lost)) <= 1  # the lost batch, and a cut tail


def test_a_joiner_takes_the_position_and_the_same_deal():
    data = list(range(60))
    members = {r: unison.ShardSampler(data, num_replicas=2, rank=r, seed=1, drop_last=True) for r in range(2)}
    for s in members.values():
        s.set_epoch(0)
    iterators = {r: iter(s) for r, s in members.items()}
    first = [next(iterators[r]) for _ in range(6) for r in (0, 1)]
    for r, s in members.items():
        s.reshard(r, 3)
    joiner = unison.ShardSampler(data, num_replicas=3, rank=2, seed=1, drop_last=True)
    joiner.load_state_dict(members[0].state_dict())  # what the heal carries
    joiner.set_epoch(0)  # the members' epoch: the healed position is kept
    rest = [list(iterators[0]), list(iterators[1]), list(joiner)]
    assert len({len(r) for r in rest}) == 1
    flat = first + [i for r in rest for i in r]
    assert len(flat) == len(set(flat)) == 60


def test_reshard_between_epochs_applies_to_the_next_pass():
    s = unison.ShardSampler(list(range(10)), num_replicas=2, rank=1, seed=0)
    s.set_epoch(0)
    list(s)
    assert "next pass" in s.reshard(0, 1) or "left" in s.reshard(0, 1)
    s.set_epoch(1)
    assert sorted(s) == list(range(10)) and len(s) == 10


def test_reshard_refuses_a_rank_outside_the_world():
    s = unison.ShardSampler(list(range(10)), num_replicas=2, rank=1)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        s.reshard(2, 2)
