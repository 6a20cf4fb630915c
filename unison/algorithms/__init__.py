"""The algorithms DataParallel can run, by name.

>>> from unison import algorithms
>>> algorithms.create("allreduce")
allreduce(hierarchical=False)

Each algorithm is one module here; ``_BUILTIN`` maps its name to
"module:Class", imported on first use. ``parse`` reads ``"name:key=value,..."``
for ``create``, ``unison train --algorithm`` and ``unison bench --contenders`` alike.
"""

from __future__ import annotations

import ast
import importlib
from typing import Any, Union

from ..compat.aliases import ALIASES  # a data table: the one import from above (see test_architecture)
from .contract import FSDP2, Algorithm, Recovery, State

_BUILTIN: dict[str, str] = {
    "allreduce": "gradient.allreduce:AllReduce",
    "powersgd": "gradient.powersgd:PowerSGD",
    "bf16": "gradient.cast:BF16",
    "fp16": "gradient.cast:FP16",
    "local_sgd": "averaging.local_sgd:LocalSGD",
    "nonblocking": "gradient.nonblocking:NonBlocking",
    "bytegrad": "gradient.bytegrad:ByteGrad",
    "qadam": "gradient.qadam:QAdam",
    "decentralized": "averaging.decentralized:Decentralized",
    "low_precision_decentralized": "averaging.low_precision_decentralized:LowPrecisionDecentralized",
    "async": "averaging.asynchronous:AsyncModelAverage",
    "daso": "averaging.daso:DASO",
    "diloco": "averaging.diloco:DiLoCo",
    "sparseloco": "averaging.sparseloco:SparseLoCo",
    "demo": "gradient.demo:Demo",
}
_REGISTERED: dict[str, type[Algorithm[Any]]] = {}


def names() -> list[str]:
    """The names ``create`` accepts."""
    return sorted(set(_BUILTIN) | set(_REGISTERED))


def register(cls: type[Algorithm[Any]]) -> type[Algorithm[Any]]:
    """Make ``cls`` available to ``create`` under ``cls.name`` (usable as a decorator)."""
    _REGISTERED[cls.name] = cls
    return cls


def get(name: str) -> type[Algorithm[Any]]:
    """The Algorithm class registered under ``name``."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(names())}")
    module, cls = _BUILTIN[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name: str, **options: Any) -> Algorithm[Any]:
    """An algorithm instance by name, with its options validated.

    Options can also be written in the name, as on the command line:
    ``create("powersgd:rank=2,start_iter=0")`` is ``create("powersgd", rank=2, start_iter=0)``;
    the seeds' names for options work too (``unison.compat.aliases``:
    ``create("local_sgd", communication_interval=4)``). Constructing the class
    itself, ``PowerSGD(rank=2)``, lets mypy check the names.
    """
    name, written = parse(name)
    return get(name).from_options({**written, **options}, ALIASES.get(name, {}))


def parse(text: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,key=value"`` into the name and its options.

    Values are Python literals or JSON words (``2``, ``0.5``, ``True``/``true``,
    ``None``/``null``); anything else is kept as text (``peer_selection=ring``).
    """
    name, _, rest = text.strip().partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"cannot read option {item!r} of {text!r}: write name:key=value,key=value")
        options[key.strip()] = parse_value(value.strip())
    return name.strip(), options


_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> Any:
    """One option value written as text (see ``parse``)."""
    if text in _WORDS:
        return _WORDS[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def as_algorithm(algorithm: Union[str, Algorithm[Any]]) -> Algorithm[Any]:
    """An Algorithm from a name or an instance (as DataParallel's argument takes)."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if isinstance(algorithm, str):
        return create(algorithm)
    raise TypeError(f"algorithm must be a name or an Algorithm, not {type(algorithm).__name__}")


__all__ = ["FSDP2", "Algorithm", "Recovery", "State", "as_algorithm", "create", "get", "names", "register"]
