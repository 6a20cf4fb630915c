"""Streamed (staggered, overlapped) syncs of local_sgd, decentralized and diloco on
2 gloo ranks: each checked step by step against the same schedule computed by
hand, checkpoints taken with a sync in flight, average(), the schedule's
arithmetic and the options' errors."""

from __future__ import annotations

import copy

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import max_diff, spread_across_ranks

import unison
from unison.algorithms.streaming import Stagger, default_schedule, fragments_of

PERIOD, FRAGMENTS, DELAY, STEPS = 4, 2, 1, 12


def train_step(model, opt, s, rank):
    x, y = batch(s, rank)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def mean_over_ranks(tensors):
    out = []
    for t in tensors:
        t = t.detach().clone()
        dist.all_reduce(t)
        out.append(t / dist.get_world_size())
    return out


def by_hand(net, opt, rank, merge, launch_values, steps=STEPS):
    """Train ``net`` locally and apply the streamed schedule by hand after every step;
    ``launch_values(f, views)`` is what a sync sends, ``merge(f, views, sent, arrived)`` writes it."""
    frags = [[t for _, t in f] for f in fragments_of(list(net.named_parameters()), FRAGMENTS)]
    stagger, inflight, history = Stagger(PERIOD, FRAGMENTS, DELAY), {}, []
    for s in range(1, steps + 1):
        train_step(net, opt, s, rank)
        with torch.no_grad():
            for f, (launched, sent, arrived) in list(inflight.items()):
                if s - launched >= DELAY:
                    merge(f, frags[f], sent, arrived)
                    del inflight[f]
            for f in stagger.launching(s):
                sent = [v.detach().clone() for v in frags[f]]
                inflight[f] = (s, sent, mean_over_ranks(launch_values(f, frags[f])))
        history.append([p.detach().clone() for p in net.parameters()])
    return history


def check_against_hand(name: str, options: dict) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    net, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    algorithm = unison.algorithms.create(name, period=PERIOD, fragments=FRAGMENTS, delay=DELAY, **options)
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    if name == "diloco":
        snaps = [
            [t.detach().clone() for t in f]
            for f in [[t for _, t in f] for f in fragments_of(list(ref.named_parameters()), FRAGMENTS)]
        ]
        bufs: dict = {}
        lr, m, mixing = algorithm.outer_lr, algorithm.outer_momentum, algorithm.mixing

        def launch_values(f, views):
            return [s - v for s, v in zip(snaps[f], views)]

        def merge(f, views, sent, g):
            bufs[f] = g if f not in bufs else [m * b + gi for b, gi in zip(bufs[f], g)]
            snaps[f] = [s - lr * (gi + m * b) for s, gi, b in zip(snaps[f], g, bufs[f])]
            for v, s, x0 in zip(views, snaps[f], sent):
                v.copy_(mixing * v + (1 - mixing) * s if mixing is not None else s + (v - x0))
    else:

        def launch_values(f, views):
            return views

        def merge(f, views, sent, avg):
            for v, a, x0 in zip(views, avg, sent):
                v.add_(a - x0)

    expected = by_hand(ref, ref_opt, rank, merge, launch_values)
    gaps, spreads = [], []
    for s in range(1, STEPS + 1):
        train_step(model, opt, s, rank)
        gaps.append(max((p - e).abs().max().item() for p, e in zip(net.parameters(), expected[s - 1])))
        spreads.append(spread_across_ranks(net))
    model.average()
    return {"gaps": gaps, "spreads": spreads, "after_average": spread_across_ranks(net)}


