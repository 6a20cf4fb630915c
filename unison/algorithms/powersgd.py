"""PowerSGD: gradients of matrix-shaped parameters sent as rank-r factors, with error feedback.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019). Each parameter of
two or more dimensions is viewed as a matrix M (shape[0] rows); one step of
power iteration with the previous step's Q (warm start) gives
P = orthogonalize(sum over ranks of M Q), Q = sum over ranks of M^T P, and the
update P Q^T, a rank-r approximation of the averaged gradient. Each rank keeps
what its own share of the update missed (error feedback) and adds it to its
next gradient, so nothing is lost, only delayed: M holds this rank's gradient
already divided by the world size, its share of the update is P (M^T P)^T,
the shares sum to P Q^T, and the residual is M - P (M^T P)^T (the paper's
"local error"). Summed over ranks, the residuals are exactly what the update
left out of the averaged gradient.

Per bucket this takes two dependent allreduces (the P's, with the uncompressed
tensors packed beside them, then the Q's), run on a CommThread over a private
process group. The first ``start_iter`` synchronized backward passes use a
plain allreduce, as the paper's warm-up does.

All ranks end with identical gradients: the P's are identical after their
allreduce, so the orthogonalization (a reduced QR) gives the same factors on
every rank, provided the ranks run the same build of the linear-algebra
library on the same kind of CPU or GPU.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..buckets import split
from .base import Algorithm
from .state import FlatState


def is_compressible(shape: torch.Size, rank: int, min_rate: float) -> bool:
    """Whether sending rank-``rank`` factors of a tensor of ``shape`` saves at least ``min_rate``."""
    if len(shape) < 2:
        return False
    n = shape[0]
    m = shape.numel() // n if n else 0
    return n * m > min_rate * (n + m) * rank


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``p`` (n x r, n > r), by reduced QR.

    Householder QR always returns orthonormal columns, even when ``p`` is rank
    deficient (a low-rank or zero gradient).
    """
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(name: str, cols: int, rank: int, salt: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A random cols x rank start for the power iteration, the same on every rank.

    Seeded from the parameter's name and ``salt``, so it does not depend on the
    bucket layout or on any process's global random state.
    """
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{salt}".encode()))
    return torch.randn(cols, rank, generator=g, dtype=dtype).to(device)


@dataclass
class BucketPlan:
    """Which of a bucket's parameters are compressed, and the sizes of the packed buffers."""

    compressed: list[int]  # positions in the bucket of the matrices sent as factors
    plain: list[int]  # positions of the tensors averaged uncompressed
    shapes: list[tuple[int, int]]  # (rows, cols) of each compressed matrix
    plain_numel: int
    p_numel: int
    q_numel: int


def plan_bucket(params, rank: int, min_rate: float) -> BucketPlan:
    """Split a bucket's parameters into compressed matrices and plain tensors."""
    compressed, plain, shapes = [], [], []
    for i, p in enumerate(params):
        if is_compressible(p.shape, rank, min_rate):
            compressed.append(i)
            shapes.append((p.shape[0], p.numel() // p.shape[0]))
        else:
            plain.append(i)
    return BucketPlan(
        compressed,
        plain,
        shapes,
        plain_numel=sum(params[i].numel() for i in plain),
        p_numel=sum(n * rank for n, _ in shapes),
        q_numel=sum(m * rank for _, m in shapes),
    )


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the factors are computed and sent in (QR needs float32 or float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class PowerSGD(Algorithm):
    """Rank-r PowerSGD with error feedback and warm start.

    Options:
        rank: rank of the approximation (positive integer).
        start_iter: synchronized backward passes averaged uncompressed before
            compression starts (non-negative integer).
        min_compression_rate: a matrix n x m is compressed only if
            n*m > rate * (n+m) * rank; smaller ones and 1-D tensors are averaged
            uncompressed (a number of at least 1).
        warm_start: start each power iteration from the previous step's Q
            (otherwise from a fresh random Q, the same on every rank).
    """

    name = "powersgd"
    defaults = {"rank": 4, "start_iter": 10, "min_compression_rate": 2.0, "warm_start": True}

    def validate(self) -> None:
        o = self.options
        if not _is_int(o["rank"]) or o["rank"] < 1:
            raise ValueError(f"rank must be a positive integer, got {o['rank']!r}")
        if not _is_int(o["start_iter"]) or o["start_iter"] < 0:
            raise ValueError(f"start_iter must be a non-negative integer, got {o['start_iter']!r}")
        rate = o["min_compression_rate"]
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 1:
            raise ValueError(f"min_compression_rate must be a number of at least 1, got {rate!r}")
        if not isinstance(o["warm_start"], bool):
            raise ValueError(f"warm_start must be True or False, got {o['warm_start']!r}")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.steps = 0
        self.residuals = FlatState()
        self.qs: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[str, ...], BucketPlan] = {}
        self.group: Optional[dist.ProcessGroup] = None
        self.thread: Optional[comm.CommThread] = None

    # ---- events -------------------------------------------------------
    def setup(self, model) -> None:
        self.open_thread(model)


    def compressing(self) -> bool:
        """Whether the current backward pass compresses (the warm-up is over)."""
        return self.steps >= self.options["start_iter"]

    def reduce_bucket(self, bucket, group):
        if not self.compressing():
            return comm.start(dist.all_reduce, bucket.flat, group=group)
        return self.thread.submit(self._compressed_reduce, bucket, self._plan(bucket), self.steps)

    def bucket_wire_bytes(self, bucket, world_size):
        if not self.compressing():
            return super().bucket_wire_bytes(bucket, world_size)
        plan = self._plan(bucket)
        size = torch.empty(0, dtype=work_dtype(bucket.dtype)).element_size()
        return comm.ring_bytes((plan.plain_numel + plan.p_numel + plan.q_numel) * size, world_size)

    def after_backward(self, model) -> None:
        self.steps += 1

    # ---- the compressed reduction (on the comm thread) -----------------
    def _plan(self, bucket) -> BucketPlan:
        key = tuple(bucket.names)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_bucket(bucket.params, self.options["rank"], self.options["min_compression_rate"])
        return plan

    def _q(self, name: str, cols: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The start of this step's power iteration for parameter ``name``."""
        q = self.qs.get(name) if self.options["warm_start"] else None
        if q is None or q.shape != (cols, self.options["rank"]):
            salt = 0 if self.options["warm_start"] else step
            q = initial_q(name, cols, self.options["rank"], salt, dtype, device)
        return q.to(dtype=dtype, device=device)

    def _compressed_reduce(self, bucket, plan: BucketPlan, step: int) -> None:
        """Add the residuals, exchange P's (with the plain tensors) then Q's, write P Q^T back."""
        residual = self.residuals.get(bucket)
        bucket.flat.add_(residual)
        views = bucket.views
        rank = self.options["rank"]
        dtype, device = work_dtype(bucket.dtype), bucket.flat.device
        mats = [views[i].reshape(n, m).to(dtype) for i, (n, m) in zip(plan.compressed, plan.shapes)]
        qs = [self._q(bucket.names[i], m, step, dtype, device) for i, (_, m) in zip(plan.compressed, plan.shapes)]

        plain = [views[i] for i in plan.plain]
        first = torch.empty(plan.plain_numel + plan.p_numel, dtype=dtype, device=device)
        if plain:
            torch.cat([v.reshape(-1) for v in plain], out=first[: plan.plain_numel])
        ps = _factor_views(first[plan.plain_numel :], [n for n, _ in plan.shapes], rank)
        for mat, q, p in zip(mats, qs, ps):
            torch.matmul(mat, q, out=p)
        dist.all_reduce(first, group=self.group)
        for view, part in zip(plain, split(first[: plan.plain_numel], plain)):
            view.copy_(part)
        for p in ps:
            p.copy_(orthogonalize(p))

        second = torch.empty(plan.q_numel, dtype=dtype, device=device)
        new_qs = _factor_views(second, [m for _, m in plan.shapes], rank)
        for mat, p, q in zip(mats, ps, new_qs):
            torch.matmul(mat.t(), p, out=q)
        local_qs = [q.clone() for q in new_qs]
        dist.all_reduce(second, group=self.group)

        residual_views = split(residual, views)
        for k, i in enumerate(plan.compressed):
            mat, p = mats[k], ps[k]
            n, m = plan.shapes[k]
            # residual = M - P Q_local^T and grad = P Q^T, each in one operation (in place when dtypes allow).
            if mat.dtype == bucket.dtype:
                torch.addmm(mat, p, local_qs[k].t(), alpha=-1, out=residual_views[i].view(n, m))
                torch.matmul(p, new_qs[k].t(), out=views[i].view(n, m))
            else:
                residual_views[i].view(n, m).copy_(torch.addmm(mat, p, local_qs[k].t(), alpha=-1))
                views[i].view(n, m).copy_(p @ new_qs[k].t())
            self.qs[bucket.names[i]] = new_qs[k]
        for i in plan.plain:
            residual_views[i].zero_()

    # ---- state --------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "residuals": self.residuals.state_dict(),
            "qs": {name: q.clone() for name, q in self.qs.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"steps", "residuals", "qs"} - set(state)
        if missing:
            raise ValueError(f"a powersgd state needs {sorted(missing)}; got keys {sorted(state)}")
        self.steps = int(state["steps"])
        self.residuals.load_state_dict(state["residuals"])
        self.qs = {name: q.clone() for name, q in state["qs"].items()}


def _factor_views(flat: torch.Tensor, rows: list[int], rank: int) -> list[torch.Tensor]:
    """Consecutive rows x rank matrices laid out in ``flat``."""
    out, offset = [], 0
    for n in rows:
        out.append(flat[offset : offset + n * rank].view(n, rank))
        offset += n * rank
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
