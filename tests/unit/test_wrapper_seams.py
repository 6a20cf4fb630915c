"""The seams DataParallel stands on, in-process: the Core's fault-tolerance policy and its one
error path, torch DDP's keyword shim, the debug step entries and join's hook over a Core."""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.unit.test_events import Recorder, core_with, net
from unison import ddp_keywords
from unison.core import Core, FaultPolicy, NoFaultTolerance
from unison.debug import step_entries
from unison.join import CoreJoinHook


class Scripted:
    """A fault policy that records what the Core asks it and answers as told."""

    active = False

    def __init__(self, committed: bool = True, recovers: bool = False, agrees: int = 0) -> None:
        self.calls: list[str] = []
        self._committed, self._recovers = committed, recovers
        self._agrees = agrees  # how many agreements recover (a sibling process met a failure)

    def start(self) -> None:
        self.calls.append("start")

    def check(self) -> None:
        self.calls.append("check")

    def recover(self, exc: BaseException, kind: str, local: Optional[dict[int, torch.Tensor]] = None) -> bool:
        self.calls.append(f"recover {kind}: {exc}")
        return self._recovers

    def committed(self) -> bool:
        self.calls.append("committed")
        return self._committed

    def at_boundary(self) -> None:
        self.calls.append("boundary")

    def agree(self) -> bool:
        self.calls.append("agree")
        self._agrees -= 1
        return self._agrees >= 0


def step(core: Core, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    core.before_forward()
    out = model(torch.randn(5, 3))
    core.events.after_forward(out)
    F.mse_loss(out, torch.zeros_like(out)).backward()
    for opt in optimizers:
        opt.step()


def two_optimizers(policy: FaultPolicy) -> tuple[Core, nn.Module, list[torch.optim.Optimizer]]:
    model = net()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    core = core_with(Recorder(), model, *opts)
    core.fault = policy
    return core, model, opts


def test_fault_tolerance_is_off_by_default_and_answers_no_ops():
    core = core_with(Recorder(), net())
    assert isinstance(core.fault, NoFaultTolerance) and not core.fault.active
    assert core.fault.committed() and not core.fault.recover(RuntimeError("x"), "drop")


def test_the_core_asks_its_policy_at_a_forward_and_around_each_step():
    policy = Scripted()
    core, model, opts = two_optimizers(policy)
    step(core, model, opts)
    assert policy.calls == ["check", "committed", "boundary"]  # committed at the first optimizer, boundary at the last
    assert [e for e in core.events.state.events if e[0] == "after_step"] == [
        ("after_step", 0, False, 0),
        ("after_step", 1, True, 1),
    ]


def test_a_step_a_heal_already_applied_fires_nothing_for_the_first_optimizer():
    core, model, opts = two_optimizers(Scripted(committed=False))
    step(core, model, opts)
    assert [e[1] for e in core.events.state.events if e[0] == "after_step"] == [1]


class FailingStep(Recorder):
    name = "failing_step"

    def after_step(self, replica, state, optimizer) -> None:
        raise RuntimeError("peer gone")


def test_a_failure_the_policy_recovers_from_is_swallowed_and_one_it_does_not_is_raised_unchanged():
    policy = Scripted(recovers=True)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(FailingStep(), model, opt)
    core.fault = policy
    step(core, model, [opt])
    assert "recover drop: peer gone" in policy.calls and policy.calls[-1] == "boundary"
    core.fault = NoFaultTolerance()
    with pytest.raises(RuntimeError, match="^peer gone$"):
        step(core, model, [opt])


def test_the_core_entry_passes_errors_that_are_no_peer_failure_unchanged():
    core = core_with(Recorder(), net())
    error = ValueError("a bug of the caller")
    with pytest.raises(ValueError) as raised, core.entry("forward"):
        raise error
    assert raised.value is error


def test_recovering_runs_again_after_a_recovered_failure():
    core = core_with(Recorder(), net())
    core.fault = Scripted(recovers=True)
    tries = []

    def flaky() -> int:
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("membership changed")
        return len(tries)

    assert core.recovering(flaky) == 3


def test_recovering_runs_again_when_the_node_recovered_for_a_sibling():
    """Over FSDP2 a round that ended here is run again when the node agreed to recover (a sibling's
    round failed): ``agree`` after it said so."""
    core = core_with(Recorder(), net())
    core.fault = Scripted(agrees=1)
    tries = []
    assert core.recovering(lambda: tries.append(1) or len(tries)) == 2
    assert core.fault.calls == ["agree", "agree"]


def test_ddp_keywords_take_torch_meanings_and_refuse_others():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = ddp_keywords.parse({"device_ids": [0], "static_graph": True, "dim": 1}, stacklevel=1)
        ddp_keywords.parse({"check_reduction": True}, stacklevel=1)
    assert [w.category for w in caught] == [FutureWarning]  # check_reduction's deprecation only
    assert caught[0].filename == __file__
    assert parsed.device_ids == [0] and parsed.dim == 1 and parsed.init_sync is True
    assert parsed.static_graph is True and parsed.gradient_as_bucket_view is True
    with pytest.raises(TypeError, match="static_graph must be a bool"):
        ddp_keywords.parse({"static_graph": "yes"})
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) bogus"):
        ddp_keywords.parse({"bogus": 1, "dim": 0})
    with pytest.raises(NotImplementedError, match="mixed_precision"):
        ddp_keywords.parse({"mixed_precision": object()})


def test_debug_step_entries_name_what_ranks_must_agree_on():
    core = core_with(Recorder(), net())
    entries = dict((e[1], e[2]) for e in step_entries(core, 7, synchronized=False))
    assert entries["forward number"] == 7 and entries["synchronized (not no_sync)"] is False
    assert entries["algorithm"] == core.algorithm.describe() and entries["world size"] == 1
    assert entries["bucket plan"] is None  # no gradient engine without a group


def test_join_hook_reads_the_core_live_and_refuses_nesting():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    core = core_with(Recorder(), model, opt)
    stepped = []
    hook = CoreJoinHook(core, model, stepped.append)
    assert (hook.group, hook.rank, hook.world_size, hook.tag) == (None, 0, 1, "t")
    hook.attach(object())  # type: ignore[arg-type]  # any join: the hook only keeps it
    with pytest.raises(RuntimeError, match="cannot be nested"):
        hook.attach(object())  # type: ignore[arg-type]
    hook.attach(None)
    assert hook.active is None
    hook.shadow_step(0)
    assert stepped == [opt]
    with pytest.raises(RuntimeError, match="another rank stepped optimizer 1, this one has 1"):
        hook.shadow_step(1)
    assert len(hook.tensors()) == len(list(model.parameters()))
