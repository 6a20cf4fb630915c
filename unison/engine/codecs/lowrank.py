"""PowerSGD's wire format: rank-``r`` factors of matrices, one step of power iteration (pure
tensors, no communication).

Two schedules (``engine.codecs.schedule``): ``"blocked"`` (the CPU's) runs a product per matrix
and ``finish`` by blocks of rows; ``"whole"`` runs one batched product (``bmm``, ``baddbmm``) and
one batched QR per group of matrices of one shape, so the ops do not grow with the matrices.

See docs/algorithms.md#powersgd.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...runtime import torch_private
from .schedule import WHOLE, schedule_for

CPU = torch.device("cpu")
#: Values per block of rows in ``LowRank.finish``.
FINISH_BLOCK = 1 << 15


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``p`` (n x r) by reduced QR (orthonormal even if ``p`` is rank deficient)."""
    return torch.linalg.qr(p, mode="reduced").Q


def view_of(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """``tensors`` (contiguous, of one shape) as one ``[g, ...]`` view, where they are views of one
    base evenly spaced without overlap (a bucket's repeated layers); else None."""
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0) if first.is_contiguous() else None
    step = tensors[1].storage_offset() - first.storage_offset()
    offset = first.storage_offset()
    base = torch_private.view_base(first)
    if base is None or step < first.numel():
        return None
    for j, t in enumerate(tensors):
        if torch_private.view_base(t) is not base or not t.is_contiguous() or t.storage_offset() != offset + j * step:
            return None
    return first.as_strided((len(tensors), *first.shape), (step, *first.stride()))


