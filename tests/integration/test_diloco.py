"""DiLoCo on 2 gloo ranks: equivalence with synchronous averaging in the limit
case, replicas between and at outer steps, the Nesterov outer update by hand,
low-precision wire, the overlapped (delayed) variant, checkpoints, and options."""

from __future__ import annotations

import copy

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import DIN, DOUT, MLP, BNNet, batch, image_batch
from scenarios import max_diff, spread_across_ranks

import unison


def diloco(net, opt, **options):
    """The classic schedule (one fragment, no delay) unless the test says otherwise: tests/test_streaming.py has the streamed one."""
    if not options.get("overlap"):
        options.setdefault("fragments", 1)
        options.setdefault("delay", 0)
    return unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create("diloco", **options))


def train_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def params(net) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def mean_over_ranks(tensors) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        t = t.clone()
        dist.all_reduce(t)
        out.append(t / dist.get_world_size())
    return out


def record_before_outer(opt, log):
    """A step hook registered before DataParallel's: it sees the parameters after
    the inner step and before the outer step touches them."""
    opt.register_step_post_hook(
        lambda o, _a, _k: log.append([p.detach().clone() for g in o.param_groups for p in g["params"]])
    )


def largest_gap(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def check_sync_and_hand() -> dict:
    """(a) inner_steps=1, outer SGD lr 1 without momentum is synchronous averaging:
    the new snapshot is s - mean_i(s - (s - lr g_i)) = s - lr mean_i(g_i), the
    allreduce step with the same inner SGD. (b) with inner_steps=4 the replicas
    drift between outer steps and agree right after each (BatchNorm statistics
    included). (c) two outer steps equal Nesterov SGD computed by hand on the
    averaged pseudo-gradients."""
    rank = dist.get_rank()
    out = {}

    torch.manual_seed(0)
    base = MLP()
    ref_net, d_net = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt, d_opt = torch.optim.SGD(ref_net.parameters(), lr=0.05), torch.optim.SGD(d_net.parameters(), lr=0.05)
    ref = unison.DataParallel(ref_net, optimizer=ref_opt)
    model = diloco(d_net, d_opt, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    gaps = []
    for s in range(6):
        x, y = batch(s, rank)
        train_step(ref, ref_opt, x, y)
        train_step(model, d_opt, x, y)
        gaps.append(max_diff(ref_net, d_net))
    out["sync_gaps"] = gaps
    out["sync_moved"] = max_diff(base, d_net)

    torch.manual_seed(1)
    net = BNNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model = diloco(net, opt, inner_steps=4)
    spreads = []
    for s in range(12):
        train_step(model, opt, *image_batch(s, rank))
        spreads.append(spread_across_ranks(net))
    out["bn_spreads"] = spreads

    torch.manual_seed(2)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    log: list = []
    record_before_outer(opt, log)
    lr, m = 0.7, 0.9
    model = diloco(net, opt, inner_steps=4, outer_lr=lr, outer_momentum=m, nesterov=True)
    snap = params(net)
    buf = None
    errors = []
    for s in range(8):
        train_step(model, opt, *batch(s, rank))
        if (s + 1) % 4 == 0:
            g = [a - b for a, b in zip(snap, mean_over_ranks(log[-1]))]
            buf = g if buf is None else [m * b + gi for b, gi in zip(buf, g)]
            snap = [p - lr * (gi + m * b) for p, gi, b in zip(snap, g, buf)]
            errors.append(largest_gap(snap, params(net)))
    out["hand_errors"] = errors
    out["hand_buffer_error"] = largest_gap(
        buf, [model.algorithm_state.outer.state[p]["momentum_buffer"] for p in model.algorithm_state.snapshot]
    )
    return out


def check_wire_and_overlap() -> dict:
    """(d) bf16 and fp16 wires halve the bytes and stay close to fp32. (e) the
    overlapped variant applies each outer step one inner step late and keeps the
    local step taken meanwhile (checked exactly), learns a regression, and
    average() settles an average still in flight."""
    rank = dist.get_rank()
    out = {"bytes": {}, "gap": {}}

    torch.manual_seed(3)
    base = MLP()
    finals = {}
    for wire in ("fp32", "bf16", "fp16"):
        net = copy.deepcopy(base)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = diloco(net, opt, inner_steps=4, wire_dtype=wire)
        for s in range(12):
            train_step(model, opt, *batch(s, rank))
        out["bytes"][wire] = model.algorithm_state.bytes_sent
        out.setdefault("comm_stats", {})[wire] = model.comm_stats["bytes_total"]
        finals[wire] = net
    out["gap"] = {w: max_diff(finals["fp32"], finals[w]) for w in ("bf16", "fp16")}
    out["moved"] = max_diff(base, finals["fp32"])

    torch.manual_seed(4)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    log: list = []
    record_before_outer(opt, log)
    lr, m = 0.7, 0.9
    model = diloco(net, opt, inner_steps=2, outer_lr=lr, outer_momentum=m, overlap=True)
    snap, buf, errors = params(net), None, []
    for s in range(6):
        train_step(model, opt, *batch(s, rank))
        if s in (2, 4):  # one step after the launches at steps 1 and 3 (0-based)
            launched, now = log[-2], log[-1]
            g = [a - b for a, b in zip(snap, mean_over_ranks(launched))]
            buf = g if buf is None else [m * b + gi for b, gi in zip(buf, g)]
            snap = [p - lr * (gi + m * b) for p, gi, b in zip(snap, g, buf)]
            expected = [sn + (x - x0) for sn, x, x0 in zip(snap, now, launched)]
            errors.append(largest_gap(expected, params(net)))
    out["overlap_errors"] = errors

    torch.manual_seed(5)
    teacher = torch.randn(DIN, DOUT)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model = diloco(net, opt, inner_steps=4, overlap=True)
    g = torch.Generator().manual_seed(rank)
    probe = torch.randn(256, DIN, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        out["loss_start"] = F.mse_loss(net(probe), probe @ teacher).item()
    for _ in range(120):
        x = torch.randn(16, DIN, generator=g)
        train_step(model, opt, x, x @ teacher)
    out["in_flight_before_average"] = bool(model.algorithm_state.streams.inflight)
    out["spread_before_average"] = spread_across_ranks(net)
    model.average()
    out["spread_after_average"] = spread_across_ranks(net)
    with torch.no_grad():
        out["loss_end"] = F.mse_loss(net(probe), probe @ teacher).item()
    return out


def check_state() -> dict:
    """(f) a checkpoint taken between outer steps (and, with overlap, while an
    average is in flight) restores into a fresh model that continues exactly as
    the original does."""
    rank = dist.get_rank()
    out = {}
    for overlap, save_at in ((False, 10), (True, 8)):
        torch.manual_seed(6)
        net = MLP()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        model = diloco(net, opt, inner_steps=4, overlap=overlap)
        for s in range(save_at):
            train_step(model, opt, *batch(s, rank))
        saved, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        torch.manual_seed(7)
        fresh_net = MLP()
        fresh_opt = torch.optim.SGD(fresh_net.parameters(), lr=0.05, momentum=0.9)
        fresh = diloco(fresh_net, fresh_opt, inner_steps=4, overlap=overlap)
        fresh.load_state_dict(saved)
        fresh_opt.load_state_dict(saved_opt)
        restored_steps = fresh.algorithm_state.steps
        gaps = []
        for s in range(save_at, save_at + 10):
            x, y = batch(s, rank)
            train_step(model, opt, x, y)
            train_step(fresh, fresh_opt, x, y)
            gaps.append(max_diff(net, fresh_net))
        out[overlap] = {
            "gaps": gaps,
            "steps": restored_steps,
            "keys": sorted(saved["_unison_algorithm"]["state"]),
            "has_momentum": bool(fresh.algorithm_state.outer.state),
        }
    return out


@pytest.fixture(scope="module")
def sync_and_hand():
    return launch.run(check_sync_and_hand, 2, timeout=60)


@pytest.fixture(scope="module")
def wire_and_overlap():
    return launch.run(check_wire_and_overlap, 2, timeout=60)


def test_one_inner_step_is_synchronous_averaging(sync_and_hand):
    for r in sync_and_hand:
        assert r["sync_moved"] > 1e-3
        assert max(r["sync_gaps"]) < 1e-6, r["sync_gaps"]


def test_replicas_drift_between_outer_steps_and_agree_after(sync_and_hand):
    for r in sync_and_hand:
        spreads = r["bn_spreads"]
        for s, spread in enumerate(spreads, 1):
            if s % 4 == 0:
                assert spread < 1e-6, (s, spreads)
            else:
                assert spread > 1e-4, (s, spreads)


def test_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient(sync_and_hand):
    for r in sync_and_hand:
        assert len(r["hand_errors"]) == 2
        assert max(r["hand_errors"]) < 1e-6, r["hand_errors"]
        assert r["hand_buffer_error"] < 1e-6


def test_low_precision_wire_halves_the_bytes(wire_and_overlap):
    for r in wire_and_overlap:
        b = r["bytes"]
        assert b["fp32"] > 0
        assert b["bf16"] * 2 == b["fp32"] and b["fp16"] * 2 == b["fp32"], b
        assert r["comm_stats"] == b
        assert r["moved"] > 1e-2
        assert r["gap"]["bf16"] < 5e-3 and r["gap"]["fp16"] < 1e-3, r["gap"]


def test_overlap_applies_one_step_late_keeping_local_progress(wire_and_overlap):
    for r in wire_and_overlap:
        assert len(r["overlap_errors"]) == 2
        assert max(r["overlap_errors"]) < 1e-6, r["overlap_errors"]


def test_overlap_converges_and_average_settles(wire_and_overlap):
    for r in wire_and_overlap:
        assert r["loss_end"] < 0.05 * r["loss_start"], (r["loss_start"], r["loss_end"])
        assert r["in_flight_before_average"]
        assert r["spread_before_average"] > 1e-4
        assert r["spread_after_average"] == 0.0


def test_checkpoint_round_trip():
    for r in launch.run(check_state, 2, timeout=60):
        for overlap, res in r.items():
            assert res["keys"] == ["in_flight", "merged", "outer_optimizer", "snapshot", "steps"]
            assert res["has_momentum"]
            assert max(res["gaps"]) == 0.0, (overlap, res["gaps"])
        assert r[False]["steps"] == 10 and r[True]["steps"] == 8


@pytest.mark.parametrize(
    "options, message",
    [
        ({"inner_steps": 0}, "inner_steps must be a positive integer"),
        ({"inner_steps": 2.5}, "inner_steps must be a positive integer"),
        ({"inner_steps": True}, "inner_steps must be a positive integer"),
        ({"outer_lr": 0}, "outer_lr must be a positive number"),
        ({"outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\)"),
        ({"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
        ({"nesterov": "yes"}, "nesterov must be True or False"),
        ({"overlap": 1}, "overlap must be True or False"),
        ({"wire_dtype": "int4"}, "wire_dtype must be one of 'fp32', 'bf16', 'fp16', 'int8'"),
        ({"communication_interval": 4}, "has no option 'communication_interval'"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        unison.algorithms.create("diloco", **options)


def test_needs_the_optimizer():
    with pytest.raises(ValueError, match="needs the optimizer"):
        unison.DataParallel(MLP(), algorithm="diloco")


def test_single_process_runs_the_outer_step_locally():
    """Without a process group the average is the replica itself: with outer lr 1
    and no momentum the result is plain local training."""
    torch.manual_seed(8)
    net = MLP()
    start, plain = copy.deepcopy(net), copy.deepcopy(net)
    opt, plain_opt = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(plain.parameters(), lr=0.05)
    model = diloco(net, opt, inner_steps=3, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    for s in range(7):
        x, y = batch(s, 0)
        train_step(model, opt, x, y)
        train_step(plain, plain_opt, x, y)
    assert model.algorithm_state.steps == 7 and model.algorithm_state.bytes_sent == 0
    assert max_diff(net, plain) < 1e-6
    assert max_diff(net, start) > 1e-3
