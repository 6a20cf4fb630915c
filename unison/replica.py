"""The Replica: all an algorithm may see and do of the model it keeps in agreement.

DataParallel and DistributedOptimizer each build one (through their
``unison.core.Core``). It holds what is trained (parameters, buffers,
optimizers), where it talks (group, rank, world size, node layout, private
groups), the gradient engine's narrow face, hooks that the wrapper owns and
removes when the algorithm leaves, and the one definition of when a training
step ends. Nothing on it is wrapper plumbing: the wrapper runs the hooks and the
clock (``unison.algorithm_hooks``) from its own side.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import runtime
from .algorithm_hooks import Hooks, StepClock, StepFn
from .engine.buckets import Bucket
from .engine.reducer import GradReducer


class Wiring(Protocol):
    """What a wrapper gives its Replica to read: the engine running now, the bucket size,
    the hooks and the step clock (``unison.core.Core`` is one)."""

    @property
    def reducer(self) -> Optional[GradReducer]: ...

    @property
    def bucket_cap_mb(self) -> float: ...

    @property
    def hooks(self) -> Hooks: ...

    @property
    def clock(self) -> StepClock: ...

    @property
    def fault_tolerant(self) -> bool: ...

    @property
    def saved_on_host(self) -> bool: ...

    @property
    def commits_by_node(self) -> bool: ...

    def commit(self, ok: bool) -> None: ...


class Standalone:
    """The wiring of a Replica with no wrapper (unit tests): no engine, fresh hooks and clock."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], bucket_cap_mb: float = 25) -> None:
        self.reducer: Optional[GradReducer] = None
        self.bucket_cap_mb = bucket_cap_mb
        self.clock = StepClock(optimizers)
        self.hooks = Hooks(self.clock)
        self.fault_tolerant = False
        self.saved_on_host = False
        self.commits_by_node = False

    def commit(self, ok: bool) -> None:
        pass


