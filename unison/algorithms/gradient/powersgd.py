"""PowerSGD: gradients of matrix-shaped parameters sent as rank-r factors, with error feedback.

Vogels, Karimireddy and Jaggi (NeurIPS 2019): one step of power iteration per backward,
warm-started from the previous Q, with error feedback; two dependent allreduces per
bucket, on a CommThread over a private group. Under fault tolerance a round a failure cuts
after some buckets finished is done again from each bucket's residual as it was before it, so no
gradient counts twice: a finished bucket's is computed back from the residual it left, its factors
and the engine's saved gradients (``PowerSGDState.undo``); hierarchical, each shard's residual is
copied as its round starts (in host memory with ``ft_offload=True``). Each bucket's Q's are copied
(small). See docs/algorithms.md#powersgd.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any, ClassVar, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ...engine import comm, offload
from ...engine.buckets import Bucket, split
from ...engine.codecs import LowRank
from ...engine.comm import Waitable
from ...engine.flatstate import FlatState
from ...engine.hierarchy import TwoLevel, aligned_bounds
from ...replica import Replica
from .. import options
from ..contract import Algorithm, Recovery, ThreadedState, open_thread


def is_compressible(shape: torch.Size, rank: int, min_rate: float) -> bool:
    """Whether sending rank-``rank`` factors of a tensor of ``shape`` saves at least ``min_rate``."""
    n = shape[0] if len(shape) >= 2 else 0
    return n > 0 and n * (shape.numel() // n) > min_rate * (n + shape.numel() // n) * rank


def initial_q(name: str, cols: int, rank: int, salt: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A random cols x rank start, the same on every rank: seeded from the parameter's name and
    ``salt``, drawn by a generator on ``device`` (no copy from the host: without warm start this
    runs every step; the CPU's numbers are those of a CPU generator, a GPU's those of its own)."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}:{salt}".encode()))
    return torch.randn(cols, rank, generator=g, dtype=dtype, device=device)


class BucketPlan(NamedTuple):
    """Which of a bucket's parameters are compressed, and the sizes of the packed buffers."""

    compressed: list[int]  # positions in the bucket of the matrices sent as factors
    plain: list[int]  # positions of the tensors averaged uncompressed
    shapes: list[tuple[int, int]]  # (rows, cols) of each compressed matrix
    plain_numel: int
    p_numel: int
    q_numel: int


