"""DiLoCo (Douillard et al. 2023): many local steps, then one outer step on the
averaged change of the weights.

Every rank trains its replica with the user's optimizer on local gradients for
``inner_steps`` steps (the inner optimizer). Then the pseudo-gradient, the
snapshot taken at the last outer step minus the current parameters, is
averaged across ranks and given to an outer optimizer (SGD with Nesterov
momentum) as the gradient of the snapshot; its step gives the new snapshot,
which every rank copies into its parameters. One average of the parameters'
size per ``inner_steps`` steps is all that crosses the network.

Defaults: 16 inner steps, outer lr 0.7, Nesterov momentum 0.5. The paper's
momentum 0.9 (with 500 inner AdamW steps on a language model) lets the outer
steps add up to 0.7 / (1 - 0.9) = 7 times each pseudo-gradient; on top of an
inner SGD with momentum 0.9, as in ``unison train``, that overshoots: the
digits job then diverges at 16 inner steps and stays within a point of
allreduce only when the whole run makes a single outer step. With momentum
0.5 it matches allreduce. Pass ``outer_momentum=0.9`` for the paper's setting.

An inner step is counted once every optimizer given to DataParallel has
stepped (each is expected to step once per iteration).

The outer optimizer owns separate tensors (detached copies of the parameters),
so its gradients and the inner optimizer's never touch. Its state (momenta) is
saved with the snapshot and the step counter in the algorithm's state dict.

With ``inner_steps=1``, outer SGD lr 1 and no momentum, each outer step sets
the parameters to ``snapshot - mean_i(snapshot - x_i)`` = ``mean_i(x_i)``, the
average of one local step from the same point: with a plain SGD inner
optimizer that is synchronous gradient averaging.

``overlap=True`` (delayed application of the outer step): the average is
launched at the outer boundary (step k) and training goes on locally; after
step k + 1 it is collected, the outer step is applied to the snapshot, and the
parameters become ``new snapshot + (x - x at launch)``: the local step taken
meanwhile is kept, and it is counted in the next pseudo-gradient (it lies
between the new snapshot and the parameters), so no progress is lost or
counted twice. The replicas then differ by that one local step; after
``model.average()`` they are identical. ``average()`` keeps the snapshot, so
the averaged local progress since the last outer step goes into the next
pseudo-gradient, counted once as before.

Floating-point buffers (BatchNorm statistics) are averaged in the same
collective at each outer step (with overlap: averaged at launch plus the local
change since), unless DataParallel was built with ``broadcast_buffers=False``.
Integer buffers (batch counters) advance alike on every rank and are left alone.

After loading plain weights without the algorithm's state, restart it with
``model.switch_to("diloco")`` so the snapshot is taken from the loaded weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import comm
from ..averaging import AsyncAverage
from .base import Algorithm, StepCounter, check_int, require_optimizers

#: Wire dtypes of the pseudo-gradient average, by option value.
WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DiLoCo(Algorithm):
    """Local training with an outer Nesterov step on the averaged pseudo-gradient every ``inner_steps`` steps."""

    name = "diloco"
    replicas_drift = True
    reduces_gradients = False
    defaults = {
        "inner_steps": 16,
        "outer_lr": 0.7,
        "outer_momentum": 0.5,
        "nesterov": True,
        "wire_dtype": "fp32",
        "overlap": False,
    }

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.bytes_sent = 0
        self.steps = 0
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.buffers: list[torch.Tensor] = []
        self.snapshot: list[nn.Parameter] = []
        self.outer: Optional[torch.optim.SGD] = None
        self.group = None
        self._counter = StepCounter()
        self._pending: Optional[tuple[AsyncAverage, list[torch.Tensor]]] = None

    def validate(self) -> None:
        o = self.options
        check_int(o, "inner_steps")
        lr = o["outer_lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"outer_lr must be a positive number, got {lr!r}")
        m = o["outer_momentum"]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < 1:
            raise ValueError(f"outer_momentum must be a number in [0, 1), got {m!r}")
        for flag in ("nesterov", "overlap"):
            if not isinstance(o[flag], bool):
                raise ValueError(f"{flag} must be True or False, got {o[flag]!r}")
        if o["nesterov"] and m == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0; set nesterov=False for plain outer SGD")
        if o["wire_dtype"] not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {', '.join(map(repr, WIRE_DTYPES))}, got {o['wire_dtype']!r}")

    # ---- events ---------------------------------------------------------
    def setup(self, model) -> None:
        """Take the snapshot of the (identical) parameters and build the outer optimizer."""
        require_optimizers(model, self.name)
        named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffers = [b for b in model.module.buffers() if b.is_floating_point()] if model.broadcast_buffers else []
        with torch.no_grad():
            self.snapshot = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.snapshot, **self._outer_options())
        if model.process_group is not None and model.world_size > 1:
            self.group = comm.private_group(model.process_group, f"{model.serial}/diloco")

    def after_step(self, model, optimizer) -> None:
        """Count an inner step once every registered optimizer has stepped; run the outer step at the boundary."""
        if not self._counter.step_ended(model, optimizer):
            return
        self._finish()
        self.steps += 1
        if self.steps % self.options["inner_steps"] == 0:
            self._launch()
            if not self.options["overlap"]:
                self._finish()

    def flush(self, model) -> None:
        """Apply an average already in flight (launched on every rank, so waiting starts nothing new)."""
        self._finish()

    def average(self, model) -> None:
        """Apply the average in flight; DataParallel then averages the parameters themselves."""
        self._finish()

    def teardown(self, model) -> None:
        self._finish()
        super().teardown(model)

    # ---- the outer step -------------------------------------------------
    def _outer_options(self) -> dict[str, Any]:
        o = self.options
        return {"lr": o["outer_lr"], "momentum": o["outer_momentum"], "nesterov": o["nesterov"]}

    def _launch(self) -> None:
        """Start averaging the pseudo-gradients (and buffers); remember where the parameters were."""
        with torch.no_grad():
            deltas = [s - p for s, p in zip(self.snapshot, self.params)]
            at_launch = [t.detach().clone() for t in self.params + self.buffers] if self.options["overlap"] else []
            pending = _Local(deltas + self.buffers) if self.group is None else AsyncAverage(
                deltas + self.buffers, self.group, WIRE_DTYPES[self.options["wire_dtype"]]
            )
        self.bytes_sent += pending.wire_bytes
        self._pending = (pending, at_launch)

    def _finish(self) -> None:
        """Collect the average in flight, step the outer optimizer, and write the result into the model."""
        if self._pending is None:
            return
        pending, at_launch = self._pending
        self._pending = None
        averaged = pending.wait()
        n = len(self.params)
        for s, g in zip(self.snapshot, averaged[:n]):
            s.grad = g
        self.outer.step()
        with torch.no_grad():
            for s in self.snapshot:
                s.grad = None
            targets = [s.detach() for s in self.snapshot] + averaged[n:]
            if at_launch:
                for t, new, old in zip(self.params + self.buffers, targets, at_launch):
                    t.copy_(new + (t - old))
            else:
                for t, new in zip(self.params + self.buffers, targets):
                    t.copy_(new)

    # ---- state ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, snapshot (by parameter name) and outer optimizer state; an average in flight is applied first."""
        self._finish()
        return {
            "steps": self.steps,
            "snapshot": {n: s.detach().clone() for n, s in zip(self.names, self.snapshot)},
            "outer_optimizer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly; the outer optimizer keeps this instance's options (lr, momentum, nesterov)."""
        expected = {"steps", "snapshot", "outer_optimizer"}
        if set(state) != expected:
            raise ValueError(f"diloco state must have keys {sorted(expected)}, got {sorted(state)}")
        missing = [n for n in self.names if n not in state["snapshot"]]
        if missing:
            raise ValueError(f"diloco state has no snapshot of parameter {missing[0]!r}")
        self._finish()
        self.steps = int(state["steps"])
        self._counter.pending.clear()
        with torch.no_grad():
            for n, s in zip(self.names, self.snapshot):
                s.copy_(state["snapshot"][n])
        self.outer.load_state_dict(state["outer_optimizer"])
        for group in self.outer.param_groups:
            group.update(self._outer_options())


class _Local:
    """The 'average' over one process: the values themselves, nothing sent."""

    wire_bytes = 0

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._values = [t.detach().clone() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        return self._values