CASES = {
    "local_sgd": ("local_sgd", {}),
    "decentralized_all": ("decentralized", {"peer_selection": "all"}),
    "decentralized_ring": ("decentralized", {"peer_selection": "ring"}),
    "diloco_mixing": ("diloco", {"mixing": 0.5}),
    "diloco_keep_local": ("diloco", {}),
    "diloco_int8": ("diloco", {"mixing": 0.5, "wire_dtype": "int8"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
}


@pytest.mark.parametrize("case", sorted(set(CASES) - {"diloco_int8", "low_precision_decentralized"}))
def test_streamed_schedule_matches_the_hand_computation(case):
    for r in launch.run(check_against_hand, 2, *CASES[case], timeout=90):
        assert max(r["gaps"]) < 1e-5, r["gaps"]
        assert max(r["spreads"]) > 0  # the replicas drift between syncs
        assert r["after_average"] == 0.0


def check_resume(name: str, options: dict) -> dict:
    """Save after step 2 (fragment 0's sync in flight), load into a fresh model, go on: the same weights."""
    rank = dist.get_rank()

    def build(seed):
        torch.manual_seed(seed)
        net = MLP()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        algorithm = unison.algorithms.create(name, period=PERIOD, fragments=FRAGMENTS, delay=DELAY, **options)
        return net, opt, unison.DataParallel(net, optimizer=opt, algorithm=algorithm)

    net, opt, model = build(0)
    for s in range(1, 3):
        train_step(model, opt, s, rank)
    in_flight = len(model.algorithm_state.streams.inflight)
    saved, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    fresh_net, fresh_opt, fresh = build(1)
    fresh.load_state_dict(saved)
    fresh_opt.load_state_dict(saved_opt)
    gaps = []
    for s in range(3, 3 + 8):
        train_step(model, opt, s, rank)
        train_step(fresh, fresh_opt, s, rank)
        gaps.append(max_diff(net, fresh_net))
    return {"in_flight": in_flight, "gaps": gaps, "moved": spread_across_ranks(net)}


@pytest.mark.parametrize(
    "case", ["local_sgd", "decentralized_ring", "diloco_mixing", "diloco_int8", "low_precision_decentralized"]
)
def test_checkpoint_with_a_sync_in_flight_resumes_exactly(case):
    for r in launch.run(check_resume, 2, *CASES[case], timeout=90):
        assert r["in_flight"] == 1
        assert max(r["gaps"]) == 0.0, r["gaps"]


def check_int8() -> dict:
    """Streaming diloco with 8-bit pseudo-gradients against the same run in fp32."""
    rank, out = dist.get_rank(), {}
    torch.manual_seed(0)
    base = MLP()
    nets = {}
    for wire in ("fp32", "int8"):
        net = copy.deepcopy(base)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = unison.DataParallel(
            net,
            optimizer=opt,
            algorithm=unison.algorithms.create(
                "diloco", period=PERIOD, fragments=FRAGMENTS, delay=DELAY, wire_dtype=wire
            ),
        )
        for s in range(1, 4 * PERIOD + 1):
            train_step(model, opt, s, rank)
        out[wire] = model.algorithm_state.bytes_sent
        out[f"{wire}_feedback"] = sorted(model.algorithm_state.feedback)
        nets[wire] = net
    out["gap"] = max_diff(nets["fp32"], nets["int8"])
    out["moved"] = max_diff(base, nets["fp32"])
    return out


def test_int8_pseudo_gradients_send_a_quarter_and_stay_close():
    for r in launch.run(check_int8, 2, timeout=90):
        assert 0.25 <= r["int8"] / r["fp32"] < 0.3, r
        assert r["int8_feedback"] == [0, 1] and r["fp32_feedback"] == []
        assert r["gap"] < 0.05 * r["moved"], r


def test_fragments_cover_every_element_once_in_equal_runs():
    for count in (1, 2, 3, 5):
        tensors = [
            ("a", torch.zeros(10)),
            ("b", torch.zeros(3, 4)),
            ("c", torch.zeros(4, 3).t()),
            ("d", torch.zeros(7)),
        ]
        runs = fragments_of(tensors, count)
        assert len(runs) <= count
        for run in runs:
            for _, view in run:
                view.add_(1)
        assert all(bool((t == 1).all()) for _, t in tensors)
        assert any(v is tensors[2][1] for run in runs for _, v in run)  # the non-contiguous one goes whole
    sizes = [
        sum(v.numel() for _, v in run) for run in fragments_of([("w", torch.zeros(100)), ("b", torch.zeros(3))], 4)
    ]
    assert max(sizes) - min(sizes) <= 1


def test_stagger_spreads_the_syncs_over_the_period():
    stagger = Stagger(16, 4, 2)
    assert {s: stagger.launching(s) for s in range(1, 33) if stagger.launching(s)} == {
        4: [0],
        8: [1],
        12: [2],
        16: [3],
        20: [0],
        24: [1],
        28: [2],
        32: [3],
    }
    assert Stagger(16, 1, 0).launching(16) == [0] and Stagger(16, 1, 0).launching(8) == []
    assert (default_schedule(16, None, None).fragments, default_schedule(16, None, None).delay) == (4, 2)
    assert (default_schedule(1, None, None).fragments, default_schedule(1, None, None).delay) == (1, 0)
    assert (default_schedule(3, None, None).fragments, default_schedule(3, None, None).delay) == (3, 0)


def check_lowprec_streamed(fragments: int, delay: int, name: str = "low_precision_decentralized") -> dict:
    """8-bit gossip: replicas drift, rounds pull them together, a regression is learnt."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    algorithm = unison.algorithms.create(name, period=PERIOD, fragments=fragments, delay=delay)
    model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(rank)
    probe = torch.randn(256, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        start = F.mse_loss(net(probe), probe @ teacher).item()
    spreads = []
    for _ in range(1, 61):
        x = torch.randn(16, 16, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x @ teacher).backward()
        opt.step()
        spreads.append(spread_across_ranks(net))
    model.average()
    with torch.no_grad():
        end = F.mse_loss(net(probe), probe @ teacher).item()
    return {"start": start, "end": end, "spreads": spreads, "after_average": spread_across_ranks(net)}


def test_streamed_low_precision_gossip_learns_and_average_settles():
    for r in launch.run(check_lowprec_streamed, 2, FRAGMENTS, DELAY, timeout=90):
        assert r["end"] < 0.6 * r["start"], r
        assert 0 < max(r["spreads"][-20:]) < 2.0
        assert r["after_average"] == 0.0


@pytest.mark.parametrize("name", ["local_sgd", "decentralized", "low_precision_decentralized", "diloco"])
def test_bad_schedules_are_refused_at_construction(name):
    with pytest.raises(ValueError, match=r"fragments \(5\) must be at most period \(4\)"):
        unison.algorithms.create(name, period=4, fragments=5)
    with pytest.raises(ValueError, match=r"delay \(4\) must be less than period \(4\)"):
        unison.algorithms.create(name, period=4, delay=4)
    with pytest.raises(ValueError, match="fragments must be a positive integer"):
        unison.algorithms.create(name, fragments=0)
