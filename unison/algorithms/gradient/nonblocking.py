"""Non-blocking parameter updates (HeAT's ``blocking_parameter_updates=False``).

Gradients are averaged as with "allreduce", but neither the end of backward nor
``optimizer.step()`` waits: each layer's update (and ``zero_grad``) is applied
just before that layer's next forward, once its bucket has arrived, with the
hyperparameters of the ``step()`` call, so the trajectory equals "allreduce".
Under ``fault_tolerant=True`` the reduction completes at the end of backward (a
failure must be known before the step is committed); the updates still land at
the next forward. See docs/algorithms.md#nonblocking for what a user must not do meanwhile.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree
from torch.optim import Optimizer

from ...replica import Replica
from ..contract import Recovery
from .allreduce import AllReduceState, BucketAllReduce


class _Pending:
    """One optimizer's deferred step: its hyperparameters then, what is done, and a deferred zero_grad."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.done: set[int] = set()
        self.zero: Optional[bool] = None  # set_to_none of a deferred zero_grad


class NonBlockingState(AllReduceState):
    """The deferred steps, and each optimizer's real step and zero_grad."""

    __slots__ = ("pending", "originals")

    def __init__(self, base: AllReduceState) -> None:
        super().__init__(base.tuner, base.levels)
        self.pending: dict[int, _Pending] = {}
        self.originals: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}


class NonBlocking(BucketAllReduce[NonBlockingState]):
    """Gradient averaging whose updates land layer by layer at the next forward (HeAT's non-blocking mode).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="nonblocking")
    """

    name = "nonblocking"
    defers_completion = True
    # Under fault tolerance the step is committed when step() records it, the round completes at the
    # end of backward (a cut round is redone before any layer is updated), and a recorded step is
    # applied whole before a membership change is settled: every committed step is in the weights.
    recovery = Recovery(deferred_step=True)

    def setup(self, replica: Replica) -> NonBlockingState:
        if not replica.optimizers:
            raise ValueError(
                "nonblocking applies each layer's update just before that layer's next forward, so it needs the "
                "optimizer(s): DataParallel(module, optimizer=opt, algorithm='nonblocking')"
            )
        state = NonBlockingState(self.base_state(replica))
        for opt in replica.optimizers:
            state.originals[id(opt)] = replica.replace_optimizer_methods(
                opt, partial(self._deferred_step, replica, state), partial(self._deferred_zero_grad, state)
            )
        for m in replica.modules:
            params = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if params:
                replica.on_forward(m, partial(self._layer_hook, replica, state, params))
        return state

    # ---- what the user's calls now do ---------------------------------
    def _deferred_step(
        self, replica: Replica, state: NonBlockingState, opt: Optimizer, closure: Optional[Callable[[], Any]]
    ) -> None:
        """Record the step instead of taking it (the real one runs layer by layer later)."""
        if closure is not None:
            raise ValueError("nonblocking cannot defer an optimizer step with a closure")
        if id(opt) in state.pending:  # a second step() before any forward
            self.flush(replica, state)
        state.pending[id(opt)] = _Pending(opt)

    def _deferred_zero_grad(self, state: NonBlockingState, opt: Optimizer, set_to_none: bool = True) -> None:
        pending = state.pending.get(id(opt))
        if pending is None:
            state.originals[id(opt)][1](set_to_none=set_to_none)
        else:
            pending.zero = set_to_none

    # ---- applying updates -------------------------------------------------
    def before_forward(self, replica: Replica, state: NonBlockingState) -> None:
        if not torch.is_grad_enabled():
            self.flush(replica, state)  # no graph to check afterwards: update everything first
            return
        replica.complete(buckets=[])  # flags and buffers: needed by every layer
        super().before_forward(replica, state)

    def after_forward(self, replica: Replica, state: NonBlockingState, output: Any) -> None:
        """Finish updates whose layers did not run; refuse if such a parameter was used anyway."""
        leftovers = {
            id(p): p
            for opt in replica.optimizers
            if id(opt) in state.pending
            for g in opt.param_groups
            for p in g["params"]
            if id(p) not in state.pending[id(opt)].done and p.requires_grad
        }
        if not leftovers:
            return
        stale = [p for p in _graph_leaves(output) if id(p) in leftovers]
        if stale:
            names = {id(p): n for n, p in replica.named_parameters}
            raise RuntimeError(
                f"nonblocking: parameter {names.get(id(stale[0]), '?')!r} was used in forward outside its own "
                "module's forward, before its deferred update was applied; use algorithm 'allreduce' for this model"
            )
        self.flush(replica, state)

    def _layer_hook(self, replica: Replica, state: NonBlockingState, params: list[torch.nn.Parameter]) -> None:
        if state.pending or replica.in_flight:
            self._apply(replica, state, params)

    def _apply(self, replica: Replica, state: NonBlockingState, params: list[torch.nn.Parameter]) -> None:
        buckets = {b for b in (replica.bucket_of(p) for p in params) if b is not None}
        replica.complete(sorted(buckets))
        for opt in replica.optimizers:
            pending = state.pending.get(id(opt))
            if pending is None:
                continue
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            todo = [p for p in params if id(p) in mine and id(p) not in pending.done]
            if todo:
                self._step_only(state, opt, pending, todo)
            if len(pending.done) == len(mine):
                del state.pending[id(opt)]

    def _step_only(
        self, state: NonBlockingState, opt: torch.optim.Optimizer, pending: _Pending, params: list[torch.nn.Parameter]
    ) -> None:
        """Run ``opt``'s real step on ``params`` alone, with the hyperparameters of its step() call."""
        chosen = {id(p) for p in params}
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        saved: list[dict[str, Any]] = []
        for group, hyper in zip(opt.param_groups, pending.hyper):
            saved.append({k: group[k] for k in hyper})
            group.update(hyper)
            for p in group["params"]:
                if id(p) not in chosen and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            state.originals[id(opt)][0]()
        finally:
            for p, grad in hidden:
                p.grad = grad
            for group, values in zip(opt.param_groups, saved):
                group.update(values)
        pending.done.update(chosen)
        if pending.zero is not None:
            for p in params:
                if p.grad is not None:
                    if pending.zero:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def flush(self, replica: Replica, state: NonBlockingState) -> None:
        """Complete every reduction and apply every pending update now."""
        replica.complete()
        for opt in replica.optimizers:
            pending = state.pending.get(id(opt))
            if pending is None:
                continue
            todo = [p for g in opt.param_groups for p in g["params"] if id(p) not in pending.done]
            if todo:
                self._step_only(state, opt, pending, todo)
            if pending.zero is not None:
                state.originals[id(opt)][1](set_to_none=pending.zero)
            del state.pending[id(opt)]


def _graph_leaves(output: Any) -> list[torch.Tensor]:
    """The parameters (autograd leaves) that ``output`` was computed from."""
    tensors = torch.utils._pytree.tree_flatten(output)[0]
    roots = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    leaves: list[torch.Tensor] = []
    stack: list[Any] = list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.append(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves
