"""The Replica's face on its own: what it trains, its hooks, its step clock, and no wrapper plumbing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unison.replica import Replica, Standalone


def frozen_bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)
    return net


def standalone(net: nn.Module, *optimizers: torch.optim.Optimizer) -> tuple[Replica, Standalone]:
    """A Replica with no process group, and the wiring a wrapper would drive."""
    opts = list(optimizers)
    wiring = Standalone(opts)
    replica = Replica(
        list(net.named_parameters()), list(net.named_buffers()), opts, None, "t", wiring, modules=list(net.modules())
    )
    return replica, wiring


def test_trainable_excludes_frozen_parameters():
    net = frozen_bn_net()
    replica = Replica(list(net.named_parameters()), list(net.named_buffers()), [], None, "t")
    names = [n for n, _ in replica.trainable]
    assert "0.bias" not in names
    assert names == [n for n, p in net.named_parameters() if n != "0.bias"]
    assert len(replica.parameters) == len(list(net.parameters()))  # parameters keeps the frozen one


def test_float_buffers_exclude_the_integer_batch_count():
    net = frozen_bn_net()
    replica = Replica(list(net.named_parameters()), list(net.named_buffers()), [], None, "t")
    assert [n for n, _ in replica.float_buffers] == ["1.running_mean", "1.running_var"]
    assert "1.num_batches_tracked" in [n for n, _ in replica.named_buffers]
    assert all(b is dict(net.named_buffers())[n] for n, b in replica.float_buffers)


def test_alone_there_is_no_one_to_talk_to_and_no_engine():
    net = frozen_bn_net()
    replica = Replica(list(net.named_parameters()), list(net.named_buffers()), [], None, "t")
    assert (replica.distributed, replica.world_size, replica.rank) == (False, 1, 0)
    assert replica.private_group("x") is None
    assert replica.buckets == [] and replica.bucket_plan(1024) == []
    assert replica.bucket_of(net[0].weight) is None and replica.gradient_group is None
    assert not replica.in_flight
    replica.complete()  # nothing in flight: returns at once
    replica.set_bucket_size(1024)
    assert replica.bucket_cap_mb == 25


def test_a_training_step_ends_when_every_optimizer_stepped():
    net = frozen_bn_net()
    a = torch.optim.SGD(net[0].parameters(), lr=0.1)
    b = torch.optim.SGD(net[2].parameters(), lr=0.1)
    replica, wiring = standalone(net, a, b)
    wiring.clock.record(a)  # the wrapper records each step
    assert not replica.step_ended(a) and replica.steps == 0
    wiring.clock.record(a)  # a again: still waiting for b
    assert not replica.step_ended(a) and replica.steps == 0
    wiring.clock.record(b)
    assert replica.step_ended(b) and not replica.step_ended(a) and replica.steps == 1
    wiring.clock.record(b)
    assert not replica.step_ended(b) and replica.steps == 1
    wiring.clock.record(a)
    assert replica.step_ended(a) and replica.steps == 2


def test_forward_hooks_run_before_the_module_and_are_removed_with_the_wiring():
    net = frozen_bn_net()
    replica, wiring = standalone(net)
    seen = []
    replica.on_forward(net[2], lambda: seen.append(net.training))
    net(torch.randn(5, 3))
    net(torch.randn(5, 3))
    assert seen == [True, True]
    wiring.hooks.remove()
    net(torch.randn(5, 3))
    assert seen == [True, True]


def test_optimizer_step_hooks_are_kept_for_the_wrapper_and_removed_with_the_wiring():
    net = frozen_bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    replica, wiring = standalone(net, opt)
    calls = []
    replica.on_optimizer_step(before=lambda o: calls.append(("before", o)), after=lambda o: calls.append(("after", o)))
    wiring.hooks.run_before_step(opt)
    wiring.hooks.run_after_step(opt)
    assert calls == [("before", opt), ("after", opt)]
    wiring.hooks.remove()
    wiring.hooks.run_before_step(opt)
    wiring.hooks.run_after_step(opt)
    assert len(calls) == 2


def test_a_replaced_step_counts_as_a_training_step_and_is_undone_on_remove():
    net = frozen_bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    replica, wiring = standalone(net, opt)
    step_before, zero_before = opt.step, opt.zero_grad
    calls = []

    def step(o, closure):
        calls.append(("step", o, closure))
        return "stepped"

    def zero_grad(o, set_to_none=True):
        calls.append(("zero_grad", o, set_to_none))

    originals = replica.replace_optimizer_methods(opt, step, zero_grad)
    assert originals == (step_before, zero_before)
    weights = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    assert opt.step() == "stepped"
    opt.zero_grad(set_to_none=False)
    assert calls == [("step", opt, None), ("zero_grad", opt, False)]
    assert replica.steps == 1 and replica.step_ended(opt)
    assert all(torch.equal(w, p) for w, p in zip(weights, net.parameters()))  # the real step did not run

    wiring.hooks.remove()
    assert "step" not in vars(opt) and "zero_grad" not in vars(opt)
    opt.step()  # the real step again, not counted by anyone
    assert len(calls) == 2 and replica.steps == 1
    assert not torch.equal(weights[0], net[0].weight)


class FakeScaler:
    """Just enough of a GradScaler: ``update()`` changes the scale."""

    def __init__(self) -> None:
        self.scale = 1.0

    def update(self, new_scale=None):
        self.scale = self.scale * 2 if new_scale is None else new_scale
        return self.scale


def test_scaler_hooks_run_after_the_update_of_a_watched_scaler():
    net = frozen_bn_net()
    replica, wiring = standalone(net)
    scaler = FakeScaler()
    wiring.hooks.watch_scaler(scaler)
    wiring.hooks.watch_scaler(scaler)  # watched once, however often it is given
    seen = []
    replica.on_scaler_update(lambda s: seen.append((s, s.scale)))
    assert scaler.update() == 2.0
    assert scaler.update(new_scale=8.0) == 8.0
    assert seen == [(scaler, 2.0), (scaler, 8.0)]  # after update(): the new scale is seen

    wiring.hooks.remove()  # the algorithm leaves; the wrapper still watches the scaler
    scaler.update()
    assert len(seen) == 2 and scaler.scale == 16.0
    wiring.hooks.restore_scalers()  # the wrapper closes
    assert "update" not in vars(scaler)


@pytest.mark.parametrize(
    "plumbing",
    [
        "record_step",
        "run_before_step",
        "run_after_step",
        "add_scaler",
        "watch_scaler",
        "restore_scalers",
        "remove_hooks",
        "engine",
        "replaced_steps",
        "reducer",
        "hooks",
        "clock",
    ],
)
def test_the_replica_exposes_no_wrapper_plumbing(plumbing):
    net = frozen_bn_net()
    replica, _ = standalone(net)
    assert not hasattr(replica, plumbing)
