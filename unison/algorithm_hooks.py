"""What the wrappers keep behind a Replica: the hooks registered for the running
algorithm, the GradScalers they watch, and the clock that says when a training
step ends.

An algorithm registers hooks through the Replica (``on_forward``,
``on_optimizer_step``, ...); the wrapper runs them and removes them when the
algorithm leaves. Nothing here is an algorithm's to call.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

StepFn = Callable[[torch.optim.Optimizer], None]


class StepClock:
    """Counts training steps: one ends when every registered optimizer has stepped since the last.

    Args:
        optimizers: the wrapper's optimizers (a live list).
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.steps = 0
        self._stepped: set[int] = set()
        self._ended_by: Optional[torch.optim.Optimizer] = None

    def record(self, optimizer: torch.optim.Optimizer) -> None:
        """Note that ``optimizer`` stepped (the wrapper calls it once per step)."""
        self._stepped.add(id(optimizer))
        self._ended_by = None
        if len(self._stepped) >= len(self.optimizers):
            self._stepped.clear()
            self.steps += 1
            self._ended_by = optimizer

    def ended(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step, just recorded, completed a training step."""
        return self._ended_by is optimizer


class Hooks:
    """The hooks registered for the running algorithm, and the GradScalers the wrapper watches.

    Args:
        clock: counts a replaced optimizer step when it is called.
        on_replaced_step: called with the optimizer after a replaced step is called and counted
            (the training step the user took: fault tolerance commits it there).
    """

    def __init__(self, clock: StepClock, on_replaced_step: Optional[StepFn] = None) -> None:
        self.clock = clock
        self.on_replaced_step = on_replaced_step
        self._handles: list[RemovableHandle] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self._scaler_fns: list[Callable[[Any], None]] = []
        self._scaler_patches: list[tuple[Any, str, Any]] = []  # the wrapper's, kept until it closes
        self._before: list[StepFn] = []
        self._after: list[StepFn] = []
        self._replaced: set[int] = set()

    # ---- registered by the algorithm (through the Replica) --------------------------
    def on_forward(self, module: nn.Module, fn: Callable[[], None]) -> None:
        self._handles.append(module.register_forward_pre_hook(lambda _m, _inputs: fn()))

    def on_forward_end(self, module: nn.Module, fn: Callable[[], None]) -> None:
        def ended(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            fn()  # returns None: the output is left as it is

        self._handles.append(module.register_forward_hook(ended, always_call=True))

    def on_optimizer_step(self, before: Optional[StepFn], after: Optional[StepFn]) -> None:
        if before is not None:
            self._before.append(before)
        if after is not None:
            self._after.append(after)

    def replace_optimizer_methods(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], zero_grad: Callable[..., Any]
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        originals = (optimizer.step, optimizer.zero_grad)
        clock, told = self.clock, self.on_replaced_step

        def counted_step(opt: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
            result = step(opt, closure)
            clock.record(opt)
            if told is not None:
                told(opt)
            return result

        for attr, fn in (("step", counted_step), ("zero_grad", zero_grad)):
            _patch(self._patches, optimizer, attr, types.MethodType(fn, optimizer))
        self._replaced.add(id(optimizer))
        return originals

    def on_scaler_update(self, fn: Callable[[Any], None]) -> None:
        self._scaler_fns.append(fn)

    # ---- run by the wrapper -----------------------------------------------------------
    def replaced(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the algorithm replaced ``optimizer.step`` (that step counts itself)."""
        return id(optimizer) in self._replaced

    def run_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        for fn in list(self._before):
            fn(optimizer)

    def run_after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for fn in list(self._after):
            fn(optimizer)

    def watch_scaler(self, scaler: Any) -> None:
        """Tell the algorithm's scaler hooks after every ``scaler.update()`` (once per scaler)."""
        if any(s is scaler for s, _, _ in self._scaler_patches):
            return
        update = scaler.update

        def update_and_tell(*args: Any, **kwargs: Any) -> Any:
            result = update(*args, **kwargs)
            for fn in list(self._scaler_fns):
                fn(scaler)
            return result

        _patch(self._scaler_patches, scaler, "update", update_and_tell)

    @property
    def module_hooks(self) -> tuple[RemovableHandle, ...]:
        """The handles of the forward hooks on modules (a pickled wrapper leaves them out)."""
        return tuple(self._handles)

    def keep(self, handle: Any) -> None:
        """Remove ``handle`` (anything with ``remove()``) with the algorithm's other hooks."""
        self._handles.append(handle)

    def remove(self) -> None:
        """Remove every hook registered for the algorithm (it is leaving)."""
        for handle in self._handles:
            handle.remove()
        _unpatch(self._patches)
        self._handles, self._scaler_fns = [], []
        self._before, self._after = [], []
        self._replaced = set()

    def restore_scalers(self) -> None:
        """Give every watched GradScaler its own ``update`` back (the wrapper is closing)."""
        _unpatch(self._scaler_patches)


def _patch(patches: list[tuple[Any, str, Any]], obj: Any, attr: str, value: Any) -> None:
    """Set ``obj.attr`` on the instance, noting in ``patches`` what to restore."""
    patches.append((obj, attr, obj.__dict__.get(attr)))
    setattr(obj, attr, value)


def _unpatch(patches: list[tuple[Any, str, Any]]) -> None:
    """Undo ``_patch``es, newest first (an attribute that came from the class is simply removed)."""
    for obj, attr, previous in reversed(patches):
        if previous is None:
            obj.__dict__.pop(attr, None)
        else:
            setattr(obj, attr, previous)
    patches.clear()


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` kept out of torch.compile: traced, a call to it runs eagerly between the module's
    graphs (``torch.compiler.disable``); otherwise it is a plain call. The disabled function is
    made at the first traced call, as torch DDP's ``torch._disable_dynamo`` makes it: decorating
    with ``torch.compiler.disable`` would import torch._dynamo (and sympy) into every process
    that imports unison, 2-3 s at start and about 1 s at exit, compiled or not."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        disabled = getattr(fn, "_unison_disabled", None)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
            fn._unison_disabled = disabled  # type: ignore[attr-defined]
        return disabled(*args, **kwargs)

    return call
