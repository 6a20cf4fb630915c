"""What ``unison bench`` trains: built-in workloads and the user's own model.

A workload is a model, a training set, a loss and a quality measured on
held-out data (``evaluate(module) -> float``), with the settings that suit it
(batch size per rank, optimizer and learning rate, steps, a default target).
Every rank builds it from the same seed, so replicas start alike (and the
wrappers broadcast rank 0's weights anyway). Nothing is downloaded.

Built in:

- ``digits``: scikit-learn's handwritten digits, a wide MLP (64-2048-2048-10,
  4.3M parameters, so communication matters); test accuracy, target 95%.
- ``charlm``: the character-level transformer LM on the Python standard
  library's source (``unison.apps.workloads.charlm``); validation loss in nats per
  character, target 2.0. ``--model small`` (the default, 0.1M parameters),
  ``medium`` (3.2M) or ``large`` (10.7M: its exchanges matter at internet speeds)
  picks its size (``SIZED``; the larger ones at a smaller learning rate).
- ``mlp``: a 22M-parameter MLP on synthetic data labelled by a fixed random
  linear teacher, for throughput on a communication-heavy model; held-out
  accuracy, no fixed target.

``--model package.module:factory`` (a name with a colon) names a function ``factory()`` returning
``(model, dataset, loss_fn)``: ``loss_fn(model(x), y)`` over batches ``(x, y)``
of the dataset. Its last tenth (at most 1024 samples) is held out, and the
quality is the mean loss there.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

NAMES = ("digits", "charlm", "mlp")
#: The workloads that come in sizes (``--model SIZE``), and each size's learning rate when it is
#: not the workload's own (a wider transformer takes a smaller Adam step; not tuned further).
SIZED: dict[str, dict[str, Optional[float]]] = {"charlm": {"small": None, "medium": 3e-3, "large": 1e-3}}


@dataclass
class Settings:
    """How a workload is measured and trained; known without building it."""

    metric: str
    higher_is_better: bool
    target: Optional[float]  # None: decided after the run (near the best final quality)
    batch_size: int
    optimizer: str  # "sgd" (momentum 0.9) or "adamw"
    lr: float
    steps: int
    eval_every: int
    time_budget_s: float


SETTINGS = {
    "digits": Settings("test accuracy", True, 0.95, 32, "sgd", 0.02, 150, 5, 60.0),
    "charlm": Settings("validation loss", False, 2.0, 32, "adamw", 1e-2, 300, 20, 90.0),
    "mlp": Settings("held-out accuracy", True, None, 64, "sgd", 0.05, 40, 5, 90.0),
    "custom": Settings("held-out loss", False, None, 32, "sgd", 0.01, 200, 10, 60.0),
}


@dataclass
class Workload:
    """A model to train and how to judge it."""

    name: str
    model: nn.Module
    train: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    settings: Settings
    info: dict = field(default_factory=dict)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def is_factory(model_spec: Optional[str]) -> bool:
    """Whether ``--model`` names the user's ``package.module:factory`` (a colon), not a size."""
    return bool(model_spec) and ":" in str(model_spec)


def check_size(name: Optional[str], size: str) -> None:
    """Refuse a ``--model SIZE`` that workload ``name`` does not come in (ValueError saying what does)."""
    sizes = SIZED.get(str(name))
    if sizes is None:
        sized = ", ".join(SIZED)
        raise ValueError(
            f"--model {size}: workload {name!r} comes in one size; sizes are for {sized} "
            "(or give --model package.module:factory)"
        )
    if size not in sizes:
        raise ValueError(
            f"--model {size}: {name} comes in sizes {', '.join(sizes)} (or give --model package.module:factory)"
        )


def settings_for(name: Optional[str], model_spec: Optional[str] = None) -> Settings:
    """The settings of a built-in workload (of the size ``model_spec`` names), or of the user's ``--model``."""
    if is_factory(model_spec):
        return SETTINGS["custom"]
    if name not in NAMES:
        raise ValueError(
            f"unknown workload {name!r}; choose one of {', '.join(NAMES)} or give --model package.module:factory"
        )
    if model_spec:
        check_size(name, model_spec)
        lr = SIZED[name][model_spec]
        return SETTINGS[name] if lr is None else replace(SETTINGS[name], lr=lr)
    return SETTINGS[name]


def load(name: Optional[str], seed: int = 0, model_spec: Optional[str] = None) -> Workload:
    """Build the workload ``name`` (of the size ``model_spec`` names, or the user's factory) from ``seed``."""
    settings = settings_for(name, model_spec)
    if is_factory(model_spec):
        return _custom(str(model_spec), seed, settings)
    if name is None:
        raise ValueError("name a workload (digits, charlm, mlp) or give a model spec")
    if name == "charlm":
        return _charlm(seed, settings, size=model_spec or "small")
    return {"digits": _digits, "mlp": _mlp}[name](seed, settings)


def make_optimizer(workload: Workload, params, lr: Optional[float] = None, algorithm: Optional[str] = None):
    """The workload's optimizer; "qadam" runs only with unison's QAdamOptimizer (with its default
    warm-up; Adam's step size 0.003 for workloads trained with SGD, as ``unison train`` does)."""
    s = workload.settings
    lr = s.lr if lr is None else lr
    if algorithm == "qadam":
        import unison

        return unison.QAdamOptimizer(params, lr=lr if s.optimizer == "adamw" else 0.003)
    if s.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def reached(quality: float, target: float, higher_is_better: bool) -> bool:
    return quality >= target if higher_is_better else quality <= target


# ---- the built-in workloads ---------------------------------------------------------
@torch.no_grad()
def _accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was = module.training
    module.eval()
    try:
        return (module(x).argmax(1) == y).float().mean().item()
    finally:
        module.train(was)


def _mlp_net(dims: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _digits(seed: int, settings: Settings) -> Workload:
    from ..workloads.digits import load_data

    data = load_data(seed, test_fraction=0.2)
    torch.manual_seed(seed)
    model = _mlp_net([64, 2048, 2048, 10])
    return Workload(
        "digits",
        model,
        data.train,
        F.cross_entropy,
        lambda m: _accuracy(m, data.test_x, data.test_y),
        settings,
        {"train_samples": len(data.train), "test_samples": len(data.test_y)},
    )


def _charlm(
    seed: int, settings: Settings, text_bytes: int = 393216, context: int = 64, size: str = "small"
) -> Workload:
    from ..workloads import charlm

    text = charlm.load_text(text_bytes)
    vocab = charlm.Vocab(text)
    train_ids, val_ids = charlm.split(vocab.encode(text))
    train, val = charlm.CharDataset(train_ids, context), charlm.CharDataset(val_ids, context)
    model = charlm.build(seed, len(vocab), context, **charlm.SIZES[size])
    return Workload(
        "charlm" if size == "small" else f"charlm ({size})",
        model,
        train,
        charlm.loss_fn,
        lambda m: charlm.validation_loss(m, val, batches=8),
        settings,
        {"characters": len(text), "vocab": len(vocab), "train_windows": len(train), "size": size},
    )


def _mlp(seed: int, settings: Settings, train_samples: int = 4096, test_samples: int = 1024) -> Workload:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(1024, 10, generator=g)
    x = torch.randn(train_samples + test_samples, 1024, generator=g)
    y = (x @ teacher).argmax(1)
    torch.manual_seed(seed)
    model = _mlp_net([1024, 3072, 3072, 3072, 10])
    train = TensorDataset(x[:train_samples], y[:train_samples])
    test_x, test_y = x[train_samples:], y[train_samples:]
    return Workload(
        "mlp",
        model,
        train,
        F.cross_entropy,
        lambda m: _accuracy(m, test_x, test_y),
        settings,
        {"train_samples": train_samples, "test_samples": test_samples},
    )


# ---- the user's model -------------------------------------------------------------
def resolve_factory(spec: str) -> Callable:
    """The function named by ``package.module:factory``; ValueError if it cannot be found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model must look like package.module:factory, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--model {spec}: {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"--model {spec}: {attr!r} is not callable")
    return factory


def _custom(spec: str, seed: int, settings: Settings) -> Workload:
    torch.manual_seed(seed)
    made = resolve_factory(spec)()
    if not isinstance(made, tuple) or len(made) != 3:
        raise ValueError(
            f"--model {spec}: the factory must return (model, dataset, loss_fn), got {type(made).__name__}"
        )
    model, dataset, loss_fn = made
    if not isinstance(model, nn.Module) or not callable(loss_fn):
        raise ValueError(f"--model {spec}: the factory must return (nn.Module, Dataset, callable loss_fn)")
    n = len(dataset)
    held = min(1024, max(1, n // 10))
    if n - held < 1:
        raise ValueError(
            f"--model {spec}: the dataset has {n} samples; at least 2 are needed (one to train, one to evaluate)"
        )
    train, test = Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))

    @torch.no_grad()
    def evaluate(module: nn.Module) -> float:
        was = module.training
        module.eval()
        total, count = 0.0, 0
        try:
            for x, y in DataLoader(test, batch_size=256):
                total += float(loss_fn(module(x), y)) * len(y)
                count += len(y)
        finally:
            module.train(was)
        return total / max(count, 1)

    return Workload(spec, model, train, loss_fn, evaluate, settings, {"train_samples": n - held, "test_samples": held})