class Replica:
    """What an algorithm sees of one model replica.

    Args:
        named_parameters: ``(name, parameter)`` pairs of everything trained.
        named_buffers: ``(name, buffer)`` pairs (BatchNorm statistics).
        optimizers: the optimizers registered with the wrapper (a live list).
        group: the process group of the replicas (None without torch.distributed).
        tag: a name unique to the wrapper, the same on every rank; it keys
            the private groups.
        wiring: the wrapper's side (default: none, as in a unit test).
        modules: the modules whose forwards the algorithm may hook (empty for
            an optimizer-side wrapper).
        broadcast_buffers: whether buffers follow rank 0's.
        requires_grad: per parameter, whether it is trained, where the tensors cannot say
            (the local shards of FSDP2's DTensors; default: each tensor's ``requires_grad``).

    Example::

        def after_step(self, replica: Replica, state: MyState, optimizer: torch.optim.Optimizer) -> None:
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
        wiring: Optional[Wiring] = None,
        modules: Sequence[nn.Module] = (),
        broadcast_buffers: bool = True,
        requires_grad: Optional[Sequence[bool]] = None,
    ) -> None:
        self.named_parameters = list(named_parameters)
        if requires_grad is not None and len(requires_grad) != len(self.named_parameters):
            raise ValueError(
                f"requires_grad has {len(requires_grad)} flags for {len(self.named_parameters)} parameters"
            )
        # FSDP2's local shards cannot say whether they are trained: their DTensors' flags, fixed at
        # construction; otherwise each tensor's own, read as ``named_parameters`` stands now
        # (DistributedOptimizer.add_param_group replaces it).
        self._requires_grad = list(requires_grad) if requires_grad is not None else None
        self.named_buffers = list(named_buffers)
        self.optimizers = optimizers
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self._tag = tag
        self.modules = list(modules)
        self.broadcast_buffers = broadcast_buffers
        self._wiring: Wiring = wiring if wiring is not None else Standalone(optimizers)

    def regroup(self, group: Optional[dist.ProcessGroup]) -> None:
        """Talk over ``group`` from now on (fault tolerance built the world again)."""
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0

    # ---- what is trained ------------------------------------------------------
    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters]

    @property
    def requires_grad(self) -> list[bool]:
        """Per parameter, whether it is trained."""
        if self._requires_grad is not None:
            return self._requires_grad
        return [p.requires_grad for _, p in self.named_parameters]

    @property
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of the parameters that require grad."""
        return [(n, p) for (n, p), trained in zip(self.named_parameters, self.requires_grad) if trained]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [b for _, b in self.named_buffers]

    @property
    def float_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, buffer)`` of the floating-point buffers: those averaged with the weights
        (BatchNorm's running statistics; not its integer batch count)."""
        return [(n, b) for n, b in self.named_buffers if b.is_floating_point()]

    @property
    def distributed(self) -> bool:
        """Whether there are other replicas to talk to."""
        return self.group is not None and self.world_size > 1

    @property
    def fault_tolerant(self) -> bool:
        """Whether failures are recovered from (``DataParallel(fault_tolerant=True)``): an interrupted
        gradient round is then done again, and an algorithm keeps what it needs to do it once."""
        return self._wiring.fault_tolerant

    @property
    def saved_on_host(self) -> bool:
        """Whether what fault tolerance keeps to redo a round lives in host memory
        (``DataParallel(ft_offload=True)``): an algorithm's own copies for it go there too
        (``unison.engine.offload.empty_like``)."""
        return self._wiring.saved_on_host

    @property
    def commits_by_node(self) -> bool:
        """Whether the node's processes decide together whether a round of the algorithm's own
        is applied (``commit``: fault tolerance over FSDP2): its result is then held, not written
        into the model, until ``commit`` has returned."""
        return self._wiring.commits_by_node

    def commit(self, ok: bool) -> None:
        """Before a round of the algorithm's own is applied, once its wait returned (``ok``) or
        raised: where the node decides together (``commits_by_node``), raise ``MembershipChanged``
        if another process of the node did not complete its round, so that the node applies a
        round on all its shards or on none (a process whose wait raised raises its own error
        after this call). Nothing elsewhere."""
        self._wiring.commit(ok)

    def saved_gradients(self, bucket: Bucket) -> Optional[list[torch.Tensor]]:
        """Under fault tolerance, the copies of ``bucket``'s local gradients that the backward pass
        in flight keeps to redo its round after a failure (unscaled, parameter by parameter; in
        host memory with ``ft_offload=True``); None otherwise.

        The redo feeds them to the engine as the members' gradients, scaled as the new membership
        says (``gradient_scale``). An algorithm whose round changes state of its own can undo it
        from them instead of keeping a copy of that state: compute the state as it was before the
        round back (powersgd's residual), or rewrite them so that the redo, folded into the state
        the round left, gives what the round folded (demo's momentum).
        """
        engine = self._wiring.reducer
        return engine.saved(bucket) if engine is not None and self.fault_tolerant else None

    @property
    def gradient_scale(self) -> float:
        """What the buckets of the backward pass in flight hold the local gradients multiplied by
        (``Algorithm.grad_scale``, over the members a redo averages)."""
        engine = self._wiring.reducer
        return engine.scale if engine is not None else 1.0

    # ---- where it talks ----------------------------------------------------------
    @property
    def topology(self) -> runtime.Topology:
        """The node layout from ``unison.init()``."""
        return runtime.topology()

    def private_group(self, tag: str, group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
        """A private copy of ``group`` (default: the replicas' group) for the algorithm's own
        collectives, found again under the same ``tag`` after a switch."""
        return runtime.private_group(self.group if group is None else group, f"{self._tag}/{tag}")

    # ---- the gradient engine's narrow face --------------------------------------
    @property
    def bucket_cap_mb(self) -> float:
        """The gradient bucket size the user asked for, in MiB."""
        return self._wiring.bucket_cap_mb

    @property
    def buckets(self) -> list[Bucket]:
        engine = self._wiring.reducer
        return engine.buckets if engine is not None else []

    def complete(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Wait for the reductions of ``buckets`` (default: all) of the last backward."""
        engine = self._wiring.reducer
        if engine is not None:
            engine.complete(buckets)

    @property
    def in_flight(self) -> bool:
        """Whether reductions of the last backward are still unfinished."""
        engine = self._wiring.reducer
        return engine is not None and engine.unfinished

    def bucket_of(self, param: torch.Tensor) -> Optional[int]:
        """The index of the bucket holding ``param``'s gradient (None if it has none)."""
        engine = self._wiring.reducer
        return None if engine is None else engine.bucket_of(param)

    @property
    def gradient_group(self) -> Optional[dist.ProcessGroup]:
        """The group the engine averages gradients over (None when no engine runs)."""
        engine = self._wiring.reducer
        return None if engine is None else engine.group

    def bucket_plan(self, cap_bytes: int) -> list[list[int]]:
        """How the engine would group the gradients at ``cap_bytes`` per bucket (parameter positions)."""
        engine = self._wiring.reducer
        return [] if engine is None else engine.plan(cap_bytes)

    def set_bucket_size(self, cap_bytes: int) -> None:
        """Re-plan the buckets at ``cap_bytes`` each (the same value on every rank)."""
        engine = self._wiring.reducer
        if engine is not None:
            engine.set_bucket_cap(cap_bytes)

    # ---- hooks the wrapper owns ---------------------------------------------------
    def on_forward(self, module: nn.Module, fn: Callable[[], None]) -> None:
        """Call ``fn()`` before every forward of ``module``."""
        self._wiring.hooks.on_forward(module, fn)

    def on_forward_end(self, module: nn.Module, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after every forward of ``module``, also one that raised."""
        self._wiring.hooks.on_forward_end(module, fn)

    def on_optimizer_step(self, before: Optional[StepFn] = None, after: Optional[StepFn] = None) -> None:
        """Call ``before(optimizer)`` / ``after(optimizer)`` around every registered optimizer's
        step (from the wrapper's own step hooks: ``after`` runs after the algorithm's after_step)."""
        self._wiring.hooks.on_optimizer_step(before, after)

    def replace_optimizer_methods(
        self, optimizer: torch.optim.Optimizer, step: Callable[..., Any], zero_grad: Callable[..., Any]
    ) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Make ``optimizer.step(closure=None)`` call ``step(optimizer, closure)`` and ``zero_grad``
        call ``zero_grad(optimizer, set_to_none)``; returns the original (step, zero_grad).

        A replaced step still counts as a training step (``step_ended``).
        """
        return self._wiring.hooks.replace_optimizer_methods(optimizer, step, zero_grad)

    def on_scaler_update(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(scaler)`` after ``scaler.update()`` of every GradScaler given to the wrapper."""
        self._wiring.hooks.on_scaler_update(fn)

    # ---- when a training step ends -------------------------------------------------
    @property
    def steps(self) -> int:
        """Training steps taken (every registered optimizer stepped once more)."""
        return self._wiring.clock.steps

    def step_ended(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step, just taken, completed a training step (every
        registered optimizer has stepped since the last one)."""
        return self._wiring.clock.ended(optimizer)
