"""PowerSGD's wire format: rank-``r`` factors of matrices, one step of power iteration (pure
tensors, no communication).

See docs/algorithms.md#powersgd.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

CPU = torch.device("cpu")
#: Values per block of rows in ``LowRank.finish``.
FINISH_BLOCK = 1 << 15


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns of ``p`` (n x r) by reduced QR (orthonormal even if ``p`` is rank deficient)."""
    return torch.linalg.qr(p, mode="reduced").Q


class LowRank:
    """Rank-``rank`` factors P (n x r) and Q (m x r) of n x m matrices, in reusable flat buffers.

    Args:
        shapes: (n, m) of each matrix.
        rank: columns of the factors.
        p_flat: where the P's live, one after the other (a part of a larger
            message); default a buffer of their own.
        dtype, device: of the buffers made here.

    One step of power iteration, as PowerSGD runs it: ``compute_p`` (P = M Q),
    ``orthogonalize_p``, ``compute_q`` (Q = M^T P, in ``q_flat``, a copy in
    ``q_local``), then ``finish`` (the error left, M - P Q_local^T, and the
    approximation P Q^T). P and Q are stored transposed (r x n, r x m): every
    product then streams M row by row, about as fast as a copy of M, where
    ``M^T @ P`` is over ten times slower on one CPU thread. ``finish`` works
    on blocks of rows that stay in cache between its two products.
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        rank: int,
        p_flat: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device = CPU,
    ) -> None:
        self.shapes, self.rank = [tuple(s) for s in shapes], rank
        if p_flat is None:
            p_flat = torch.empty(sum(n for n, _ in self.shapes) * rank, dtype=dtype, device=device)
        self.p_flat = p_flat
        self.q_flat = torch.empty(sum(m for _, m in self.shapes) * rank, dtype=p_flat.dtype, device=p_flat.device)
        self.q_local = torch.empty_like(self.q_flat)
        self.pts = self._transposed(p_flat, [n for n, _ in self.shapes])
        self.qts = self._transposed(self.q_flat, [m for _, m in self.shapes])
        self.qts_local = self._transposed(self.q_local, [m for _, m in self.shapes])
        self.ps = [pt.t() for pt in self.pts]  # n x r views
        self.qs = [qt.t() for qt in self.qts]  # m x r views

    def _transposed(self, flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return [t.view(self.rank, k) for t, k in zip(flat.split([k * self.rank for k in sizes]), sizes)]

    def compute_p(self, mats: Sequence[torch.Tensor]) -> None:
        """P = M Q for each matrix (as P^T = Q^T M^T)."""
        for mat, pt, qt in zip(mats, self.pts, self.qts):
            torch.mm(qt, mat.t(), out=pt)

    def orthogonalize_p(self) -> None:
        """Each P replaced by an orthonormal basis of its columns."""
        for p in self.ps:
            p.copy_(orthogonalize(p))

    def compute_q(self, mats: Sequence[torch.Tensor]) -> None:
        """Q = M^T P for each matrix (as Q^T = P^T M), also kept in ``q_local``."""
        for mat, pt, qt in zip(mats, self.pts, self.qts):
            torch.mm(pt, mat, out=qt)
        self.q_local.copy_(self.q_flat)

    def finish(self, mats: Sequence[torch.Tensor], residuals: Optional[Sequence[torch.Tensor]] = None) -> None:
        """``residual = M - P Q_local^T`` (with ``residuals``), then ``M = P Q^T``, for each matrix."""
        for k, (mat, p, qt) in enumerate(zip(mats, self.ps, self.qts)):
            step = max(1, FINISH_BLOCK // max(1, mat.shape[1]))
            for i in range(0, mat.shape[0], step):
                block = mat[i : i + step]
                if residuals is not None:
                    torch.addmm(block, p[i : i + step], self.qts_local[k], alpha=-1, out=residuals[k][i : i + step])
                torch.mm(p[i : i + step], qt, out=block)
