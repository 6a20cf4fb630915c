"""The gradient engine: drives the buckets through one synchronized backward.

Each parameter's post-accumulate-grad hook moves its gradient into its bucket
(scaled for averaging, fused with the copy). When a bucket is complete and
every bucket before it has been launched, the algorithm's reduction starts, so
communication overlaps the rest of backward and every rank issues the same
sequence of collectives. At the end of backward (an autograd callback queued on
the outermost backward), the buckets that never completed are launched in
order, a one-byte-per-parameter "has a gradient" vector is agreed on with a MAX
allreduce, and everything is waited for: a parameter used on any rank gets the
average, one used on none keeps ``grad=None``. Only a rank that left a parameter
without a gradient reads that vector on the host (a sync on a GPU); the vector is
sent every pass all the same, so such a rank never waits alone.

After the first synchronized backward the buckets are re-planned once from the
order in which gradients really arrived (rank 0's order, broadcast).

Parameters with sparse gradients (``nn.Embedding(..., sparse=True)``, named at
construction: ``sparse``) stay out of the buckets: at the end of backward each is
summed, in parameter order on every rank, with a sparse allreduce (a rank
without one sends an empty tensor), as torch DDP does (``unison.engine.sparse``).

A gradient that carries a graph (``backward(create_graph=True)``) is averaged as
torch DDP averages it: its value becomes the average, its own graph stays (the
average's derivative is the local gradient's, scaled; nothing backpropagates
through the collective).

The reducer knows no algorithm: it asks its ``dispatcher`` (``unison.events.Dispatcher``)
whether a pass synchronizes, by what to scale, how to reduce a bucket, and tells
it when the backward's reductions are complete.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from ..runtime import health, torch_private
from . import buckets as bucketing
from . import comm, nonfinite
from . import sparse as sparse_grads
from .comm import src_rank, start
from .offload import keep
from .weak import weak


class Questions(Protocol):
    """What the engine asks of the algorithm (``unison.events.Dispatcher`` answers)."""

    def sync_gradients(self) -> bool: ...

    def grad_scale(self, world_size: int) -> float: ...

    def lets_buckets_go(self) -> bool: ...

    def reduce_bucket(
        self, bucket: bucketing.Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[comm.Waitable]: ...

    def bucket_wire_bytes(self, bucket: bucketing.Bucket, world_size: int) -> int: ...

    def after_backward(self) -> None: ...


class GradBucket:
    """What torch's DDP comm hooks see of a bucket (duck-typed ``dist.GradBucket``)."""

    def __init__(self, bucket: bucketing.Bucket, last: bool):
        self._bucket, self._last = bucket, last
        self._buffer = bucket.flat

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """As torch's: ``buffer()`` is ``tensor`` from now on (``fp16_compress_wrapper`` hands the
        hook it wraps a half-precision buffer); the gradients take the Future's result."""
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: a view into ``buffer()``, as torch's."""
        flat = self._bucket.flat
        if self._buffer is flat:
            return list(self._bucket.views)
        offsets = [v.storage_offset() - flat.storage_offset() for v in self._bucket.views]
        return [self._buffer[o : o + v.numel()].view(v.shape) for o, v in zip(offsets, self._bucket.views)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._last


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a pass's gradients go.

    Attributes:
        bucket_cap_bytes: the size of a bucket (the first is at most 1 MiB).
        sparse: positions (in the reducer's ``params``) of the parameters whose gradients are
            sparse; they are kept out of the buckets and summed with a sparse allreduce. A sparse
            gradient anywhere else raises, naming the parameter.
        static_graph: the same parameters get gradients in every backward: which ones is agreed
            on in the first synchronized pass only, and the has-a-gradient allreduce is skipped
            after it (torch DDP's ``static_graph``).
        gradient_as_bucket_view: parameters' ``.grad`` are views of the buckets (no copy). With
            False each ``.grad`` stays a tensor of its own, into which the average is copied once
            its bucket is reduced (torch DDP's default; one more copy of the gradients in memory).
    """

    bucket_cap_bytes: int
    sparse: Sequence[int] = ()
    static_graph: bool = False
    gradient_as_bucket_view: bool = True


@dataclasses.dataclass(frozen=True)
class Sync:
    """When a pass synchronizes, and what it waits for.

    Attributes:
        negotiate: agree each pass on which parameters have a gradient somewhere.
        delay: reduce after backward instead of overlapping with it.
        nonfinite: None, "raise" or "skip" (``DataParallel(nonfinite=...)``).
        decide_sync: asked once per pass instead of the forward's no_sync state
            (DistributedOptimizer counts passes with it).
        defers_completion: leave reductions in flight at the end of backward (the algorithm
            completes them later through ``complete``).
    """

    negotiate: bool = True
    delay: bool = False
    nonfinite: Optional[str] = None
    decide_sync: Optional[Callable[[], bool]] = None
    defers_completion: bool = False


@dataclasses.dataclass(frozen=True)
class Callbacks:
    """What the owner adds to a pass.

    Attributes:
        reduce_function: ``fn(tensors, group)`` replacing the algorithm's reduction.
        on_begin, on_end: called when a synchronized pass begins and when its flags are settled
            (buffer broadcasts).
    """

    reduce_function: Optional[Callable] = None
    on_begin: Sequence[Callable[[], None]] = ()
    on_end: Sequence[Callable[[], None]] = ()


@dataclasses.dataclass(frozen=True)
class Redo:
    """What fault tolerance needs to redo an interrupted round.

    Attributes:
        recover: ``fn(exc, reducer)`` called when the end of backward raises; True if it
            recovered. With it, each pass keeps a copy of this rank's gradients in ``local``
            (parameter index -> gradient, before scaling) to redo the round from.
        local_on_host: keep ``local`` in host memory (pinned under CUDA), not on the parameters'
            device (``DataParallel(ft_offload=True)``).
    """

    recover: Optional[Callable[[BaseException, "GradReducer"], bool]] = None
    local_on_host: bool = False


class GradReducer:
    """Buckets, hooks and the per-backward state machine of gradient averaging.

    Args:
        params, names: the parameters that require grad, and their names.
        group: the process group gradients are averaged over.
        dispatcher: answers ``sync_gradients()``, ``grad_scale(world)``, ``lets_buckets_go()``,
            ``reduce_bucket(bucket, group)``, ``bucket_wire_bytes(bucket, world)``
            and hears ``after_backward()`` (``unison.events.Dispatcher``).
        tag: a name unique to the owner, the same on every rank (private groups).
        layout: where the gradients go (``Layout``: buckets, sparse ones, views).
        sync: when a pass synchronizes (``Sync``).
        callbacks: what the owner adds to a pass (``Callbacks``).
        redo: what fault tolerance needs (``Redo``).

    Example::

        reducer = GradReducer(params, names, group, dispatcher, "model-0", Layout(25 << 20), Sync(delay=True))
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: Optional[dist.ProcessGroup],
        dispatcher: "Questions",
        tag: str,
        layout: Layout,
        sync: Sync = Sync(),
        callbacks: Callbacks = Callbacks(),
        redo: Redo = Redo(),
    ):
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.dispatcher = dispatcher
        self.cap = layout.bucket_cap_bytes
        self.first_cap = min(layout.bucket_cap_bytes, bucketing.MB)
        self.negotiate = sync.negotiate
        self.delay = sync.delay
        self.reduce_function = callbacks.reduce_function
        self.nonfinite = sync.nonfinite
        self.decide_sync = sync.decide_sync
        self.on_begin = list(callbacks.on_begin)
        self.on_end = list(callbacks.on_end)
        self.defers_completion = sync.defers_completion
        self.recover = redo.recover
        self.local_on_host = redo.local_on_host
        self.local: dict[int, torch.Tensor] = {}
        self._scale = 1.0
        self.static_graph = layout.static_graph
        self.as_view = layout.gradient_as_bucket_view
        self.sparse = sorted(set(layout.sparse))
        self._is_sparse = [False] * len(self.params)
        for i in self.sparse:
            self._is_sparse[i] = True
        self._sparse_dims = {i: 1 for i in self.sparse}  # an empty contribution's sparse_dim (Embedding's: 1)
        self._sparse_work: list[tuple[int, torch.Tensor, Any]] = []  # this pass's sparse allreduces
        self._sparse_out: dict[int, torch.Tensor] = {}  # their sums, once landed
        self._graphs: dict[int, torch.Tensor] = {}  # create_graph: parameter -> its scaled local gradient
        self._used: Optional[list[bool]] = None  # this pass: which parameters end with a gradient
        self._static_used: Optional[list[bool]] = None  # static_graph: the first pass's agreement
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # Hooks users add (DataParallel.register_comm_hook).
        self.comm_hook: Optional[tuple[Any, Callable]] = None
        self.before_sync: "OrderedDict[int, Callable[[], None]]" = OrderedDict()
        self.skipped_steps = 0
        # Whether the last backward pass checked for non-finite gradients across the group.
        self.nonfinite_checked = False
        # Divide gradients by this many ranks instead of the group's size (join with
        # divide_by_initial_world_size=False); see set_divisor.
        self.scale_world: Optional[int] = None
        # Counters: synchronized backward passes, bytes sent.
        self.passes = 0
        self.bytes_total = 0
        self.bytes_last = 0

        self.buckets: list[bucketing.Bucket] = []  # made at the first synchronized backward
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        self._set_buckets(bucketing.plan(self.params, self._dense_order([]), self.cap, self.first_cap))
        self._replan_pending = True
        self._flag_group = comm.private_group(group, f"{tag}/flags")
        self._rank = dist.get_rank(group) if group is not None else 0
        self._bad: Optional[int] = None  # this pass: the first non-finite sparse gradient
        self._screened: list[torch.Tensor] = []  # this pass: each screened bucket's first bad index, on the device
        self._unfinished = False
        self._has: Optional[list[bool]] = None
        self._flags: Optional[tuple[torch.Tensor, Any]] = None  # the has-a-gradient flags and their work
        self._waiting: dict[int, tuple[bucketing.Bucket, Any]] = {}
        self._sync = self._local_sync = True
        self._in_pass = False
        self._active = False
        self._handles_hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    # ---- what owners set ---------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """torch DDP's form: ``hook(state, bucket)`` returns a Future and replaces the reduction."""
        if self.comm_hook is not None:
            raise RuntimeError("a comm hook (state, hook) is already registered; it can be registered only once")
        self.comm_hook = (state, hook)

    def add_before_sync(self, fn: Callable[[], None]) -> RemovableHandle:
        """Call ``fn()`` after backward, before gradients are synchronized (pfn's hook form)."""
        handle = RemovableHandle(self.before_sync)
        self.before_sync[handle.id] = fn
        return handle

    def set_divisor(self, ranks: Optional[int]) -> None:
        """Average over ``ranks`` ranks instead of the group's size (None: the group's size)."""
        self.scale_world = ranks

    @property
    def unfinished(self) -> bool:
        """Whether reductions of the last backward are still in flight."""
        return self._unfinished

    @property
    def scale(self) -> float:
        """What the buckets of the pass in flight hold the local gradients multiplied by (1/world
        for an average)."""
        return self._scale

    def saved(self, bucket: bucketing.Bucket) -> Optional[list[torch.Tensor]]:
        """The copies of ``bucket``'s local gradients (unscaled) that the pass in flight keeps to
        redo its round from (``recover``); None unless every parameter of it has one."""
        found = [self.local.get(i) for i in bucket.indices]
        return None if not found or any(t is None for t in found) else found  # type: ignore[return-value]

    def bucket_of(self, param: torch.Tensor) -> Optional[int]:
        """The index of the bucket holding ``param``'s gradient."""
        i = self._index.get(id(param))
        return None if i is None else self._bucket_of[i]

    # ---- set-up ---------------------------------------------------------
    def _dense_order(self, first: list[int]) -> list[int]:
        """``first``, then the other dense parameters in reverse order (the order gradients usually arrive)."""
        seen = set(first)
        return first + [i for i in reversed(range(len(self.params))) if i not in seen and not self._is_sparse[i]]

    def _set_buckets(self, groups: list[list[int]]) -> None:
        """Plan the buckets as ``groups`` (parameter positions); their buffers are made at
        the next synchronized backward (``_materialize``), after the old ones are let go."""
        self._release()
        self._groups = [list(g) for g in groups]
        n = len(self.params)
        self._bucket_of: list[Optional[int]] = [None] * n
        for b, indices in enumerate(self._groups):
            for i in indices:
                self._bucket_of[i] = b
        self._sizes = [len(g) for g in self._groups]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def _materialize(self) -> None:
        """Make the planned buckets' buffers (gradients already there are copied in)."""
        self.buckets = bucketing.build(self.params, self.names, self._groups, adopt=self.as_view)
        for b in self.buckets:
            for i, view in zip(b.indices, b.views):
                self._views[i] = view

    def _release(self) -> None:
        """Let the buckets' buffers go (the plan stays). Gradients that are views of a
        buffer get tensors of their own, one bucket at a time, each buffer freed before
        the next is copied: never more than one bucket beyond the gradients."""
        while self.buckets:
            bucket = self.buckets.pop()
            storage = bucket.flat.untyped_storage().data_ptr()
            for i, p in zip(bucket.indices, bucket.params):
                grad = p.grad
                if grad is not None and grad.layout == torch.strided and grad.untyped_storage().data_ptr() == storage:
                    p.grad = grad.detach().clone()
                self._views[i] = None  # type: ignore[call-overload]

    @property
    def groups(self) -> list[list[int]]:
        """The bucket plan: each bucket's parameter positions, in launch order."""
        return [list(g) for g in self._groups]

    def plan(self, cap_bytes: int) -> list[list[int]]:
        """The buckets (parameter positions) at ``cap_bytes`` each, in the current order."""
        order = [i for g in self._groups for i in g]
        return bucketing.plan(self.params, order, int(cap_bytes), min(int(cap_bytes), bucketing.MB))

    def set_bucket_cap(self, cap_bytes: int) -> None:
        """Re-plan the buckets at ``cap_bytes`` each, keeping the current order.

        Call it between backward passes, with the same value on every rank
        (autotuning picks it from measurements agreed on by all ranks).
        """
        self.complete()
        groups = self.plan(cap_bytes)
        self.cap = int(cap_bytes)
        self.first_cap = min(self.cap, bucketing.MB)
        if groups != self._groups:
            self._set_buckets(groups)

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad(i)

        return hook

    def remove(self) -> None:
        """Detach the hooks (the buckets stay where the grads point)."""
        for h in self._handles_hooks:
            h.remove()
        self._handles_hooks = []

    # ---- forward side -----------------------------------------------------
    def prepare(self, sync: bool) -> None:
        """Called at a forward with grad enabled: will the next backward synchronize?"""
        self._sync = sync
        self._in_pass = self._active = False  # a backward that failed half-way must not block this one

    def watch(self, output: Any) -> None:
        """Hook the forward's outputs so the end-of-backward callback is queued on
        the outermost backward (reentrant checkpointing runs inner ones)."""
        for t in torch_private.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(weak(self._on_output_grad))  # the graph the user keeps holds no engine

    def _on_output_grad(self, _grad: torch.Tensor) -> None:
        self._start_pass()

    def _start_pass(self) -> None:
        """First event of a backward pass: begin a synchronized one, or mark a local one."""
        if self._in_pass:
            return
        self._in_pass = True
        if self._decide():
            self._begin()
        else:
            self._local_sync = self._sync
            torch_private.at_backward_end(self._end_pass)

    def _decide(self) -> bool:
        """Whether this pass synchronizes (asked once per pass). When the algorithm has stopped
        synchronizing gradients for good (``lets_buckets_go``: a model-averaging algorithm past
        its warm-up), the buckets' buffers are let go; a later synchronized pass makes them again."""
        sync = self._sync if self.decide_sync is None else self.decide_sync()
        synced = bool(sync and self.dispatcher.sync_gradients())
        if not synced:
            self.nonfinite_checked = False
            if sync and self.buckets and not self._unfinished and self.dispatcher.lets_buckets_go():
                self._release()
        return synced

    def shadow_pass(self, sync: bool) -> None:
        """Issue one backward pass's collectives with nothing to contribute (a rank
        that ran out of inputs, see ``unison.join``): zeros go out, averages come back."""
        self._sync = sync
        if not self._decide():
            return
        self._begin(queue=False)
        self._finalize()

    def _end_pass(self) -> None:
        """End of a local pass: the user's before-sync hooks still run outside no_sync."""
        self._in_pass = False
        if self._local_sync:
            for fn in list(self.before_sync.values()):
                fn()

    # ---- backward ------------------------------------------------------
    def _begin(self, queue: bool = True) -> None:
        self.complete()  # a deferred completion must finish before buckets are rewritten
        if not self.buckets and self._groups:
            self._materialize()
        self._active = True
        self._delayed = self.delay or bool(self.before_sync) or self.reduce_function is not None
        custom = self.comm_hook is not None or self.reduce_function is not None
        self._scale = 1.0 if custom else self.dispatcher.grad_scale(self.scale_world or self.world)
        self._bad = None
        self._screened = []
        self._fired = [False] * len(self.params)
        self._pending = list(self._sizes)
        self._next = 0
        self._handles: list[tuple[bucketing.Bucket, Any]] = []
        self._arrival: Optional[list[int]] = [] if self._replan_pending else None
        self._sparse_scale = 1.0 / (self.scale_world or self.world) if custom else self._scale
        self._bytes = 0
        self.local = {}
        self._graphs = {}
        self._sparse_work = []
        self._used = None
        for fn in self.on_begin:
            fn()
        if queue:
            torch_private.at_backward_end(self._finalize)

    def _on_grad(self, i: int) -> None:
        if not self._in_pass:
            self._start_pass()
        if not self._active:
            return
        if self._fired[i]:
            if self._delayed:
                return
            raise RuntimeError(
                f"parameter {self.names[i]!r} received a gradient twice in one backward pass "
                "(it is used both inside and outside a reentrant checkpoint, or backward re-entered). "
                "Use torch.utils.checkpoint(..., use_reentrant=False), or DataParallel(..., delay_reduce=True)."
            )
        self._fired[i] = True
        if self._is_sparse[i]:
            self._check_sparse(i)  # reduced at the end of backward
            return
        if self._arrival is not None:
            self._arrival.append(i)
        if self._delayed:
            return
        self._adopt(i)
        b = self._bucket_of[i]
        assert b is not None  # a dense parameter
        self._pending[b] -= 1
        if self._pending[b] == 0 and b == self._next:
            while self._next < len(self.buckets) and self._pending[self._next] == 0:
                self._launch(self._next)
                self._next += 1

    def _adopt(self, i: int) -> bool:
        """Put parameter i's gradient into its bucket view, scaled; False if it has none."""
        p, view = self.params[i], self._views[i]
        grad = p.grad
        if grad is None:
            view.zero_()
            return False
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self.names[i]!r} got a {grad.layout} gradient, but it was planned dense: only the "
                "weights of nn.Embedding/nn.EmbeddingBag built with sparse=True (and DistributedOptimizer's "
                "sparse_params) are known at construction to get sparse gradients, as in torch DDP; build the "
                "module with sparse=False, or name the parameter in DistributedOptimizer(..., sparse_params=[...])"
            )
        if self.recover is not None:
            self.local[i] = keep(grad, self.local_on_host)
        if grad.requires_grad:  # backward(create_graph=True): the bucket takes the value, the graph is kept
            if not self._fired[i]:  # from an earlier pass, already averaged: its graph stays as it is
                torch.mul(grad.detach(), self._scale, out=view)
                return True
            with torch.enable_grad():
                scaled = grad * self._scale if self._scale != 1.0 else grad
            self._graphs[i] = scaled
            view.copy_(scaled.detach())
        elif grad.data_ptr() != view.data_ptr():
            if self._scale != 1.0:
                torch.mul(grad, self._scale, out=view)
            else:
                view.copy_(grad)
            if self.as_view:
                p.grad = view
        elif self._scale != 1.0:
            view.mul_(self._scale)
        return True

    def _check_sparse(self, i: int) -> None:
        """A parameter planned sparse must get a sparse gradient (or none)."""
        grad = self.params[i].grad
        if grad is not None and not grad.is_sparse:
            raise RuntimeError(
                f"parameter {self.names[i]!r} was planned sparse (its module was built with sparse=True) but got a "
                f"{grad.layout} gradient; do not change the module's sparse attribute after wrapping it"
            )

    def _launch_sparse(self, i: int) -> bool:
        """Start the sparse allreduce of parameter i's gradient (an empty one if it has none),
        scaled; return whether it had one."""
        self._check_sparse(i)
        p, grad = self.params[i], self.params[i].grad
        if grad is None:
            mine = sparse_grads.empty(p, self._sparse_dims[i])
        else:
            self._sparse_dims[i] = grad.sparse_dim()
            if self.recover is not None:
                self.local[i] = keep(grad, self.local_on_host)
            mine = (
                grad.detach() * self._sparse_scale
            ).coalesce()  # a new tensor (the allreduce writes into it), no repeated rows
            if self.nonfinite is not None and not sparse_grads.finite(mine):
                self._bad = i if self._bad is None else min(i, self._bad)
                mine = sparse_grads.empty(p, self._sparse_dims[i])
        work = None if self.group is None else start(dist.all_reduce, mine, group=self.group)
        self._bytes += sparse_grads.nbytes(mine) * max(self.world - 1, 0)  # each rank's entries go to every other
        self._sparse_work.append((i, mine, work))
        return grad is not None

    def _screen(self, bucket: bucketing.Bucket) -> None:
        """With ``nonfinite`` set: note this rank's first non-finite gradient and zero
        its bucket, so a NaN never leaves the rank (nor enters error-feedback state).
        Both stay on the device (no host sync); the end of backward agrees on them."""
        if self.nonfinite is None:
            return
        first = nonfinite.first_bad(bucket.views, bucket.indices, len(self.params))
        self._screened.append(first)
        bucket.flat.masked_fill_(first < len(self.params), 0)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self._screen(bucket)
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            handle = hook(state, GradBucket(bucket, b == len(self.buckets) - 1))
        elif self.group is None:
            handle = None  # one replica: its gradient is the average
        else:
            handle = self.dispatcher.reduce_bucket(bucket, self.group)
        self._bytes += self.dispatcher.bucket_wire_bytes(bucket, self.world)
        self._handles.append((bucket, handle))

    @health.translated("the gradient reduction of backward")
    def _finalize(self) -> None:
        try:
            self._finish_backward()
        except Exception as exc:
            if self.recover is None or not self.recover(exc, self):
                raise
        finally:
            self._in_pass = self._active = False

    def _finish_backward(self) -> None:
        self._launch_rest()
        if not (self.defers_completion and self._arrival is None):
            self.complete()

    def _launch_rest(self) -> None:
        """End of backward: launch what has not started, and the has-a-gradient flags."""
        for fn in list(self.before_sync.values()):
            fn()
        has = [True] * len(self.params)
        first_unlaunched = 0 if self._delayed else self._next
        for b in self.buckets[first_unlaunched:]:
            for i in b.indices:
                if self._delayed or not self._fired[i]:
                    has[i] = self._adopt(i)
        for k in range(first_unlaunched, len(self.buckets)):
            if self.reduce_function is not None:
                self._screen(self.buckets[k])
                self.reduce_function(self.buckets[k].views, self.group)
                self._handles.append((self.buckets[k], None))
            else:
                self._launch(k)
        for i in self.sparse:
            has[i] = self._launch_sparse(i)
        self._has = has
        self._flags = None
        negotiating = self.negotiate and self._static_used is None
        if self.group is None:
            self._flags = (self._flag_tensor(has), None)
        elif negotiating or self.nonfinite is not None:
            flags = self._flag_tensor(has)
            work = start(dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=self._flag_group)
            self._flags = (flags, work)
            self._bytes += flags.numel() * flags.element_size()
        self._waiting = {bucket.index: (bucket, handle) for bucket, handle in self._handles}
        self._handles = []
        self._unfinished = True
        self.passes += 1
        self.bytes_last = self._bytes
        self.bytes_total += self._bytes

    def complete(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Wait for the reductions of ``buckets`` (default: all) of the last backward.

        The flags and buffers are settled on the first call; the backward's
        end event fires once every bucket is complete. Normally called at the
        end of backward; algorithms that defer it (``defers_completion``) call
        it per layer before the next forward.
        """
        if not self._unfinished:
            return
        if self._has is not None:  # first call for this backward
            self._finish_sparse()
            bad = self._settle_flags()
            for fn in self.on_end:
                fn()
            if bad is not None:
                self._on_nonfinite(*bad)
        for b in list(self._waiting) if buckets is None else buckets:
            entry = self._waiting.pop(b, None)
            if entry is None:
                continue
            bucket, handle = entry
            result = comm.wait(handle) if handle is not None else None
            if isinstance(result, (list, tuple)) and result:
                result = result[0]
            if isinstance(result, torch.Tensor) and result.data_ptr() != bucket.flat.data_ptr():
                bucket.flat.copy_(result)
            self._deliver(bucket)
        if self._waiting:
            return
        self._unfinished = False
        self._used = None
        if self._arrival is not None:
            self._replan(self._arrival)
        self.dispatcher.after_backward()

    def _flag_tensor(self, has: list[bool]) -> torch.Tensor:
        """What the MAX allreduce at the end of backward agrees on: which parameters
        have a gradient somewhere and, with ``nonfinite``, the first bad (rank, parameter).
        Made without a host sync (``comm.from_host``; the code is computed on the device)."""
        if self.nonfinite is None:
            return comm.from_host(has, torch.uint8, self.device)
        n = len(self.params)
        flags = comm.from_host((has if self.negotiate else [True] * n) + [0], torch.int64, self.device)
        first = torch.full((), n if self._bad is None else self._bad, dtype=torch.int64, device=self.device)
        for screened in self._screened:
            first = torch.minimum(first, screened.to(first.device))
        flags[n:].copy_(nonfinite.code_of(first, self._rank, self.world, n).reshape(1))
        self._screened = []
        return flags

    def _settle_flags(self) -> Optional[tuple[int, str]]:
        """Give the average to parameters that had no local gradient but one elsewhere;
        return the first (rank, parameter) with a non-finite gradient, if any.

        The agreed flags are read on the host (a sync on a GPU) only when this rank needs
        them: a parameter without a local gradient, the first pass of ``static_graph``, or
        the non-finite code (the step's skip or raise is decided on the host). A rank whose
        parameters all got a gradient reads nothing: each of them is used somewhere.
        """
        n, bad, has = len(self.params), None, self._has or [False] * len(self.params)
        used_anywhere: Optional[list[bool]] = None
        if self._flags is not None:
            flags, work = self._flags
            if work is not None:
                comm.wait(work)
            first = self.static_graph and self._static_used is None
            if self.negotiate and (first or not all(has)):
                agreed = flags.tolist()
                used_anywhere = [bool(v) for v in agreed[:n]]
                code = agreed[n] if self.nonfinite is not None else 0
            else:
                code = int(flags[n].item()) if self.nonfinite is not None else 0
            if code:
                rank, index = nonfinite.decode(code, self.world, n)
                bad = (rank, self.names[index])
        if self.negotiate and self.static_graph:
            used_anywhere = self._static(used_anywhere)
        elif used_anywhere is None:  # not negotiated, or not needed: every parameter takes part
            used_anywhere = [True] * n
        self._used = [local or anywhere for local, anywhere in zip(has, used_anywhere)]
        for i, local in enumerate(has):
            if self._is_sparse[i]:
                if self._used[i]:
                    self.params[i].grad = self._sparse_out.pop(i)
            elif not local and used_anywhere[i] and self.as_view:
                self.params[i].grad = self._views[i]
        self._sparse_out = {}
        self._flags = self._has = None
        self.nonfinite_checked = self.nonfinite is not None
        return bad

    def _static(self, agreed: Optional[list[bool]]) -> list[bool]:
        """static_graph: keep the first pass's agreement, and hold every later pass to it."""
        if self._static_used is None:
            assert agreed is not None  # the first pass negotiates
            self._static_used = list(agreed)
            return agreed
        for i, local in enumerate(self._has or []):
            if local and not self._static_used[i]:
                raise RuntimeError(
                    f"static_graph=True, but parameter {self.names[i]!r} got a gradient although no rank's first "
                    "synchronized backward gave it one: the graph changed; use static_graph=False"
                )
        return self._static_used

    def _finish_sparse(self) -> None:
        """Wait for the sparse allreduces; their sums are set as gradients by ``_settle_flags``."""
        self._sparse_out = {}
        for i, total, work in self._sparse_work:
            if work is not None:
                comm.wait(work)
            self._sparse_out[i] = total
        self._sparse_work = []

    def _deliver(self, bucket: bucketing.Bucket) -> None:
        """A bucket's average has landed: gradients with a graph take its value (their graph
        stays), and with ``gradient_as_bucket_view=False`` gradients get a copy of it."""
        used = self._used
        for i, view in zip(bucket.indices, bucket.views):
            p, graph = self.params[i], self._graphs.pop(i, None)
            if graph is not None:
                with torch.enable_grad():
                    p.grad = graph + (view - graph.detach())  # the average's value, the local gradient's graph
            elif not self.as_view and (used is None or used[i]):
                if p.grad is None or p.grad.data_ptr() == view.data_ptr():
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def screened(self, world_size: int) -> bool:
        """Whether the last backward already agreed on non-finite gradients among all
        ``world_size`` replicas (then the optimizer step needs no agreement of its own)."""
        return self.nonfinite_checked and self.group is not None and dist.get_world_size(self.group) == world_size

    def _on_nonfinite(self, rank: int, name: str) -> None:
        """Every rank learns of the same bad gradient at once: raise, or skip the step."""
        if self.nonfinite == "raise":
            self.complete()  # leave nothing in flight
            raise nonfinite.error(rank, name)
        nonfinite.drop_gradients(self.params)
        self.skipped_steps += 1

    def _replan(self, arrival: list[int]) -> None:
        """Rebuild the buckets once, in rank 0's real gradient order."""
        self._replan_pending = False
        order = self._dense_order(arrival)
        t = torch.tensor(order, dtype=torch.int64, device=self.device)
        if self.group is not None:
            comm.wait(start(dist.broadcast, t, src=src_rank(self.group), group=self.group))
        groups = bucketing.plan(self.params, t.tolist(), self.cap, self.first_cap)
        if groups != self._groups:
            self._set_buckets(groups)  # the new buffers are made at the next backward, after these are gone
