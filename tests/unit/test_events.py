"""Events reaching an algorithm through Core and its Dispatcher: order, teardown, hooks, state, bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unison.algorithms.contract import Algorithm, State
from unison.core import Core
from unison.events import Dispatcher
from unison.replica import Replica


class Log(State):
    __slots__ = ("events", "count")

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Any] = []
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class Recorder(Algorithm[Log]):
    """Logs every event into its state, and registers a forward hook and step hooks."""

    name = "recorder"
    reduces_gradients = False

    def setup(self, replica: Replica) -> Log:
        state = Log()
        state.events.append("setup")
        replica.on_forward(replica.modules[0], lambda: state.events.append("forward_hook"))
        replica.on_optimizer_step(
            before=lambda o: state.events.append(("before_step_hook", replica.optimizers.index(o))),
            after=lambda o: state.events.append(("after_step_hook", replica.optimizers.index(o))),
        )
        return state

    def before_forward(self, replica: Replica, state: Log) -> None:
        state.events.append("before_forward")

    def after_forward(self, replica: Replica, state: Log, output: Any) -> None:
        state.events.append(("after_forward", tuple(output.shape)))

    def after_step(self, replica: Replica, state: Log, optimizer: torch.optim.Optimizer) -> None:
        ended = replica.step_ended(optimizer)
        state.count += ended
        state.events.append(("after_step", replica.optimizers.index(optimizer), ended, replica.steps))

    def end_epoch(self, replica: Replica, state: Log, loss, averaged: bool) -> None:
        state.events.append(("end_epoch", loss, averaged))

    def flush(self, replica: Replica, state: Log) -> None:
        state.events.append("flush")

    def teardown(self, replica: Replica, state: Log) -> None:
        state.events.append("teardown")


class Other(Recorder):
    name = "other"


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def core_with(algorithm: Algorithm, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Core:
    core = Core(
        algorithm, list(model.named_parameters()), list(model.named_buffers()), None, "t", modules=list(model.modules())
    )
    for opt in optimizers:
        core.add_optimizer(opt, core.before_step, core.after_step)
    core.start()
    return core


def train_step(core: Core, model: nn.Module, optimizers) -> None:
    """What DataParallel's forward and the user's loop do."""
    core.events.before_forward()
    out = model(torch.randn(5, 3))
    core.events.after_forward(out)
    F.mse_loss(out, torch.zeros_like(out)).backward()
    for opt in optimizers:
        opt.step()


def test_events_of_one_step_in_order():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(Recorder(), model, opt)
    log = core.events.state
    train_step(core, model, [opt])
    assert log.events == [
        "setup",
        "before_forward",
        "forward_hook",
        ("after_forward", (5, 2)),
        ("before_step_hook", 0),
        ("after_step", 0, True, 1),
        ("after_step_hook", 0),  # the algorithm's own step hooks run after its after_step
    ]


def test_with_two_optimizers_the_step_ends_at_the_second():
    model = net()
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)
    core = core_with(Recorder(), model, a, b)
    log = core.events.state
    for _ in range(2):
        train_step(core, model, [a, b])
    steps = [e for e in log.events if isinstance(e, tuple) and e[0] == "after_step"]
    assert steps == [
        ("after_step", 0, False, 0),
        ("after_step", 1, True, 1),
        ("after_step", 0, False, 1),
        ("after_step", 1, True, 2),
    ]
    assert log.count == 2 and core.clock.steps == 2


def test_user_calls_reach_the_algorithm():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(Recorder(), model, opt)
    core.events.end_epoch(1.5, averaged=True)
    core.events.flush()
    assert core.events.state.events[-2:] == [("end_epoch", 1.5, True), "flush"]


def test_stop_runs_flush_then_teardown_and_removes_the_algorithms_hooks():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(Recorder(), model, opt)
    log = core.events.state
    core.stop()
    assert log.events[-2:] == ["flush", "teardown"]
    seen = len(log.events)
    model(torch.randn(5, 3))  # the forward hook is gone
    core.before_step(opt)  # and the step hooks
    assert len(log.events) == seen
    with pytest.raises(RuntimeError, match="closed"):
        core.events.flush()
    core.stop()  # a second stop does nothing
    assert len(log.events) == seen

    core.start()  # as after a switch: the new state hears the step, the old one does not
    fresh = core.events.state
    train_step(core, model, [opt])
    assert len(log.events) == seen
    assert fresh.events.count("forward_hook") == 1 and ("after_step_hook", 0) in fresh.events
    core.release()


def test_state_dict_through_the_algorithm_entry():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(Recorder(), model, opt)
    for _ in range(3):
        train_step(core, model, [opt])
    entry = core.algorithm_entry()
    assert entry == {"name": "recorder", "state": {"count": 3}}

    other_model = net()
    again = core_with(Recorder(), other_model, torch.optim.SGD(other_model.parameters(), lr=0.1))
    again.load_algorithm_entry(entry, strict=True, what="model")
    assert again.events.state.count == 3


def test_another_algorithms_entry_is_refused_when_strict_and_ignored_otherwise():
    model = net()
    core = core_with(Other(), model, torch.optim.SGD(model.parameters(), lr=0.1))
    core.events.state.count = 7
    entry = {"name": "recorder", "state": {"count": 3}}
    with pytest.raises(ValueError, match="'recorder'.*'other'") as info:
        core.load_algorithm_entry(entry, strict=True, what="model", advice="; switch to {saved} first")
    assert "model" in str(info.value) and "switch to 'recorder' first" in str(info.value)
    core.load_algorithm_entry(entry, strict=False, what="model")
    assert core.events.state.count == 7


class Stateless(Algorithm[None]):
    name = "stateless"


def test_an_algorithm_without_state_saves_nothing_and_refuses_entries():
    model = net()
    core = core_with(Stateless(), model)
    assert core.algorithm_entry() is None
    assert core.events.bytes_sent == 0
    core.events.load_state_dict({})
    with pytest.raises(ValueError, match=r"'stateless' keeps no state but was given \['x'\]"):
        core.events.load_state_dict({"x": 1})


def test_a_state_that_keeps_nothing_refuses_entries():
    with pytest.raises(ValueError, match=r"keeps nothing in a checkpoint but was given \['steps'\]"):
        State().load_state_dict({"steps": 1})


def test_bytes_sent_are_the_states_and_survive_the_algorithm():
    model = net()
    core = core_with(Recorder(), model)
    core.events.state.bytes_sent = 123
    assert core.events.bytes_sent == 123 and core.bytes_total == 123
    core.stop()
    assert core.bytes_total == 123  # counted as retired
    core.start()
    core.events.state.bytes_sent = 7
    assert core.events.bytes_sent == 7 and core.bytes_total == 130


class NoGradients(Recorder):
    name = "no_gradients"

    def sync_gradients(self, replica: Replica, state: Log) -> bool:
        raise AssertionError("never asked: the algorithm does not reduce gradients")


def test_sync_gradients_is_false_without_asking_an_algorithm_that_reduces_none():
    model = net()
    replica = Replica(list(model.named_parameters()), [], [], None, "t", modules=list(model.modules()))
    assert Dispatcher(NoGradients(), replica).sync_gradients() is False


class FailsToLeave(Recorder):
    name = "fails_to_leave"

    def teardown(self, replica: Replica, state: Log) -> None:
        raise RuntimeError("teardown failed")


def test_close_leaves_no_hook_even_when_the_algorithm_teardown_raises():
    import unison

    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = unison.DataParallel(net, optimizer=opt, algorithm=FailsToLeave())
    with pytest.raises(RuntimeError, match="teardown failed"):
        model.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert not any(m._forward_pre_hooks for m in net.modules())
    opt.step()  # the optimizer works on its own again (before the fix: "this wrapper is closed")
