"""Non-finite gradients (``DataParallel(nonfinite=...)``): how ranks agree on the first bad one.

Every rank encodes its own first non-finite gradient as one integer; a MAX
allreduce then picks the lowest rank that has one and, on that rank, the
lowest parameter index, so every rank learns the same (rank, parameter).
The gradient engine agrees inside backward (``GradReducer``); ``agree_at_step``
does it at the optimizer step for gradients the engine did not average.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import wire_device

MODES = (None, "raise", "skip")

logger = logging.getLogger("unison")


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


def first_bad(tensors: Sequence[torch.Tensor], indices: Sequence[int], n: int) -> torch.Tensor:
    """The lowest of ``indices`` whose tensor holds nan or inf (``n`` if none), as a 0-dim int64
    tensor on the tensors' device: found without a host sync."""
    marks = [torch.where(torch.isfinite(t).all(), n, i) for i, t in zip(indices, tensors)]
    return torch.stack(marks).min()


def code_of(first: torch.Tensor, rank: int, world: int, n: int) -> torch.Tensor:
    """``encode`` on the device, from ``first_bad``'s answer (``n``: none)."""
    return torch.where(first < n, (world - rank) * (n + 1) + n - first, 0)


def agree_at_step(
    trainable: Sequence[tuple[str, torch.Tensor]],
    mode: str,
    rank: int,
    world_size: int,
    group: Optional[dist.ProcessGroup],
    shadow: bool = False,
) -> bool:
    """At an optimizer step, agree with every rank on the first non-finite gradient (one allreduce).

    Under ``mode="raise"`` every rank raises ``error``; under ``"skip"`` every rank drops its
    gradients and True is returned: the step is skipped. A ``shadow`` rank (one that ran out of
    inputs under ``join()``) has no gradient of its own to report.
    """
    n = len(trainable)
    grads = [(i, p.grad) for i, (_, p) in enumerate(trainable) if p.grad is not None and not shadow]
    wire = wire_device(group)
    if grads:
        first = first_bad([g for _, g in grads], [i for i, _ in grads], n)
        code = code_of(first, rank, world_size, n).reshape(1).to(wire)
    else:
        code = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    agreed = int(code.item())  # the step's skip or raise is decided on the host: one read per step
    if not agreed:
        return False
    where, index = decode(agreed, world_size, n)
    if mode == "raise":
        raise error(where, trainable[index][0])
    drop_gradients(p for _, p in trainable)
    logger.warning(
        "optimizer step skipped on every rank: non-finite gradient on rank %d in parameter %r",
        where,
        trainable[index][0],
    )
    return True
