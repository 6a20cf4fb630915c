"""Hooks that do not keep their object alive.

A hook torch stores (on a tensor, an autograd graph, an optimizer) holds what it calls. A bound
method there would keep a wrapper or an engine, and the process groups they talk over, alive as
long as the user keeps the tensor (the last step's loss, say): a discarded wrapper would never be
released, and a group never let go of at the job's end (runtime/ending.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callable that calls the bound ``method`` while its object lives, and does nothing after."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else target(*args, **kwargs)

    return call
