"""Non-blocking parameter updates (HeAT's ``blocking_parameter_updates=False``).

Gradients are averaged as with "allreduce", but neither the end of backward nor
``optimizer.step()`` waits: each layer's update (and ``zero_grad``) is applied
just before that layer's next forward, once its bucket has arrived, with the
hyperparameters of the ``step()`` call, so the trajectory equals "allreduce".
A parameter read outside its own module's forward (``nn.MultiheadAttention``'s
``out_proj``, a weight tied across modules, a functional use of a submodule's
weight) is updated where it is first read: the first training forward records,
for each parameter, the last layer whose forward had started when the parameter
was first used (or the wrapper's forward), and its update lands there from then
on. Under ``fault_tolerant=True`` the reduction completes at the end of backward (a
failure must be known before the step is committed); the updates still land at
the next forward. See docs/algorithms.md#nonblocking for what a user must not do meanwhile.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode

from ...replica import Replica
from ...runtime import torch_private
from ..contract import Recovery
from .allreduce import AllReduceState, BucketAllReduce


class _Pending:
    """One optimizer's deferred step: its hyperparameters then, what is done, and a deferred zero_grad."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.done: set[int] = set()
        self.zero: Optional[bool] = None  # set_to_none of a deferred zero_grad


class _FirstUses(TorchFunctionMode):
    """While active: for each of ``params``, the layer ``where()`` names when an op first reads it."""

    def __init__(self, params: list[torch.nn.Parameter], where: Callable[[], int]) -> None:
        super().__init__()
        self.unseen = {id(p) for p in params}
        self.where = where
        self.first: dict[int, int] = {}  # id(parameter) -> layer index (START: the wrapper's forward)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.unseen:
            for t in torch_private.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t) in self.unseen:
                    self.unseen.discard(id(t))
                    self.first[id(t)] = self.where()
        return func(*args, **kwargs)


#: The layer index that stands for the wrapper's forward, before any layer's.
START = -1


class NonBlockingState(AllReduceState):
    """The deferred steps, each optimizer's real step and zero_grad, and where each layer's
    parameters are updated (learned in the first training forward)."""

    __slots__ = ("pending", "originals", "layers", "at_start", "learned", "last", "learner", "applied")

    def __init__(self, base: AllReduceState) -> None:
        super().__init__(base.tuner, base.levels)
        self.pending: dict[int, _Pending] = {}
        self.originals: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        # The parameters updated at each layer's forward: its own, then those the first training
        # forward read there first; at_start: those it read before any layer's forward.
        self.layers: list[list[torch.nn.Parameter]] = []
        self.at_start: list[torch.nn.Parameter] = []
        self.learned = False
        self.last = START  # the layer whose forward started last (while learning)
        self.learner: Optional[_FirstUses] = None
        # This forward: id(parameter) -> autograd's next sequence number when its update landed.
        self.applied: dict[int, int] = {}


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
                state.layers.append(params)
                replica.on_forward(m, partial(self._layer_hook, replica, state, len(state.layers) - 1))
        if replica.modules:  # the first training forward is watched from its start to its end
            replica.on_forward(replica.modules[0], partial(self._start_learning, replica, state))
            replica.on_forward_end(replica.modules[0], partial(self._end_learning, state))
        return state

    # ---- where each parameter is first read ---------------------------
    def _start_learning(self, replica: Replica, state: NonBlockingState) -> None:
        if state.learned or state.learner is not None or not torch.is_grad_enabled():
            return
        if torch.compiler.is_compiling():
            return  # traced: the layers' own parameters only (a stray one is refused after forward)
        state.learner = _FirstUses([p for _, p in replica.trainable], lambda: state.last)
        state.learner.__enter__()

    def _end_learning(self, state: NonBlockingState) -> None:
        learner, state.learner = state.learner, None
        if learner is None:
            return
        learner.__exit__(None, None, None)
        state.learned = True
        params = {id(p): p for layer in state.layers for p in layer}
        for pid, where in learner.first.items():
            param = params.get(pid)
            if param is None:
                continue
            if where == START:
                state.at_start.append(param)
            elif not any(p is param for p in state.layers[where]):
                state.layers[where].append(param)

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
        if not torch.is_grad_enabled() or not state.learned:
            self.flush(replica, state)  # no graph to check afterwards, or nothing learned: update everything
            state.last = START
            if not torch.is_grad_enabled():
                return
        replica.complete(buckets=[])  # flags and buffers: needed by every layer
        super().before_forward(replica, state)
        state.applied = {}
        if state.at_start and (state.pending or replica.in_flight):
            self._apply(replica, state, state.at_start)

    def after_forward(self, replica: Replica, state: NonBlockingState, output: Any) -> None:
        """Finish updates whose layers did not run; refuse if a parameter was read before its update."""
        leftovers = {
            id(p)
            for opt in replica.optimizers
            if id(opt) in state.pending
            for g in opt.param_groups
            for p in g["params"]
            if id(p) not in state.pending[id(opt)].done and p.requires_grad
        }
        applied, state.applied = state.applied, {}
        if not leftovers and not applied:
            return
        reads = _first_reads(output)
        stale = [pid for pid in leftovers if pid in reads]
        stale += [pid for pid, at in applied.items() if reads.get(pid, at) < at]
        if stale:
            names = {id(p): n for n, p in replica.named_parameters}
            raise RuntimeError(
                f"nonblocking: parameter {names.get(stale[0], '?')!r} was read in this forward before its "
                "deferred update was applied: nonblocking updates each parameter at the forward of the layer "
                "where the first training forward read it, and this forward read it earlier or elsewhere (its "
                "control flow changed). Call model.flush() before such a forward, or use algorithm 'allreduce'"
            )
        self.flush(replica, state)

    def _layer_hook(self, replica: Replica, state: NonBlockingState, layer: int) -> None:
        state.last = layer
        if state.pending or replica.in_flight:
            self._apply(replica, state, state.layers[layer])

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
                if torch.is_grad_enabled():  # in a forward: later reads see the update, earlier ones did not
                    at = torch_private.sequence_nr()
                    state.applied.update((id(p), at) for p in todo)
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


def _first_reads(output: Any) -> dict[int, int]:
    """For each parameter (autograd leaf) ``output`` was computed from: id -> the sequence
    number of the first op that read it (autograd numbers the ops of a thread in order)."""
    tensors = torch_private.tree_leaves(output)
    stack: list[Any] = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    first: dict[int, int] = {}
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        at = torch_private.node_sequence_nr(fn)
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            leaf = getattr(nxt, "variable", None)
            if leaf is not None:
                first[id(leaf)] = min(first.get(id(leaf), at), at)
            elif nxt not in seen:
                stack.append(nxt)
    return first
