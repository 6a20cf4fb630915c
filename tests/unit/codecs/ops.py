"""Counting the ops a codec issues: every aten op that reaches the dispatcher (views included),
on the ``meta`` device, where a GPU's schedule runs without a GPU and without touching memory."""

from __future__ import annotations

from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it (``count``), by name (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        name = str(func.overloadpacket.__name__)
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def ops(fn: Callable[[], object]) -> int:
    """The aten ops ``fn()`` issues."""
    with OpCounter() as counter:
        fn()
    return counter.count
