"""Uneven inputs: ranks that run out of batches keep answering the others' collectives.

Inside ``with model.join():`` every rank announces each event of its training
step (a forward, with or without gradients and synchronization; an optimizer
step) with one small allreduce. A rank whose loop has ended keeps taking part:
for each event the others announce it runs the same event on its side with
nothing to contribute (zero gradients, no optimizer update), so every rank
issues the same sequence of collectives for every algorithm and nobody hangs.
When no rank is left training, all ranks take the parameters and buffers of
the rank that trained longest, so they finish identical (torch's Join
semantics). Gradient averages keep dividing by the full world size unless
``divide_by_initial_world_size=False``.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Callable, Literal, Optional

import torch
import torch.distributed as dist
from torch import nn

from .core import Core
from .engine.comm import AsyncBroadcast, wire_device
from .runtime import private_group

logger = logging.getLogger("unison")

# Event codes: a forward is 1 + grad + 2*sync (1..4); optimizer i's step is STEP + i.
STEP = 8


class JoinHook:
    """What ``Join`` needs of a wrapper (in the spirit of torch's ``JoinHook``): its group,
    the events a rank that ran out of inputs shadows, and the agreement at the end.
    ``DataParallel.join_hook()`` returns one.

    Attributes:
        group: the replicas' process group; ``rank``, ``world_size`` in it.
        tag: the wrapper's tag (names the join's private group).
    """

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        raise NotImplementedError

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def tag(self) -> str:
        raise NotImplementedError

    def attach(self, join: Optional["Join"]) -> None:
        """Route the wrapper's announcements to ``join`` (None: the join has ended)."""
        raise NotImplementedError

    def shadow_step(self, index: int) -> None:
        """Take part in optimizer ``index``'s step of the others, updating nothing."""
        raise NotImplementedError

    def shadow_forward(self, grad: bool, sync: bool) -> None:
        """Take part in a forward (and backward, with ``grad``) of the others, contributing zeros."""
        raise NotImplementedError

    def flush(self) -> None:
        """Finish this rank's pending work (no new collective)."""
        raise NotImplementedError

    def quiesce(self) -> None:
        """Bring every rank's algorithm to a common rest (a collective)."""
        raise NotImplementedError

    def set_divisor(self, active: Optional[int]) -> None:
        """Divide gradient sums by ``active`` ranks (None: by the group's size)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers every rank takes from the one that trained longest."""
        raise NotImplementedError


class CoreJoinHook(JoinHook):
    """``join()``'s view of a wrapper over a ``Core`` (``DataParallel.join_hook()``): the events a
    joined rank shadows, and the end. ``active`` is the join running now (None outside one): the
    wrapper announces its forwards and steps to it.

    Args:
        core: the wrapper's Core (its replica gives the group, rank and world size, read live).
        module: the wrapped module: its parameters and buffers are the ones taken at the end.
        shadow_step: ``fn(optimizer)``: run the others' step of ``optimizer`` here, updating nothing.
    """

    def __init__(self, core: Core, module: nn.Module, shadow_step: Callable[[torch.optim.Optimizer], None]) -> None:
        self.core = core
        self.module = module
        self.step = shadow_step
        self.active: Optional[Join] = None

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self.core.replica.group

    @property
    def rank(self) -> int:
        return self.core.replica.rank

    @property
    def world_size(self) -> int:
        return self.core.replica.world_size

    @property
    def tag(self) -> str:
        return self.core.tag

    def attach(self, join: Optional["Join"]) -> None:
        if join is not None and self.active is not None:
            raise RuntimeError("model.join() is already active; it cannot be nested")
        self.active = join
        if join is None:
            self.set_divisor(None)

    def shadow_step(self, index: int) -> None:
        optimizers = self.core.optimizers
        if index >= len(optimizers):
            raise RuntimeError(
                f"rank {self.rank}: another rank stepped optimizer {index}, this one has {len(optimizers)}"
            )
        self.step(optimizers[index])

    def shadow_forward(self, grad: bool, sync: bool) -> None:
        core = self.core
        core.events.before_forward()
        core.events.after_forward(None)
        if grad and core.reducer is not None:
            with torch.no_grad():
                for _, p in core.replica.trainable:
                    p.grad = None  # nothing to contribute: zeros go out, the average comes back
            core.reducer.shadow_pass(sync)

    def flush(self) -> None:
        self.core.flush()

    def quiesce(self) -> None:
        self.core.events.average()  # async's thread stops after a common round, syncs in flight land

    def set_divisor(self, active: Optional[int]) -> None:
        reducer = self.core.reducer
        if reducer is not None:
            reducer.set_divisor(active)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.module.parameters()) + list(self.module.buffers())


