"""Every algorithm on a world of one (no torch.distributed): local training's weights, and its state round trip."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from unison.parallel import ALGORITHM_KEY

STEPS = 7
PERIOD = 3  # the streamed algorithms would sync twice in STEPS, had they peers
NAMES = unison.algorithms.names()

# Options that make a sync fall due within STEPS. Alone, the gradient algorithms get no
# engine (nothing to reduce) and the model-averaging ones no peers, so training is local.
# DiLoCo is the exception: alone its average is the replica itself, but its outer step
# still runs (see test_diloco_alone_is_local_training_with_outer_nesterov_steps).
OPTIONS: dict[str, dict[str, Any]] = {
    "local_sgd": {"period": PERIOD},
    "decentralized": {"period": PERIOD},
    "low_precision_decentralized": {"period": PERIOD},
    "diloco": {"period": PERIOD, "fragments": 1, "delay": 0},
    "sparseloco": {"period": 8},  # no sync within STEPS: alone, its outer step is checked in codecs/test_topk.py
    "async": {"sync_interval_ms": 1.0},
    "powersgd": {"start_iter": 0},
    "bytegrad": {"error_feedback": True},
    "daso": {"warmup_epochs": 0, "max_global_skips": 2},
}
# What each algorithm's state dict keeps alone (read from its State); None: no entry at all.
SAVED_KEYS: dict[str, Any] = {
    "allreduce": None,
    "bf16": None,
    "fp16": None,
    "nonblocking": None,
    "qadam": None,  # momenta are kept once compressing starts: never alone
    "bytegrad": {"residuals"},
    "powersgd": {"steps", "residuals", "qs"},
    "async": {"steps", "rounds", "bytes_sent"},
    "local_sgd": {"steps", "in_flight"},
    "decentralized": {"steps", "in_flight"},
    "low_precision_decentralized": {"steps"},
    "diloco": {"steps", "snapshot", "outer_optimizer", "in_flight", "merged"},
    "sparseloco": {"steps", "global", "feedback", "in_flight", "merged"},
    "demo": {"feedback"},  # the momentum (rank-local), empty alone: no engine, no bucket
    "daso": None,  # checked apart: the schedule's counters
}


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "qadam":  # qadam runs only with its own optimizer; alone it is that optimizer, locally
        return unison.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps, after=None) -> None:
    for k in steps:
        x, y = data(k)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if after is not None:
            after(k)


def wrapped(name: str, seed: int = 0) -> tuple[unison.DataParallel, nn.Module, torch.optim.Optimizer]:
    module = net(seed)
    opt = optimizer(name, module)
    algorithm = unison.algorithms.create(name, **OPTIONS.get(name, {}))
    return unison.DataParallel(module, optimizer=opt, algorithm=algorithm), module, opt


def trained(name: str) -> tuple[unison.DataParallel, nn.Module, torch.optim.Optimizer]:
    model, module, opt = wrapped(name)
    train(model, opt, range(STEPS), after=lambda k: k == 2 and model.end_epoch(1.0))
    model.flush()  # nonblocking applies its last step here
    return model, module, opt


def assert_same(a: nn.Module, b: nn.Module, opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    for p, q in zip(a.parameters(), b.parameters()):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


def outer_steps_reference(
    period: int, steps: int, outer_lr: float, outer_momentum: float
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Classic DiLoCo on one replica: inner SGD, and every ``period`` steps an outer Nesterov SGD
    step on the pseudo-gradient (snapshot - weights), whose result becomes the weights."""
    module = net()
    opt = optimizer("diloco", module)
    snapshot = [nn.Parameter(p.detach().clone()) for p in module.parameters()]
    outer = torch.optim.SGD(snapshot, lr=outer_lr, momentum=outer_momentum, nesterov=True)

    def sync(k: int) -> None:
        if (k + 1) % period:
            return
        with torch.no_grad():
            for s, p in zip(snapshot, module.parameters()):
                s.grad = s - p
        outer.step()
        with torch.no_grad():
            for s, p in zip(snapshot, module.parameters()):
                s.grad = None
                p.copy_(s)

    train(module, opt, range(steps), after=sync)
    return module, opt


