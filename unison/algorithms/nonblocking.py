"""Non-blocking parameter updates (HeAT's ``blocking_parameter_updates=False``).

Gradients are averaged by asynchronous allreduces launched during backward, as
with "allreduce", but the end of backward does not wait for them and
``optimizer.step()`` does not update anything yet. Each layer's update is
applied just before that layer's next forward, once its bucket has arrived, so
the communication of the last buckets also overlaps the start of the next
forward. ``optimizer.zero_grad()`` is deferred the same way.

The update uses the hyperparameters the optimizer had when ``step()`` was
called (an LR scheduler stepping in between changes the next step, not this
one), so the trajectory equals blocking "allreduce". Pending updates are
applied by ``model.eval()``, ``model.state_dict()``, ``switch_to()`` and
``model.flush()``. Gradients must not be read or changed between backward and
``step()`` (clip them with "allreduce" instead): they may still be in flight.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.utils._pytree
from torch import nn

from .allreduce import AllReduce


class _Pending:
    """One optimizer's deferred step: its hyperparameters then, what is done, and a deferred zero_grad."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.done: set[int] = set()
        self.zero: Optional[bool] = None  # set_to_none of a deferred zero_grad


class NonBlocking(AllReduce):
    name = "nonblocking"
    defaults = {"hierarchical": False}
    defers_completion = True

    def setup(self, model) -> None:
        super().setup(model)
        if not model.optimizers:
            raise ValueError(
                "nonblocking applies each layer's update just before that layer's next forward, so it needs the "
                "optimizer(s): DataParallel(module, optimizer=opt, algorithm='nonblocking')"
            )
        self.model = model
        self._pending: dict[int, _Pending] = {}
        self._originals = {}
        for opt in model.optimizers:
            self._originals[id(opt)] = (opt.step, opt.zero_grad)
            opt.step = self._deferred_step(opt)
            opt.zero_grad = self._deferred_zero_grad(opt)
        self._hooks = [
            m.register_forward_pre_hook(self._layer_hook(m))
            for m in model.module.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._bucket_of: Optional[dict[int, int]] = None

    def teardown(self, model) -> None:
        for opt in model.optimizers:
            step, zero_grad = self._originals.pop(id(opt))
            opt.step, opt.zero_grad = step, zero_grad
        for h in self._hooks:
            h.remove()
        super().teardown(model)

    # ---- what the user's calls now do ---------------------------------
    def _deferred_step(self, opt):
        """A bound ``step`` (LR schedulers wrap it) that records the step instead of taking it."""

        def step(opt, closure=None):
            if closure is not None:
                raise ValueError("nonblocking cannot defer an optimizer step with a closure")
            if id(opt) in self._pending:  # a second step() before any forward
                self.flush(self.model)
            self._pending[id(opt)] = _Pending(opt)
            if opt is self.model.optimizers[0]:
                self.model._optimizer_steps += 1  # the real step runs layer by layer later

        return types.MethodType(step, opt)

    def _deferred_zero_grad(self, opt):
        def zero_grad(opt, set_to_none: bool = True):
            pending = self._pending.get(id(opt))
            if pending is None:
                self._originals[id(opt)][1](set_to_none=set_to_none)
            else:
                pending.zero = set_to_none

        return types.MethodType(zero_grad, opt)

    # ---- applying updates -------------------------------------------------
    def before_forward(self, model) -> None:
        if not torch.is_grad_enabled():
            self.flush(model)  # no graph to check afterwards: update everything first
            return
        reducer = model._reducer
        if reducer is not None:
            reducer.complete(buckets=[])  # flags and buffers: needed by every layer

    def after_forward(self, model, output) -> None:
        """Finish updates whose layers did not run; refuse if such a parameter was used anyway."""
        leftovers = {
            id(p): p
            for opt in model.optimizers
            if id(opt) in self._pending
            for g in opt.param_groups
            for p in g["params"]
            if id(p) not in self._pending[id(opt)].done and p.requires_grad
        }
        if not leftovers:
            return
        stale = [p for p in _graph_leaves(output) if id(p) in leftovers]
        if stale:
            names = {id(p): n for n, p in model.module.named_parameters()}
            raise RuntimeError(
                f"nonblocking: parameter {names.get(id(stale[0]), '?')!r} was used in forward outside its own "
                "module's forward, before its deferred update was applied; use algorithm 'allreduce' for this model"
            )
        self.flush(model)

    def _layer_hook(self, module: nn.Module):
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]

        def hook(_module, _inputs):
            if self._pending or self.model._reducer._unfinished:
                self._apply(params)

        return hook

    def _apply(self, params) -> None:
        reducer = self.model._reducer
        if self._bucket_of is None or len(self._bucket_of) != len(reducer.params):
            self._bucket_of = {id(p): reducer._bucket_of[i] for i, p in enumerate(reducer.params)}
        reducer.complete(sorted({self._bucket_of[id(p)] for p in params if id(p) in self._bucket_of}))
        for opt in self.model.optimizers:
            pending = self._pending.get(id(opt))
            if pending is None:
                continue
            mine = {id(p) for g in opt.param_groups for p in g["params"]}
            todo = [p for p in params if id(p) in mine and id(p) not in pending.done]
            if todo:
                self._step_only(opt, pending, todo)
            if len(pending.done) == len(mine):
                del self._pending[id(opt)]

    def _step_only(self, opt, pending: _Pending, params) -> None:
        """Run ``opt``'s real step on ``params`` alone, with the hyperparameters of its step() call."""
        chosen = {id(p) for p in params}
        hidden, saved = [], []
        for group, hyper in zip(opt.param_groups, pending.hyper):
            saved.append({k: group[k] for k in hyper})
            group.update(hyper)
            for p in group["params"]:
                if id(p) not in chosen and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self._originals[id(opt)][0]()
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
        # Parameters of this optimizer outside any layer's forward are finished by flush().

    def flush(self, model) -> None:
        """Complete every reduction and apply every pending update now."""
        reducer = model._reducer
        if reducer is not None:
            reducer.complete()
        for opt in model.optimizers:
            pending = self._pending.get(id(opt))
            if pending is None:
                continue
            todo = [p for g in opt.param_groups for p in g["params"] if id(p) not in pending.done]
            if todo:
                self._step_only(opt, pending, todo)
            if pending.zero is not None:
                self._originals[id(opt)][1](set_to_none=pending.zero)
            del self._pending[id(opt)]


def _graph_leaves(output) -> list[torch.Tensor]:
    """The parameters (autograd leaves) that ``output`` was computed from."""
    roots = [t.grad_fn for t in torch.utils._pytree.tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, leaves, stack = set(), [], roots
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.append(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves
