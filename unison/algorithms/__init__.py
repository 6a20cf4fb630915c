"""The algorithms DataParallel can run, by name.

>>> from unison import algorithms
>>> algorithms.create("allreduce")
allreduce(hierarchical=False)

Each algorithm is one module here; ``_BUILTIN`` maps its name to
"module:Class", imported on first use.
"""

from __future__ import annotations

import ast
import importlib
from typing import Any, Union

from .base import Algorithm

_BUILTIN: dict[str, str] = {
    "allreduce": "allreduce:AllReduce",
    "powersgd": "powersgd:PowerSGD",
    "bf16": "lowprec:BF16",
    "fp16": "lowprec:FP16",
    "local_sgd": "local_sgd:LocalSGD",
    "nonblocking": "nonblocking:NonBlocking",
    "bytegrad": "bytegrad:ByteGrad",
    "qadam": "qadam:QAdam",
    "decentralized": "decentralized:Decentralized",
    "low_precision_decentralized": "lowprec_decentralized:LowPrecisionDecentralized",
    "async": "async_average:AsyncModelAverage",
    "daso": "daso:DASO",
    "diloco": "diloco:DiLoCo",
}
_REGISTERED: dict[str, type[Algorithm]] = {}


def names() -> list[str]:
    """The names ``create`` accepts."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available to ``create`` under ``cls.name`` (usable as a decorator)."""
    _REGISTERED[cls.name] = cls
    return cls


def get(name: str) -> type[Algorithm]:
    """The Algorithm class registered under ``name``."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(names())}")
    module, cls = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name: str, **options: Any) -> Algorithm:
    """An algorithm instance by name, with its options validated.

    Options can also be written in the name, as on the command line:
    ``create("powersgd:rank=2,start_iter=0")`` is ``create("powersgd", rank=2, start_iter=0)``.
    """
    name, written = parse(name)
    return get(name)(**{**written, **options})


def parse(text: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the name and its options (values as Python literals)."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"cannot read option {item!r} of {text!r}: write name:key=value,key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()  # a bare word: a string choice such as peer_selection=ring
    return name.strip(), options


def resolve(algorithm: Union[str, Algorithm]) -> Algorithm:
    """An Algorithm from a name or an instance (as DataParallel's argument takes)."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if isinstance(algorithm, str):
        return create(algorithm)
    raise TypeError(f"algorithm must be a name or an Algorithm, not {type(algorithm).__name__}")


__all__ = ["Algorithm", "create", "get", "names", "register", "resolve"]
