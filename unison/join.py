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

import torch
import torch.distributed as dist

from .engine.comm import AsyncBroadcast
from .runtime import private_group

# Event codes: a forward is 1 + grad + 2*sync (1..4); optimizer i's step is STEP + i.
STEP = 8


class Join:
    """The context manager ``DataParallel.join()`` returns (``model`` is that DataParallel)."""

    def __init__(self, model, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
        self.model = model
        self.enable = enable and model.process_group is not None and model.world_size > 1
        self.divide = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.events = 0  # this rank's own events, to find the rank that trained longest

    def __enter__(self) -> "Join":
        if self.enable:
            if self.model._join is not None:
                raise RuntimeError("model.join() is already active; it cannot be nested")
            self.group = private_group(self.model.process_group, f"{self.model.serial}/join")
            self.model._join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enable:
            return False
        try:
            if exc_type is None:
                self._shadow_until_all_done()
                self._take_longest_trained()
        finally:
            self.model._join = None
            if self.model._reducer is not None:
                self.model._reducer.set_divisor(None)
        return False

    # ---- the ranks still training ---------------------------------------
    def notify(self, code: int) -> None:
        """Announce an event of this rank's step; returns once all ranks know of it."""
        self.events += 1
        active, total, joined = self._exchange(1, code, 0)
        if joined and self.throw:
            raise RuntimeError(
                f"rank {self.model.rank}: {joined} rank(s) ran out of inputs (model.join(throw_on_early_termination=True))"
            )
        if total != code * active:
            raise RuntimeError(
                f"rank {self.model.rank}: the ranks still training run different steps "
                f"(event {code} here, mean {total / active:.2f} among {active}): they must run the same loop"
            )
        self._set_scale(active)

    # ---- the ranks that ran out ---------------------------------------
    def _shadow_until_all_done(self) -> None:
        model = self.model
        model.flush()
        while True:
            active, total, _ = self._exchange(0, 0, 1)
            if self.throw and active:
                raise RuntimeError(f"rank {model.rank} ran out of inputs (model.join(throw_on_early_termination=True))")
            if active == 0:
                return
            self._set_scale(active)
            self._shadow(total // active)

    def _shadow(self, code: int) -> None:
        model = self.model
        if code >= STEP:
            index = code - STEP
            if index >= len(model.optimizers):
                raise RuntimeError(f"rank {model.rank}: another rank stepped optimizer {index}, this one has {len(model.optimizers)}")
            model._before_step(model.optimizers[index], shadow=True)
            model._after_step(model.optimizers[index], shadow=True)
            return
        grad, sync = bool((code - 1) & 1), bool((code - 1) & 2)
        model._events.before_forward()
        model._events.after_forward(None)
        if grad and model._reducer is not None:
            with torch.no_grad():
                for _, p in model._trainable:
                    p.grad = None  # nothing to contribute: zeros go out, the average comes back
            model._reducer.shadow_pass(sync)

    def _take_longest_trained(self) -> None:
        """Everybody takes the parameters and buffers of the rank with the most events."""
        model = self.model
        model.flush()
        model._events.average()  # quiesce: async's thread stops after a common round, syncs in flight land
        t = torch.tensor([self.events * model.world_size + (model.world_size - 1 - model.rank)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        source = model.world_size - 1 - int(t.item()) % model.world_size
        tensors = list(model.module.parameters()) + list(model.module.buffers())
        with torch.no_grad():
            AsyncBroadcast(tensors, self.group, source).finish()

    # ---- plumbing ---------------------------------------------------------
    def _exchange(self, active: int, code: int, joined: int) -> tuple[int, int, int]:
        t = torch.tensor([active, code, joined], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        a, c, j = t.tolist()
        return a, c, j

    def _set_scale(self, active: int) -> None:
        reducer = self.model._reducer
        if reducer is not None:
            reducer.set_divisor(None if self.divide else active)


def forward_code(grad: bool, sync: bool) -> int:
    return 1 + int(grad) + 2 * int(sync)