def batch(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (of one shape) as one ``[g, ...]`` tensor: a view where ``view_of`` finds one, else a stacked copy."""
    found = view_of(tensors)
    return torch.stack(list(tensors)) if found is None else found


def store(tensors: Sequence[torch.Tensor], values: torch.Tensor) -> None:
    """``tensors[j] = values[j]`` in one op."""
    torch._foreach_copy_(list(tensors), list(values.unbind(0)))


class LowRank:
    """Rank-``rank`` factors P (n x r) and Q (m x r) of n x m matrices, in reusable flat buffers.

    Args:
        shapes: (n, m) of each matrix.
        rank: columns of the factors.
        p_flat: where the P's live (a part of a larger message); default a buffer
            of their own.
        dtype, device: of the buffers made here.
        schedule: ``"blocked"`` or ``"whole"`` (default ``schedule_for(p_flat.device)``).

    One step of power iteration, as PowerSGD runs it: ``compute_p`` (P = M Q),
    ``orthogonalize_p``, ``compute_q`` (Q = M^T P, in ``q_flat``, a copy in
    ``q_local``), then ``finish`` (the error left, M - P Q_local^T, and the
    approximation P Q^T). P and Q are stored transposed (r x n, r x m): every
    product then streams M row by row, about as fast as a copy of M, where
    ``M^T @ P`` is over ten times slower on one CPU thread. ``finish`` works
    on blocks of rows that stay in cache between its two products. The factors lie
    group after group (``groups``: the matrices of one shape, in order), so that a group's
    are one ``[g, r, n]`` view for the whole schedule's batched products.
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        rank: int,
        p_flat: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device = CPU,
        schedule: Optional[str] = None,
    ) -> None:
        self.shapes, self.rank = [tuple(s) for s in shapes], rank
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for k, shape in enumerate(self.shapes):
            by_shape.setdefault(shape, []).append(k)
        self.groups = list(by_shape.values())  # positions of the matrices of each shape
        if p_flat is None:
            p_flat = torch.empty(sum(n for n, _ in self.shapes) * rank, dtype=dtype, device=device)
        self.p_flat = p_flat
        self.schedule = schedule_for(p_flat.device, schedule)
        self.q_flat = torch.empty(sum(m for _, m in self.shapes) * rank, dtype=p_flat.dtype, device=p_flat.device)
        self.q_local = torch.empty_like(self.q_flat)
        self.pts, self.pt_groups = self._transposed(p_flat, 0)
        self.qts, self.qt_groups = self._transposed(self.q_flat, 1)
        self.qts_local, self.qt_local_groups = self._transposed(self.q_local, 1)
        self.ps = [pt.t() for pt in self.pts]  # n x r views
        self.qs = [qt.t() for qt in self.qts]  # m x r views

    def _transposed(self, flat: torch.Tensor, side: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each matrix's r x (its ``side``'s size) factor in ``flat``, and each group's ``[g, r, size]`` view of them."""
        each: list[torch.Tensor] = [flat] * len(self.shapes)
        groups, offset = [], 0
        for group in self.groups:
            size = self.shapes[group[0]][side]
            grouped = flat[offset : offset + len(group) * self.rank * size].view(len(group), self.rank, size)
            offset += grouped.numel()
            groups.append(grouped)
            for j, k in enumerate(group):
                each[k] = grouped[j]
        return each, groups

    def compute_p(self, mats: Sequence[torch.Tensor]) -> None:
        """P = M Q for each matrix (as P^T = Q^T M^T)."""
        if self.schedule == WHOLE:
            for group, pt, qt in zip(self.groups, self.pt_groups, self.qt_groups):
                torch.bmm(qt, batch([mats[k] for k in group]).transpose(1, 2), out=pt)
            return
        for mat, pt, qt in zip(mats, self.pts, self.qts):
            torch.mm(qt, mat.t(), out=pt)

    def orthogonalize_p(self) -> None:
        """Each P replaced by an orthonormal basis of its columns."""
        if self.schedule == WHOLE:
            for pt in self.pt_groups:
                p = pt.transpose(1, 2)
                p.copy_(orthogonalize(p))  # one batched QR per group
            return
        for p in self.ps:
            p.copy_(orthogonalize(p))

    def compute_q(self, mats: Sequence[torch.Tensor]) -> None:
        """Q = M^T P for each matrix (as Q^T = P^T M), also kept in ``q_local``."""
        if self.schedule == WHOLE:
            for group, pt, qt in zip(self.groups, self.pt_groups, self.qt_groups):
                torch.bmm(pt, batch([mats[k] for k in group]), out=qt)
        else:
            for mat, pt, qt in zip(mats, self.pts, self.qts):
                torch.mm(pt, mat, out=qt)
        self.q_local.copy_(self.q_flat)

    def finish(self, mats: Sequence[torch.Tensor], residuals: Optional[Sequence[torch.Tensor]] = None) -> None:
        """``residual = M - P Q_local^T`` (with ``residuals``), then ``M = P Q^T``, for each matrix."""
        if self.schedule == WHOLE:
            self._finish_whole(mats, residuals)
            return
        for k, (mat, p, qt) in enumerate(zip(mats, self.ps, self.qts)):
            step = max(1, FINISH_BLOCK // max(1, mat.shape[1]))
            for i in range(0, mat.shape[0], step):
                block = mat[i : i + step]
                if residuals is not None:
                    torch.addmm(block, p[i : i + step], self.qts_local[k], alpha=-1, out=residuals[k][i : i + step])
                torch.mm(p[i : i + step], qt, out=block)

    def _finish_whole(self, mats: Sequence[torch.Tensor], residuals: Optional[Sequence[torch.Tensor]]) -> None:
        """``finish`` by groups: one ``baddbmm`` and one ``bmm`` each, straight into the matrices
        where they are one view (``view_of``), else into temporaries copied back in one op."""
        for group, pt, qt, qt_local in zip(self.groups, self.pt_groups, self.qt_groups, self.qt_local_groups):
            p = pt.transpose(1, 2)
            out = [mats[k] for k in group]
            target = view_of(out)
            if residuals is not None:
                errors = [residuals[k] for k in group]
                m = batch(out) if target is None else target
                error = view_of(errors)
                if error is None:
                    store(errors, torch.baddbmm(m, p, qt_local, alpha=-1))
                else:
                    torch.baddbmm(m, p, qt_local, alpha=-1, out=error)
            if target is None:
                store(out, torch.bmm(p, qt))
            else:
                torch.bmm(p, qt, out=target)