def plan_bucket(params: Sequence[torch.Tensor], rank: int, min_rate: float) -> BucketPlan:
    """Split a bucket's parameters into compressed matrices and plain tensors."""
    compressed, plain, shapes = [], [], []
    for i, p in enumerate(params):
        if is_compressible(p.shape, rank, min_rate):
            compressed.append(i)
            shapes.append((p.shape[0], p.numel() // p.shape[0]))
        else:
            plain.append(i)
    plain_numel = sum(params[i].numel() for i in plain)
    p_numel, q_numel = sum(n * rank for n, _ in shapes), sum(m * rank for _, m in shapes)
    return BucketPlan(compressed, plain, shapes, plain_numel, p_numel, q_numel)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the factors are computed and sent in (QR needs float32 or float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Unfold(NamedTuple):
    """A flat bucket's round under fault tolerance, without a copy of its residual: once the round
    has finished, ``restore`` computes the residual as it was before it from what it left,
    ``e = e' + P Q_local^T - scale g`` for each matrix (the round compressed ``M = scale g + e``
    and left ``e' = M - P Q_local^T``), to float rounding. The plain tensors' residuals are
    always zero."""

    errors: list[torch.Tensor]  # the matrices' residuals (n x m views of the bucket's)
    saved: list[torch.Tensor]  # the engine's saved gradients of the bucket (``Replica.saved_gradients``)
    scale: float  # what the bucket held them multiplied by
    plan: "BucketPlan"
    low: LowRank  # the bucket's factors: the round's P's and Q_local's stay there

    def restore(self) -> None:
        for k, i in enumerate(self.plan.compressed):
            error, p, qt = self.errors[k], self.low.ps[k], self.low.qts_local[k]
            e = error.to(p.dtype)
            e.addmm_(p, qt)
            e.sub_(self.saved[i].to(device=e.device, dtype=e.dtype).view(e.shape), alpha=self.scale)
            error.copy_(e)


class Kept:
    """A bucket the round in flight started: its residual, its Q's before the round, and (flat
    buckets) how to compute its residual back (``Unfold``) once ``finished``."""

    __slots__ = ("residual", "qs", "unfold", "finished")

    def __init__(self, residual: torch.Tensor, qs: dict[str, Optional[torch.Tensor]], unfold: Optional[Unfold]) -> None:
        self.residual, self.qs, self.unfold, self.finished = residual, qs, unfold, False


class PowerSGDState(ThreadedState):
    """Backward passes seen, residuals and Q factors (saved), bucket plans and buffers, group and thread."""

    __slots__ = (
        "passes",
        "residuals",
        "qs",
        "plans",
        "buffers",
        "levels",
        "shards",
        "keeps",
        "on_host",
        "befores",
        "kept",
    )

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        thread: Optional[comm.CommThread] = None,
        keeps: bool = False,
        on_host: bool = False,
    ) -> None:
        super().__init__(group, thread)
        self.passes = 0  # synchronized backward passes (saved as "steps")
        self.residuals = FlatState()  # error feedback, per parameter
        self.qs: dict[str, torch.Tensor] = {}  # warm-start factors, per parameter
        self.plans: dict[tuple[str, ...], BucketPlan] = {}
        self.buffers: dict[tuple[str, ...], tuple[torch.Tensor, LowRank]] = {}  # first message, factors
        # hierarchical=True: the two levels (their thread is the state's, ``group`` the nodes' group), and
        # per bucket the offsets of its shards (whole parameters) and this process's parameters [lo, hi)
        self.levels: Optional[TwoLevel] = None
        self.shards: dict[tuple[str, ...], tuple[list[int], int, int]] = {}
        # fault tolerance: the buckets the round in flight started (``Kept``); per hierarchical shard
        # a copy of its residual as its round started (``befores``, reused; in host memory when
        # ``on_host``: ft_offload=True)
        self.keeps, self.on_host = keeps, on_host
        self.befores: dict[tuple[str, ...], torch.Tensor] = {}
        self.kept: dict[tuple[str, ...], Kept] = {}

    def keep(
        self, names: Sequence[str], residual: torch.Tensor, compressed: Sequence[str], unfold: Optional["Unfold"] = None
    ) -> "Kept":
        """Note what a bucket's round is about to change: its matrices' Q's (copied) and its
        residual, copied unless ``unfold`` can compute it back once the round has finished."""
        key = tuple(names)
        if unfold is None:
            before = self.befores.get(key)
            if before is None or before.shape != residual.shape or before.dtype != residual.dtype:
                before = self.befores[key] = offload.empty_like(residual, self.on_host)
            before.copy_(residual)
        qs = {n: None if n not in self.qs else self.qs[n].clone() for n in compressed}
        kept = self.kept[key] = Kept(residual, qs, unfold)
        return kept

    def settle(self) -> None:
        """The round completed: what it changed stands."""
        self.kept.clear()

    def undo(self) -> None:
        """The round in flight was abandoned: each bucket it started gets its residual and Q's back,
        so that the round done again adds each residual once."""
        for key, kept in self.kept.items():
            residual, qs = kept.residual, kept.qs
            if kept.unfold is None:
                residual.copy_(self.befores[key])
            elif kept.finished:
                kept.unfold.restore()
            for name, q in qs.items():
                if q is None:
                    self.qs.pop(name, None)
                else:
                    self.qs[name] = q
        self.kept.clear()

    def state_dict(self) -> dict[str, Any]:
        qs = {n: q.clone() for n, q in self.qs.items()}
        return {"steps": self.passes, "residuals": self.residuals.state_dict(), "qs": qs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"steps", "residuals", "qs"} - set(state)
        if missing:
            raise ValueError(f"a powersgd state needs {sorted(missing)}; got keys {sorted(state)}")
        self.passes = int(state["steps"])
        self.residuals.load_state_dict(state["residuals"])
        self.qs = {name: q.clone() for name, q in state["qs"].items()}


class PowerSGD(Algorithm[PowerSGDState]):
    """Rank-r PowerSGD with error feedback and warm start.

    Args:
        rank: rank of the approximation.
        start_iter: synchronized backward passes averaged uncompressed first.
        min_compression_rate: an n x m matrix is compressed only if
            n*m > rate * (n+m) * rank; others are averaged uncompressed.
        warm_start: start each power iteration from the previous step's Q.
        hierarchical: sum in full precision inside each node (reduce-scatter
            between parameters); each process runs PowerSGD across nodes on
            its share of the matrices (their residuals and Q's live there);
            all-gather inside the node.

    Example::

        model = unison.DataParallel(net, algorithm="powersgd:rank=4,start_iter=10")
    """

    name = "powersgd"
    #: It reduces low-rank buckets with error feedback: sparse gradients (nn.Embedding(sparse=True)) are refused at construction.
    sparse_gradients: ClassVar[bool] = False
    recovery = Recovery(rank_local=("residuals",))  # error feedback belongs to the rank; the Q factors are shared
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.integer("rank", self.rank)
        options.integer("start_iter", self.start_iter, minimum=0)
        options.number("min_compression_rate", self.min_compression_rate, low=1.0, open_low=False)
        options.boolean("warm_start", self.warm_start)
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    def setup(self, replica: Replica) -> PowerSGDState:
        h = (
            TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True)
            if self.hierarchical
            else None
        )
        keeps, on_host = replica.fault_tolerant, replica.saved_on_host
        if h is None:
            group, thread = open_thread(replica, self.name) if replica.distributed else (None, None)
            return PowerSGDState(group, thread, keeps, on_host)
        state = PowerSGDState(h.inter, h.thread, keeps, on_host)
        state.levels, h.thread = h, None  # the levels' thread is the state's
        return state

    def compressing(self, state: PowerSGDState) -> bool:
        """Whether the current backward pass compresses (the warm-up is over)."""
        return state.passes >= self.start_iter

    def reduce_bucket(
        self, replica: Replica, state: PowerSGDState, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        h = state.levels
        if not self.compressing(state):
            if h is None:
                return comm.start(dist.all_reduce, bucket.flat, group=group)
            return state.running_thread().submit(h.run, bucket.flat, h.allreduce)
        if h is not None:
            bounds, lo, hi = self._shard(state, bucket, h)
            cross = partial(self._shard_reduce, state, bucket, lo, hi, state.passes)
            return state.running_thread().submit(h.run, bucket.flat, cross, bounds)
        plan = self._plan(state, bucket.names, bucket.params)
        saved = replica.saved_gradients(bucket) if state.keeps else None
        scale = replica.gradient_scale
        return state.running_thread().submit(self._compressed_reduce, state, bucket, plan, state.passes, saved, scale)

    def bucket_wire_bytes(self, replica: Replica, state: PowerSGDState, bucket: Bucket, world_size: int) -> int:
        h, flat = state.levels, bucket.flat
        if not self.compressing(state):
            if h is None:
                return super().bucket_wire_bytes(replica, state, bucket, world_size)
            return h.wire_bytes(flat, comm.ring_bytes(h.shard_numel(flat.numel()) * flat.element_size(), h.nodes))
        bounds, lo, hi = (None, 0, len(bucket.params)) if h is None else self._shard(state, bucket, h)
        plan = self._plan(state, bucket.names[lo:hi], bucket.params[lo:hi])
        size = torch.empty(0, dtype=work_dtype(bucket.dtype)).element_size()
        sent = comm.ring_bytes((plan.plain_numel + plan.p_numel + plan.q_numel) * size, h.nodes if h else world_size)
        return sent if h is None else h.wire_bytes(flat, sent, bounds)

    def after_backward(self, replica: Replica, state: PowerSGDState) -> None:
        state.passes += 1
        state.settle()

    def release(self, replica: Replica, state: PowerSGDState) -> None:
        """The members changed (or the wrapper is gone): once the thread has stopped, each bucket
        the round in flight started gets back its residual and Q's, so that the round done again
        on the new membership adds each residual once."""
        super().release(replica, state)
        with torch.no_grad():
            state.undo()

    def _plan(self, state: PowerSGDState, names: Sequence[str], params: Sequence[torch.Tensor]) -> BucketPlan:
        key = tuple(names)
        if key not in state.plans:
            state.plans[key] = plan_bucket(params, self.rank, self.min_compression_rate)
        return state.plans[key]

    def _shard(self, state: PowerSGDState, bucket: Bucket, h: TwoLevel) -> tuple[list[int], int, int]:
        """The bucket's shard offsets (between parameters, one run per local rank) and this process's parameters."""
        key = tuple(bucket.names)
        if key not in state.shards:
            sizes = [p.numel() for p in bucket.params]
            bounds = aligned_bounds(sizes, h.local_size)
            ends = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            start, end = h.shard(bounds)
            state.shards[key] = (bounds, ends.index(start), ends.index(end))
        return state.shards[key]

    def _shard_reduce(
        self, state: PowerSGDState, bucket: Bucket, lo: int, hi: int, step: int, shard: torch.Tensor, offset: int
    ) -> None:
        """The cross-node step: PowerSGD over the nodes on the node's sum of this process's parameters."""
        params = bucket.params[lo:hi]
        sub = Bucket(bucket.index, bucket.indices[lo:hi], bucket.names[lo:hi], params, shard, split(shard, params))
        self._compressed_reduce(state, sub, self._plan(state, sub.names, params), step)

    def _q(
        self, state: PowerSGDState, name: str, cols: int, step: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The start of this step's power iteration for parameter ``name``."""
        q = state.qs.get(name) if self.warm_start else None
        if q is None or q.shape != (cols, self.rank):
            q = initial_q(name, cols, self.rank, 0 if self.warm_start else step, dtype, device)
        return q.to(dtype=dtype, device=device)

    def _buffers(
        self, state: PowerSGDState, bucket: Bucket, plan: BucketPlan, dtype: torch.dtype
    ) -> tuple[torch.Tensor, LowRank]:
        """The bucket's reusable first message (plain tensors, then the P's) and its factors."""
        key = tuple(bucket.names)
        if key not in state.buffers or state.buffers[key][0].dtype != dtype:
            first = torch.empty(plan.plain_numel + plan.p_numel, dtype=dtype, device=bucket.flat.device)
            state.buffers[key] = (first, LowRank(plan.shapes, self.rank, first[plan.plain_numel :]))
        return state.buffers[key]

    def _compressed_reduce(
        self,
        state: PowerSGDState,
        bucket: Bucket,
        plan: BucketPlan,
        step: int,
        saved: Optional[list[torch.Tensor]] = None,
        scale: float = 1.0,
    ) -> None:
        """On the CommThread: add the residuals, exchange P's (with the plain tensors) then Q's, write
        P Q^T back. Under fault tolerance note what the round changes (``saved``, ``scale``: a flat
        bucket's saved gradients and their scale, to compute its residual back with)."""
        residual = state.residuals.get(bucket)
        views, dtype = bucket.views, work_dtype(bucket.dtype)
        residuals = split(residual, views)
        errors = [residuals[i].view(n, m) for i, (n, m) in zip(plan.compressed, plan.shapes)]
        first, low = self._buffers(state, bucket, plan, dtype)
        kept = None
        if state.keeps:
            unfold = None if saved is None else Unfold(errors, saved, scale, plan, low)
            kept = state.keep(bucket.names, residual, [bucket.names[i] for i in plan.compressed], unfold)
        bucket.flat.add_(residual)
        cast = dtype != bucket.dtype  # factors in float32: the matrices are converted copies
        mats = [views[i].view(n, m) for i, (n, m) in zip(plan.compressed, plan.shapes)]
        if cast:
            mats, out_mats = [m.to(dtype) for m in mats], mats
            errors, out_errors = [torch.empty_like(m) for m in errors], errors
        for k, i in enumerate(plan.compressed):
            q = self._q(state, bucket.names[i], plan.shapes[k][1], step, dtype, first.device)
            if q.data_ptr() != low.qs[k].data_ptr():
                low.qs[k].copy_(q)

        plain = [views[i] for i in plan.plain]
        if plain:
            torch.cat([v.reshape(-1) for v in plain], out=first[: plan.plain_numel])
        low.compute_p(mats)
        dist.all_reduce(first, group=state.group)
        for view, part in zip(plain, split(first[: plan.plain_numel], plain)):
            view.copy_(part)
        low.orthogonalize_p()
        low.compute_q(mats)
        dist.all_reduce(low.q_flat, group=state.group)
        low.finish(mats, errors)  # residual = M - P Q_local^T, M = P Q^T
        if cast:
            for dst, src in zip(out_mats + out_errors, mats + errors):
                dst.copy_(src)
        for k, i in enumerate(plan.compressed):
            state.qs[bucket.names[i]] = low.qs[k]
        for i in plan.plain:
            residuals[i].zero_()
        if kept is not None:
            kept.finished = True
