"""The Replica: all an algorithm may see and do of the model it keeps in agreement.

DataParallel and DistributedOptimizer each build one. It holds what is trained
(parameters, buffers, optimizers), where it talks (group, rank, world size,
node layout, private groups), the gradient engine's narrow face, hooks that the
wrapper owns and removes when the algorithm leaves, and the one definition of
when a training step ends.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import runtime


class Replica:
    """What an algorithm sees of one model replica.

    Args:
        named_parameters: ``(name, parameter)`` pairs of everything trained.
        named_buffers: ``(name, buffer)`` pairs (BatchNorm statistics).
        optimizers: the optimizers registered with the wrapper (a live list).
        group: the process group of the replicas (None without torch.distributed).
        tag: a name unique to the wrapper, the same on every rank; it keys
            the private groups.
        modules: the modules whose forwards the algorithm may hook (empty for
            an optimizer-side wrapper).
        broadcast_buffers: whether buffers follow rank 0's.
        bucket_cap_mb: the gradient bucket size the user asked for.

    Example::

        def after_step(self, replica, state, optimizer):
            if replica.step_ended(optimizer) and replica.steps % 16 == 0:
                average_(replica.parameters, replica.group)
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        named_buffers: Sequence[tuple[str, torch.Tensor]],
        optimizers: list[torch.optim.Optimizer],
        group: Optional[dist.ProcessGroup],
        tag: str,
        modules: Sequence[nn.Module] = (),
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25,
    ) -> None:
        self.named_parameters = list(named_parameters)
        self.named_buffers = list(named_buffers)
        self.optimizers = optimizers
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.tag = tag
        self.modules = list(modules)
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = bucket_cap_mb
        self.engine = None  # the GradReducer, while one runs (set by the wrapper)
        # Training steps: one ends when every registered optimizer has stepped since the last.
        self.steps = 0
        self._stepped: set[int] = set()
        self._ended_by: Optional[torch.optim.Optimizer] = None
        # Hooks registered for the running algorithm, removed by remove_hooks().
        self._handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self._scaler_fns: list[Callable[[Any], None]] = []
        self._scaler_patches: list[tuple[Any, str, Any]] = []  # the wrapper's, kept until it closes
        self._step_before: list[Callable] = []
        self._step_after: list[Callable] = []
        self.replaced_steps: set[int] = set()

    # ---- what is trained ------------------------------------------------------
    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters]

    @property
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the parameters that require grad."""
        return [(n, p) for n, p in self.named_parameters if p.requires_grad]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [b for _, b in self.named_buffers]

    @property
    def distributed(self) -> bool:
        """Whether there are other replicas to talk to."""
        return self.group is not None and self.world_size > 1

    # ---- where it talks ----------------------------------------------------------
    @property
    def topology(self) -> runtime.Topology:
        """The node layout from ``unison.init()``."""
        return runtime.topology()

    def private_group(self, tag: str, group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
        """A private copy of ``group`` (default: the replicas' group) for the algorithm's own
        collectives, found again under the same ``tag`` after a switch."""
        return runtime.private_group(self.group if group is None else group, f"{self.tag}/{tag}")

    # ---- the gradient engine's narrow face --------------------------------------
    @property
    def buckets(self) -> list:
        return self.engine.buckets if self.engine is not None else []

    def complete(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Wait for the reductions of ``buckets`` (default: all) of the last backward."""
        if self.engine is not None:
            self.engine.complete(buckets)

    @property
    def in_flight(self) -> bool:
        """Whether reductions of the last backward are still unfinished."""
        return self.engine is not None and self.engine.unfinished

    def bucket_of(self, param: torch.Tensor) -> Optional[int]:
        """The index of the bucket holding ``param``'s gradient (None if it has none)."""
        return None if self.engine is None else self.engine.bucket_of(param)

    @property
    def gradient_group(self) -> Optional[dist.ProcessGroup]:
        """The group the engine averages gradients over (None when no engine runs)."""
        return None if self.engine is None else self.engine.group

    def bucket_plan(self, cap_bytes: int) -> list[list[int]]:
        """How the engine would group the gradients at ``cap_bytes`` per bucket (parameter positions)."""
        return [] if self.engine is None else self.engine.plan(cap_bytes)

    def set_bucket_size(self, cap_bytes: int) -> None:
        """Re-plan the buckets at ``cap_bytes`` each (the same value on every rank)."""
        if self.engine is not None:
            self.engine.set_bucket_cap(cap_bytes)

    # ---- hooks the wrapper owns ---------------------------------------------------
    def on_forward(self, module: nn.Module, fn: Callable[[], None]) -> None:
        """Call ``fn()`` before every forward of ``module``."""
        self._handles.append(module.register_forward_pre_hook(lambda _m, _inputs: fn()))

    def on_optimizer_step(self, before: Optional[Callable] = None, after: Optional[Callable] = None) -> None:
        """Call ``before(optimizer)`` / ``after(optimizer)`` around every registered optimizer's
        step (from the wrapper's own step hooks: ``after`` runs after the algorithm's after_step)."""
        if before is not None:
            self._step_before.append(before)
        if after is not None:
            self._step_after.append(after)

    def run_before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The wrapper's pre-step hook calls this."""
        for fn in list(self._step_before):
            fn(optimizer)

    def run_after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The wrapper's post-step hook calls this, last."""
        for fn in list(self._step_after):
            fn(optimizer)

    def replace_optimizer_methods(self, optimizer: torch.optim.Optimizer, step: Callable, zero_grad: Callable) -> tuple[Callable, Callable]:
        """Make ``optimizer.step(closure=None)`` call ``step(optimizer, closure)`` and ``zero_grad``
        call ``zero_grad(optimizer, set_to_none)``; returns the original (step, zero_grad).

        A replaced step still counts as a training step (``step_ended``).
        """
        originals = (optimizer.step, optimizer.zero_grad)

        def counted_step(opt, closure=None):
            result = step(opt, closure)
            self.record_step(opt)
            return result

        for attr, fn in (("step", counted_step), ("zero_grad", zero_grad)):
            _patch(self._patches, optimizer, attr, types.MethodType(fn, optimizer))
        self.replaced_steps.add(id(optimizer))
        return originals

    def on_scaler_update(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(scaler)`` after ``scaler.update()`` of every GradScaler given to the wrapper."""
        self._scaler_fns.append(fn)

    def add_scaler(self, scaler: Any) -> None:
        """Watch ``scaler.update()`` (the wrapper's ``add_scaler``)."""
        if any(s is scaler for s, _, _ in self._scaler_patches):
            return
        update = scaler.update

        def update_and_tell(*args: Any, **kwargs: Any):
            result = update(*args, **kwargs)
            for fn in list(self._scaler_fns):
                fn(scaler)
            return result

        _patch(self._scaler_patches, scaler, "update", update_and_tell)

    def restore_scalers(self) -> None:
        """Give every watched GradScaler its own ``update`` back (the wrapper is closing)."""
        _unpatch(self._scaler_patches)

    def remove_hooks(self) -> None:
        """Remove every hook registered for the algorithm (it is leaving)."""
        for handle in self._handles:
            handle.remove()
        _unpatch(self._patches)
        self._handles, self._scaler_fns = [], []
        self._step_before, self._step_after = [], []
        self.replaced_steps = set()

    # ---- when a training step ends -------------------------------------------------
    def record_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Note that ``optimizer`` stepped (the wrapper calls it once per step)."""
        self._stepped.add(id(optimizer))
        self._ended_by = None
        if len(self._stepped) >= len(self.optimizers):
            self._stepped.clear()
            self.steps += 1
            self._ended_by = optimizer

    def step_ended(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step, just taken, completed a training step (every
        registered optimizer has stepped since the last one)."""
        return self._ended_by is optimizer


def _patch(patches: list, obj: Any, attr: str, value: Any) -> None:
    """Set ``obj.attr`` on the instance, noting in ``patches`` what to restore."""
    patches.append((obj, attr, obj.__dict__.get(attr)))
    setattr(obj, attr, value)


def _unpatch(patches: list) -> None:
    """Undo ``_patch``es, newest first (an attribute that came from the class is simply removed)."""
    for obj, attr, previous in reversed(patches):
        if previous is None:
            obj.__dict__.pop(attr, None)
        else:
            setattr(obj, attr, previous)
    patches.clear()
