"""Debug mode (``DataParallel(debug=True)`` or ``UNISON_DEBUG=1``): before every forward, all ranks
check that they are about to run the same step, and raise naming the ranks that differ instead
of hanging or mixing data.

A cheap check first (one 16-byte allreduce of a digest's maximum and minimum); only when the
digests differ do the ranks exchange their entries to say which one differs.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from .core import Core, check_ranks_agree


def step_entries(core: Core, forwards: int, synchronized: bool) -> list[tuple[Any, ...]]:
    """What every rank must agree on before its ``forwards``-th forward."""
    r = core.reducer
    return [
        ("setting", "forward number", forwards),
        ("setting", "gradients enabled", torch.is_grad_enabled()),
        ("setting", "synchronized (not no_sync)", synchronized),
        ("setting", "optimizer steps", core.clock.steps),
        ("setting", "algorithm", core.algorithm.describe()),
        ("setting", "world size", core.replica.world_size),
        ("setting", "bucket plan", r.groups if r is not None else None),
    ]


def check_step_agrees(core: Core, forwards: int, synchronized: bool, group: Optional[dist.ProcessGroup]) -> None:
    """Raise ValueError on every rank, naming the ranks and the setting that differ, unless all
    ranks of ``group`` are about to run the same step."""
    entries = step_entries(core, forwards, synchronized)
    digest = zlib.crc32(repr(entries).encode())
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if extremes[0].item() != -extremes[1].item():  # max differs from min
        check_ranks_agree("the training steps (debug mode)", entries, group)