class Join:
    """The context manager ``DataParallel.join()`` returns.

    Args:
        hook: the wrapper's ``join_hook()``.
        divide_by_initial_world_size, enable, throw_on_early_termination: as torch's ``Join``.
    """

    def __init__(
        self,
        hook: JoinHook,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        self.hook = hook
        self.enable = enable and hook.group is not None and hook.world_size > 1
        self.divide = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.events = 0  # this rank's own events, to find the rank that trained longest
        self.group: Optional[dist.ProcessGroup] = None

    def __enter__(self) -> "Join":
        if self.enable:
            self.hook.attach(self)
            self.group = private_group(self.hook.group, f"{self.hook.tag}/join")
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> Literal[False]:
        if not self.enable:
            return False
        try:
            if exc_type is None:
                self._shadow_until_all_done()
                self._take_longest_trained()
        finally:
            self.hook.attach(None)
        return False

    # ---- the ranks still training ---------------------------------------
    def notify(self, code: int) -> None:
        """Announce an event of this rank's step; returns once all ranks know of it."""
        self.events += 1
        active, total, joined = self._exchange(1, code, 0)
        if joined and self.throw:
            raise RuntimeError(
                f"rank {self.hook.rank}: {joined} rank(s) ran out of inputs (model.join(throw_on_early_termination=True))"
            )
        if total != code * active:
            raise RuntimeError(
                f"rank {self.hook.rank}: the ranks still training run different steps "
                f"(event {code} here, mean {total / active:.2f} among {active}): they must run the same loop"
            )
        self._set_scale(active)

    # ---- the ranks that ran out ---------------------------------------
    def _shadow_until_all_done(self) -> None:
        logger.debug("rank %d ran out of inputs: shadowing the others' steps", self.hook.rank)
        self.hook.flush()
        while True:
            active, total, _ = self._exchange(0, 0, 1)
            if self.throw and active:
                raise RuntimeError(
                    f"rank {self.hook.rank} ran out of inputs (model.join(throw_on_early_termination=True))"
                )
            if active == 0:
                return
            self._set_scale(active)
            self._shadow(total // active)

    def _shadow(self, code: int) -> None:
        if code >= STEP:
            self.hook.shadow_step(code - STEP)
        else:
            self.hook.shadow_forward(grad=bool((code - 1) & 1), sync=bool((code - 1) & 2))

    def _take_longest_trained(self) -> None:
        """Everybody takes the parameters and buffers of the rank with the most events."""
        hook = self.hook
        hook.flush()
        hook.quiesce()
        world = hook.world_size
        t = torch.tensor(
            [self.events * world + (world - 1 - hook.rank)], dtype=torch.int64, device=wire_device(self.group)
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        source = world - 1 - int(t.item()) % world
        with torch.no_grad():
            AsyncBroadcast(hook.tensors(), self.group, source).finish()

    # ---- plumbing ---------------------------------------------------------
    def _exchange(self, active: int, code: int, joined: int) -> tuple[int, int, int]:
        t = torch.tensor([active, code, joined], dtype=torch.int64, device=wire_device(self.group))
        dist.all_reduce(t, group=self.group)
        a, c, j = t.tolist()
        return a, c, j

    def _set_scale(self, active: int) -> None:
        self.hook.set_divisor(None if self.divide else active)


def forward_code(grad: bool, sync: bool) -> int:
    """The event code of a forward (see ``STEP``)."""
    return 1 + int(grad) + 2 * int(sync)
