"""DiLoCo (Douillard et al. 2023): many local steps, then one outer step on the
averaged change of the weights.

Every rank trains on local gradients with the user's optimizer (the inner one)
for ``period`` steps; then the pseudo-gradient, the snapshot taken at the last
outer step minus the current parameters, is averaged across ranks and given to
an outer SGD with Nesterov momentum, whose step gives the new snapshot that
every rank copies into its parameters. ``overlap=True`` applies the outer step
one inner step late, keeping the local step taken meanwhile.

See docs/algorithms.md#diloco.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..engine.averaging import AsyncAverage
from ..engine.codecs import WIRE_DTYPES
from ..engine.comm import Finished
from .base import Algorithm
from .options import Bool, Choice, Int, Number
from .periodic import CountedState, StepCount


class DiLoCoState(CountedState):
    """The outer optimizer and the snapshot it steps (the reference weights), the step
    count, and the pending sync: the average in flight and, with overlap, the weights
    when it was launched."""

    __slots__ = ("count", "names", "params", "buffers", "snapshot", "outer", "group", "pending")

    def __init__(self, count: StepCount, trainable, buffers: list[torch.Tensor], outer: dict[str, Any], group: Optional[dist.ProcessGroup]) -> None:
        self.count = count
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.buffers = buffers  # floating-point buffers, averaged with the pseudo-gradient
        with torch.no_grad():  # detached copies: the outer and inner optimizers' gradients never meet
            self.snapshot = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.snapshot, **outer)
        self.group = group  # None: one process, the average is the replica itself
        self.pending: Optional[tuple[Any, list[torch.Tensor]]] = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "snapshot": {n: s.detach().clone() for n, s in zip(self.names, self.snapshot)},
            "outer_optimizer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly; the outer optimizer keeps this run's options (lr, momentum, nesterov)."""
        expected = {"steps", "snapshot", "outer_optimizer"}
        if set(state) != expected:
            raise ValueError(f"diloco state must have keys {sorted(expected)}, got {sorted(state)}")
        missing = [n for n in self.names if n not in state["snapshot"]]
        if missing:
            raise ValueError(f"diloco state has no snapshot of parameter {missing[0]!r}")
        if self.pending is not None:  # launched on every rank: let it land, then drop it for the loaded state
            self.pending[0].wait()
            self.pending = None
        self.count.load_state_dict(state)
        with torch.no_grad():
            for n, s in zip(self.names, self.snapshot):
                s.copy_(state["snapshot"][n])
        options = [{k: g[k] for k in ("lr", "momentum", "nesterov")} for g in self.outer.param_groups]
        self.outer.load_state_dict(state["outer_optimizer"])
        for group, values in zip(self.outer.param_groups, options):
            group.update(values)


class DiLoCo(Algorithm):
    """Local training with an outer Nesterov step on the averaged pseudo-gradient every ``period`` steps.

    Args:
        period: inner steps between two outer steps (alias ``inner_steps``, DiLoCo's name).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: its momentum, in [0, 1) (the paper's 0.9: see the docs).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``).
        wire_dtype: ``"fp32"`` (the parameters' own dtype), ``"bf16"`` or ``"fp16"``
            for the average of the pseudo-gradients.
        overlap: apply each outer step one inner step late, its average
            travelling during that step.

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="diloco:period=32,wire_dtype=bf16")
    """

    name = "diloco"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    period = Int(16, aliases=("inner_steps",), doc="inner steps between two outer steps")
    outer_lr = Number(0.7, doc="the outer SGD's learning rate")
    outer_momentum = Number(0.5, low=0.0, open_low=False, high=1.0, doc="the outer SGD's momentum")
    nesterov = Bool(True, doc="Nesterov outer momentum")
    wire_dtype = Choice("fp32", tuple(WIRE_DTYPES), convert=lambda v: None if v == "fp32" else WIRE_DTYPES[v], doc="dtype of the averaged pseudo-gradients")
    overlap = Bool(False, doc="apply each outer step one inner step late")

    def validate(self) -> None:
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0; set nesterov=False for plain outer SGD")

    def setup(self, replica) -> DiLoCoState:
        super().setup(replica)
        buffers = [b for b in replica.buffers if b.is_floating_point()] if replica.broadcast_buffers else []
        group = replica.private_group("diloco") if replica.distributed else None
        outer = {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": self.nesterov}
        return DiLoCoState(StepCount(self.period), replica.trainable, buffers, outer, group)

    def after_step(self, replica, state, optimizer) -> None:
        """Count an inner step; apply an outer step in flight; launch one at the boundary."""
        if not state.count.tick(replica, optimizer):
            return
        self._finish(state)
        if state.count.due():
            self._launch(state)
            if not self.overlap:
                self._finish(state)

    def flush(self, replica, state) -> None:
        """Apply an average already in flight (launched on every rank: waiting starts nothing new)."""
        self._finish(state)

    def average(self, replica, state) -> None:
        """Apply the average in flight; the wrapper then averages the parameters themselves."""
        self._finish(state)

    def _launch(self, state: DiLoCoState) -> None:
        """Start averaging the pseudo-gradients (and buffers); remember where the parameters were."""
        with torch.no_grad():
            tensors = [s - p for s, p in zip(state.snapshot, state.params)] + state.buffers
            at_launch = [t.detach().clone() for t in state.params + state.buffers] if self.overlap else []
            if state.group is None:
                pending = Finished([t.detach().clone() for t in tensors])
            else:
                pending = AsyncAverage(tensors, state.group, self.wire_dtype)
        state.bytes_sent += pending.wire_bytes
        state.pending = (pending, at_launch)

    def _finish(self, state: DiLoCoState) -> None:
        """Collect the average in flight, step the outer optimizer, write the result into the model."""
        if state.pending is None:
            return
        (pending, at_launch), state.pending = state.pending, None
        averaged = pending.wait()
        n = len(state.params)
        for s, g in zip(state.snapshot, averaged[:n]):
            s.grad = g
        state.outer.step()
        with torch.no_grad():
            for s in state.snapshot:
                s.grad = None
            targets = [s.detach() for s in state.snapshot] + averaged[n:]
            if at_launch:  # overlap: keep the local step taken while the average travelled
                for t, new, old in zip(state.params + state.buffers, targets, at_launch):
                    t.copy_(new + (t - old))
            else:
                for t, new in zip(state.params + state.buffers, targets):
                    t.copy_(new)
