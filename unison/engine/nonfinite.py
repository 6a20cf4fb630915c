"""Non-finite gradients (``DataParallel(nonfinite=...)``): how ranks agree on the first bad one.

Every rank encodes its own first non-finite gradient as one integer; a MAX
allreduce then picks the lowest rank that has one and, on that rank, the
lowest parameter index, so every rank learns the same (rank, parameter).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

MODES = (None, "raise", "skip")


def encode(bad: Optional[int], rank: int, world: int, n: int) -> int:
    """This rank's code: 0 when all ``n`` gradients are finite; larger for lower ranks, then lower indices."""
    return 0 if bad is None else (world - rank) * (n + 1) + (n - bad)


def decode(code: int, world: int, n: int) -> tuple[int, int]:
    """The (rank, parameter index) behind the MAX of every rank's code (``code`` > 0)."""
    return world - code // (n + 1), n - code % (n + 1)


def error(rank: int, name: str) -> FloatingPointError:
    """What every rank raises under ``nonfinite="raise"``."""
    return FloatingPointError(
        f"non-finite gradient (nan or inf) on rank {rank} in parameter {name!r}; it was not sent to the "
        "other ranks. Use DataParallel(..., nonfinite='skip') to skip such steps on every rank instead."
    )


def drop_gradients(params: Iterable[torch.Tensor]) -> None:
    """Skip the coming step: torch's optimizers leave parameters without a gradient untouched."""
    for p in params:
        p.grad = None
