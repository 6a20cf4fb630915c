"""What an algorithm supports, checked in one place.

Each capability is declared on the algorithm's class, and only there: ``recovery`` (fault
tolerance: a ``Recovery``), ``fsdp2`` (a module sharded by FSDP2: an ``FSDP2``),
``sparse_gradients`` (parameters of ``nn.Embedding(sparse=True)``). ``check`` reads those
declarations against what the model and the wrapper ask (a ``Context``, fixed when the wrapper is
built) and raises the first refusal, in one order: fault tolerance, then FSDP2, then sparse
gradients. ``DataParallel``'s construction and its ``switch_to`` both call it with the same
context, so an algorithm refused at one is refused at the other, with the same words;
``DistributedOptimizer`` and ``unison train --fault-tolerant`` call it too.

Example::

    from unison.algorithms import as_algorithm, support

    support.check(as_algorithm("diloco"), support.Context(fault_tolerant=True, fsdp2=True))  # raises nothing
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from . import get, names
from .contract import Algorithm

__all__ = ["Context", "check", "supporting"]


@dataclasses.dataclass(frozen=True)
class Context:
    """What the model and the wrapper ask of any algorithm they run.

    Attributes:
        fault_tolerant: the wrapper runs with ``fault_tolerant=True``.
        fsdp2: the module's parameters are FSDP2's shards.
        sparse: the name of the first parameter that gets sparse gradients, if any.
    """

    fault_tolerant: bool = False
    fsdp2: bool = False
    sparse: Optional[str] = None


def supporting(declares: Callable[[type[Algorithm[Any]]], bool]) -> list[str]:
    """The registered algorithms' names whose class ``declares`` something, in registry order."""
    return [name for name in names() if declares(get(name))]


def check(algorithm: Algorithm[Any], context: Context) -> None:
    """Raise the first reason ``algorithm`` cannot run in ``context``: ValueError (fault tolerance,
    sparse gradients) or NotImplementedError (what is not built yet over FSDP2)."""
    if context.fault_tolerant and algorithm.recovery is None:
        able = supporting(lambda cls: cls.recovery is not None)
        raise ValueError(
            f"fault_tolerant=True does not support algorithm {algorithm.name!r}: it declares no Recovery (what a "
            f"failure needs of it; unison.algorithms.Recovery). It supports {', '.join(able)}"
        )
    if context.fsdp2:
        _check_fsdp2(algorithm, context.fault_tolerant)
    if context.sparse is not None and not algorithm.sparse_gradients:
        able = supporting(lambda cls: cls.sparse_gradients)
        raise ValueError(
            f"parameter {context.sparse!r} gets sparse gradients (nn.Embedding/nn.EmbeddingBag with sparse=True), "
            f"which algorithm {algorithm.name!r} cannot reduce (it compresses every gradient in its buckets); "
            f"algorithms that take sparse gradients: {', '.join(able)}. Or build the module with sparse=False"
        )


_GRADIENTS = "averages gradients, which is not built yet over FSDP2 (FSDP2 reduce-scatters them itself)"


def _check_fsdp2(algorithm: Algorithm[Any], fault_tolerant: bool) -> None:
    """What FSDP2 needs: the class's ``fsdp2`` declaration, the options it cannot run with off,
    and under fault tolerance a declaration of it and an unstreamed schedule."""
    name, declared = algorithm.name, algorithm.fsdp2
    if declared is None:
        what = _GRADIENTS if algorithm.reduces_gradients else "is not built yet over FSDP2"
        able = supporting(lambda cls: cls.fsdp2 is not None)
        raise NotImplementedError(
            f"algorithm {name!r} {what}; over a module sharded by FSDP2 use one of {', '.join(able)}"
        )
    if getattr(algorithm, "autotune", False):
        raise NotImplementedError(
            f"{name} with autotune=True is not built yet over FSDP2 (FSDP2 plans its own buckets); use autotune=False"
        )
    if getattr(algorithm, "hierarchical", False):
        raise NotImplementedError(
            f"{name} with hierarchical=True is not built yet over FSDP2: the shard dimension is already the "
            "node's; use hierarchical=False"
        )
    warmup = getattr(algorithm, "warmup_steps", 0)
    if warmup:
        raise NotImplementedError(
            f"{name} with warmup_steps={warmup} averages gradients during its warm-up, which "
            "is not built yet over FSDP2; use warmup_steps=0"
        )
    if not fault_tolerant:
        return
    if not declared.fault_tolerant:
        able = supporting(lambda cls: cls.fsdp2 is not None and cls.fsdp2.fault_tolerant)
        raise NotImplementedError(
            f"fault_tolerant=True over a module sharded by FSDP2 runs {', '.join(able)}; {name} is not "
            "built yet there (a failure inside FSDP2's backward, or a rank-local state, has no recovery yet)"
        )
    schedule = getattr(algorithm, "schedule", None)
    stagger = schedule() if callable(schedule) else None
    if stagger is not None and (stagger.fragments > 1 or stagger.delay > 0):
        raise NotImplementedError(
            f"fault_tolerant=True over a module sharded by FSDP2 runs {name} unstreamed (each sync inside the "
            f"step that launches it); {algorithm.describe()} streams {stagger.fragments} fragment(s) with a delay "
            f"of {stagger.delay}: pass fragments=1, delay=0 (e.g. '{name}:fragments=1,delay=0')"
        )
