"""The algorithms DataParallel can run, by name.

>>> from unison import algorithms
>>> algorithms.create("allreduce")
allreduce()
"""

from __future__ import annotations

from typing import Any, Union

from .allreduce import AllReduce
from .base import Algorithm

_REGISTRY: dict[str, type[Algorithm]] = {cls.name: cls for cls in (AllReduce,)}


def names() -> list[str]:
    """The names ``create`` accepts."""
    return sorted(_REGISTRY)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` available to ``create`` under ``cls.name`` (usable as a decorator)."""
    _REGISTRY[cls.name] = cls
    return cls


def create(name: str, **options: Any) -> Algorithm:
    """An algorithm instance by name, with its options validated."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name](**options)


def resolve(algorithm: Union[str, Algorithm]) -> Algorithm:
    """An Algorithm from a name or an instance (as DataParallel's argument takes)."""
    if isinstance(algorithm, Algorithm):
        return algorithm
    if isinstance(algorithm, str):
        return create(algorithm)
    raise TypeError(f"algorithm must be a name or an Algorithm, not {type(algorithm).__name__}")


__all__ = ["Algorithm", "AllReduce", "create", "names", "register", "resolve"]
