"""The streamed schedule (Stagger, default_schedule, fragments_of, Streams) and the Streamed algorithms' checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison.algorithms.streaming import Stagger, Streams, default_schedule, fragments_of
from unison.engine.comm import Finished
from unison.events import Dispatcher
from unison.replica import Replica, Standalone

STREAMED = ["local_sgd", "decentralized", "low_precision_decentralized", "diloco"]


# ---- Stagger and default_schedule --------------------------------------------------


@pytest.mark.parametrize("period,fragments", [(8, 4), (5, 2), (6, 6), (7, 1), (9, 4)])
def test_each_fragment_launches_once_per_period_at_its_offset(period, fragments):
    stagger = Stagger(period, fragments, 0)
    offsets = [stagger.offset(f) for f in range(fragments)]
    assert offsets == [(f + 1) * period // fragments % period for f in range(fragments)]
    assert len(set(offsets)) == fragments  # no two fragments sync after the same step
    assert offsets[-1] == 0  # the last fragment syncs on the period's last step
    launches = {f: [s for s in range(1, 3 * period + 1) if f in stagger.launching(s)] for f in range(fragments)}
    for f, steps in launches.items():
        assert len(steps) == 3 and all(s % period == offsets[f] for s in steps)
        assert steps[1] - steps[0] == steps[2] - steps[1] == period
    assert stagger.launching(0) == [] and stagger.launching(-period) == []


def test_a_stagger_refuses_impossible_schedules():
    with pytest.raises(ValueError, match=r"fragments \(5\) must be at most period \(4\)"):
        Stagger(4, 5, 0)
    with pytest.raises(ValueError, match=r"delay \(4\) must be less than period \(4\)"):
        Stagger(4, 2, 4)


@pytest.mark.parametrize(
    "period,fragments,delay,expected",
    [
        (16, None, None, (4, 2)),  # min(4, period) fragments, half the steps between launches
        (8, None, None, (4, 1)),
        (2, None, None, (2, 0)),
        (8, 2, None, (2, 2)),
        (16, None, 0, (4, 0)),
        (10, 3, 5, (3, 5)),  # given values are kept
    ],
)
def test_default_schedule(period, fragments, delay, expected):
    stagger = default_schedule(period, fragments, delay)
    assert (stagger.period, stagger.fragments, stagger.delay) == (period, *expected)


# ---- fragments_of ------------------------------------------------------------------


def test_fragments_are_equal_runs_with_named_views():
    a, b = torch.arange(6.0), torch.arange(2.0) + 10
    runs = fragments_of([("a", a), ("b", b)], 2)
    assert [[n for n, _ in run] for run in runs] == [["a[0:4]"], ["a[4:6]", "b"]]
    assert [sum(t.numel() for _, t in run) for run in runs] == [4, 4]
    runs[1][0][1].fill_(-1)  # a view: writes reach the tensor
    assert a.tolist() == [0, 1, 2, 3, -1, -1]
    whole = runs[1][1][1]  # a tensor inside one run goes whole, as a flat view
    assert whole.data_ptr() == b.data_ptr() and whole.numel() == b.numel()


def test_fragment_sizes_differ_by_at_most_one():
    tensors = [("w", torch.zeros(3, 5)), ("b", torch.zeros(3)), ("v", torch.zeros(4))]
    for count in (2, 3, 4, 7):
        runs = fragments_of(tensors, count)
        sizes = [sum(t.numel() for _, t in run) for run in runs]
        assert len(runs) == count and sum(sizes) == 22 and max(sizes) - min(sizes) <= 1


def test_one_fragment_is_the_tensors_themselves():
    tensors = [("w", torch.zeros(3, 5)), ("b", torch.zeros(3))]
    (run,) = fragments_of(tensors, 1)
    assert [n for n, _ in run] == ["w", "b"] and all(t is u for (_, t), (_, u) in zip(run, tensors))


def test_a_non_contiguous_tensor_goes_whole_where_it_starts():
    t = torch.zeros(4, 3).t()
    runs = fragments_of([("a", torch.zeros(2)), ("t", t)], 2)
    assert [[n for n, _ in run] for run in runs] == [["a", "t"]]  # the second run is left empty
    assert runs[0][1][1] is t


# ---- Streams -----------------------------------------------------------------------


class Recorded:
    """A fake launch and merge: the launch returns the step it ran at, the merge records when it lands."""

    def __init__(self) -> None:
        self.now = 0
        self.launched: list[tuple[int, int]] = []
        self.merged: list[tuple[int, int, object, object]] = []

    def launch(self, f: int):
        self.launched.append((f, self.now))
        return Finished(torch.tensor([float(f), float(self.now)])), f"extra{f}@{self.now}"

    def merge(self, f: int, result, extra) -> None:
        self.merged.append((f, self.now, result.tolist(), extra))

    def run(self, streams: Streams, steps) -> None:
        for s in steps:
            self.now = s
            streams.advance(s)


@pytest.mark.parametrize("delay", [0, 1, 2])
def test_a_sync_merges_delay_steps_after_its_launch(delay):
    rec = Recorded()
    streams = Streams(Stagger(6, 3, delay), rec.launch, rec.merge)
    rec.run(streams, range(1, 13))
    assert rec.launched == [(0, 2), (1, 4), (2, 6), (0, 8), (1, 10), (2, 12)]
    landed = [(f, step) for f, step, _, _ in rec.merged]
    expected = [(f, s + delay) for f, s in rec.launched if s + delay <= 12]
    assert landed == expected
    for f, step, result, extra in rec.merged:  # each merge gets its own launch's result and extra
        assert result == [f, step - delay] and extra == f"extra{f}@{step - delay}"
    assert sorted(streams.inflight) == sorted(f for f, s in rec.launched if s + delay > 12)


def test_finish_merges_every_sync_in_flight():
    rec = Recorded()
    streams = Streams(Stagger(4, 2, 3), rec.launch, rec.merge)
    rec.run(streams, range(1, 5))
    assert [f for f, _ in rec.launched] == [0, 1] and rec.merged == [] and len(streams.inflight) == 2
    rec.now = 99
    streams.finish()
    assert [(f, step) for f, step, _, _ in rec.merged] == [(0, 99), (1, 99)] and not streams.inflight


@pytest.mark.parametrize("redo", [False, True])
def test_abandoned_syncs_are_launched_again_at_the_next_step_only_with_redo(redo):
    """A membership change abandons the syncs in flight (no wait); DiLoCo (redo) launches them
    again at the next step and lands them at once, also across a state-dict round trip."""
    rec = Recorded()
    streams = Streams(Stagger(4, 2, 3), rec.launch, rec.merge, redo=redo)
    rec.run(streams, range(1, 5))
    assert sorted(streams.inflight) == [0, 1] and streams.merged == 0
    streams.abandon()
    assert not streams.inflight
    again = Streams(Stagger(4, 2, 3), rec.launch, rec.merge, redo=redo)
    again.load_state_dict(streams.state_dict())
    rec.launched.clear()
    rec.run(again, [5])
    if redo:
        assert rec.launched == [(0, 5), (1, 5)] and [(f, s) for f, s, _, _ in rec.merged] == [(0, 5), (1, 5)]
        assert again.merged == 2
    else:
        assert rec.launched == [] and rec.merged == [] and again.merged == 0


def test_drop_forgets_syncs_without_merging():
    rec = Recorded()
    streams = Streams(Stagger(4, 2, 3), rec.launch, rec.merge)
    rec.run(streams, range(1, 5))
    streams.drop()
    assert rec.merged == [] and not streams.inflight


def test_syncs_in_flight_are_saved_and_merge_on_schedule_after_a_load():
    rec = Recorded()
    streams = Streams(Stagger(4, 2, 2), rec.launch, rec.merge)
    rec.run(streams, range(1, 4))  # fragment 0 launched at step 2, due at step 4
    saved = streams.state_dict()
    assert [(e["fragment"], e["step"], e["extra"]) for e in saved] == [(0, 2, "extra0@2")]
    streams.inflight[0][1].wait().fill_(-5)  # a reused buffer changes: the saved copy does not
    assert saved[0]["result"].tolist() == [0.0, 2.0]

    resumed_rec = Recorded()
    resumed = Streams(Stagger(4, 2, 2), resumed_rec.launch, resumed_rec.merge)
    resumed.load_state_dict(saved)
    resumed_rec.run(resumed, [4])
    assert resumed_rec.merged == [(0, 4, [0.0, 2.0], "extra0@2")]
    assert resumed_rec.launched == [(1, 4)]  # the next launch is on the same schedule
    assert [e["fragment"] for e in resumed.state_dict()] == [1]


# ---- the Streamed algorithms ---------------------------------------------------------


@pytest.mark.parametrize("name", STREAMED)
def test_streamed_algorithms_refuse_bad_schedules_at_construction(name):
    with pytest.raises(ValueError, match=r"fragments \(3\) must be at most period \(2\)"):
        unison.algorithms.create(name, period=2, fragments=3)
    with pytest.raises(ValueError, match=r"delay \(2\) must be less than period \(2\)"):
        unison.algorithms.create(name, period=2, delay=2)
    schedule = unison.algorithms.create(name, period=8, fragments=2, delay=3).schedule()
    assert (schedule.period, schedule.fragments, schedule.delay) == (8, 2, 3)


def test_diloco_overlap_is_one_fragment_with_a_delay_of_one():
    schedule = unison.algorithms.create("diloco", overlap=True).schedule()
    assert (schedule.period, schedule.fragments, schedule.delay) == (16, 1, 1)
    schedule = unison.algorithms.create("diloco", overlap=True, period=8, fragments=2).schedule()
    assert (schedule.fragments, schedule.delay) == (2, 1)
    assert unison.algorithms.create("diloco", overlap=True, delay=1).schedule().delay == 1
    with pytest.raises(ValueError, match="overlap=True means delay=1"):
        unison.algorithms.create("diloco", overlap=True, delay=0)
    with pytest.raises(ValueError, match=r"delay \(1\) must be less than period \(1\)"):
        unison.algorithms.create("diloco", overlap=True, period=1)


def test_streamed_events_on_a_replica_alone_launch_and_merge_on_schedule():
    """DiLoCo streams even alone (the average of one replica is itself): driven through a
    real Replica and Dispatcher, its fragments launch at their offsets and merge ``delay`` later."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    a, b = torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[1].parameters(), lr=0.1)
    wiring = Standalone([a, b])
    replica = Replica(list(net.named_parameters()), [], [a, b], None, "t", wiring, modules=list(net.modules()))
    events = Dispatcher(unison.algorithms.create("diloco", period=4, fragments=2, delay=1), replica)
    state = events.state
    in_flight = []
    for _ in range(8):
        for opt in (a, b):  # what the wrapper does after each optimizer step
            wiring.clock.record(opt)
            events.after_step(opt)
        in_flight.append(sorted(state.streams.inflight))
    # fragment 0 launches after steps 2 and 6, fragment 1 after 4 and 8; each merges one step later
    assert in_flight == [[], [0], [], [1], [], [0], [], [1]]
    assert state.steps == 8 and replica.steps == 8
    assert state.outer.state  # the merges stepped the outer optimizer
    events.teardown()  # merges what is in flight
    assert not state.streams.inflight


def test_local_sgd_alone_streams_nothing_and_counts_training_steps_only():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    a, b = torch.optim.SGD([net.weight], lr=0.1), torch.optim.SGD([net.bias], lr=0.1)
    wiring = Standalone([a, b])
    replica = Replica(list(net.named_parameters()), [], [a, b], None, "t", wiring)
    events = Dispatcher(unison.algorithms.create("local_sgd", period=2, warmup_steps=1), replica)
    assert events.state.streams is None and events.sync_gradients()  # warming up
    wiring.clock.record(a)
    events.after_step(a)
    assert events.state.steps == 0  # b has not stepped yet
    wiring.clock.record(b)
    events.after_step(b)
    assert events.state.steps == 1 and not events.sync_gradients()
    assert events.state_dict() == {"steps": 1, "in_flight": []}