@pytest.mark.parametrize("name", NAMES)
def test_alone_is_local_training(name):
    model, module, opt = trained(name)
    if name == "diloco":
        reference, ref_opt = outer_steps_reference(PERIOD, STEPS, 0.7, 0.5)
    else:
        reference = net()
        ref_opt = optimizer(name, reference)
        train(reference, ref_opt, range(STEPS))
    assert_same(module, reference, opt, ref_opt)
    assert model.comm_stats["bytes_total"] == 0 and model.comm_stats["steps"] == STEPS
    model.close()


def test_the_fifteen_algorithms():
    assert len(NAMES) == 15 and set(SAVED_KEYS) == set(NAMES)


def test_diloco_alone_is_local_training_with_outer_nesterov_steps():
    """The reference above is not plain local training: the outer steps change the weights."""
    plain = net()
    train(plain, optimizer("diloco", plain), range(STEPS))
    diloco, _ = outer_steps_reference(PERIOD, STEPS, 0.7, 0.5)
    assert not all(torch.equal(p, q) for p, q in zip(plain.parameters(), diloco.parameters()))


def test_nonblocking_defers_the_step_to_the_next_forward():
    model, module, opt = wrapped("nonblocking")
    train(model, opt, range(STEPS))
    early = net()
    early_opt = optimizer("nonblocking", early)
    train(early, early_opt, range(STEPS - 1))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), early.parameters()))
    model.eval()  # leaving training applies the pending update
    train(early, early_opt, [STEPS - 1])
    assert_same(module, early, opt, early_opt)
    model.close()


def tensors_equal(a: Any, b: Any) -> bool:
    """Deep equality of nested dicts, lists and tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_keeps_the_algorithms_state(name):
    model, module, opt = trained(name)
    saved = model.state_dict()
    entry = saved.get(ALGORITHM_KEY)
    if name == "daso":
        assert entry["name"] == "daso"
        assert (entry["state"]["batches"], entry["state"]["epoch"], entry["state"]["batch"]) == (STEPS, 1, STEPS - 3)
    elif SAVED_KEYS[name] is None:
        assert entry is None
    else:
        assert entry["name"] == name and set(entry["state"]) == SAVED_KEYS[name]
    if entry is not None and "steps" in entry["state"] and name != "powersgd":
        assert entry["state"]["steps"] == STEPS  # powersgd counts backward passes of the engine: none alone

    fresh, fresh_module, fresh_opt = wrapped(name, seed=1)
    fresh.load_state_dict(saved)
    fresh_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch would share the momentum tensors
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), fresh_module.parameters()))
    again = fresh.state_dict()
    assert tensors_equal(again.get(ALGORITHM_KEY), entry)

    # Both go on from the same counters.
    train(model, opt, [STEPS])
    train(fresh, fresh_opt, [STEPS])
    model.flush()
    fresh.flush()
    assert tensors_equal(fresh.state_dict().get(ALGORITHM_KEY), model.state_dict().get(ALGORITHM_KEY))
    assert_same(module, fresh_module, opt, fresh_opt)
    model.close()
    fresh.close()


def test_another_algorithms_state_is_refused_naming_both_unless_not_strict():
    model, _, _ = trained("local_sgd")
    saved = model.state_dict()
    other, module, _ = wrapped("diloco", seed=1)
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match="'local_sgd'.*'diloco'"):
        other.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(before, module.parameters()))  # refused before any weight changed
    other.load_state_dict(saved, strict=False)
    assert other.algorithm_state.steps == 0
    assert all(torch.equal(p, q) for p, q in zip(model.module.parameters(), module.parameters()))
