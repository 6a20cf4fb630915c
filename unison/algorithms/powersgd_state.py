"""PowerSGD's state, and its plan of a bucket: which matrices travel as rank-r factors, and their starting Q."""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.codecs import LowRank
from ..engine.flatstate import FlatState
from .base import ThreadedState
from .hierarchical import Hierarchy


def is_compressible(shape: torch.Size, rank: int, min_rate: float) -> bool:
    """Whether sending rank-``rank`` factors of a tensor of ``shape`` saves at least ``min_rate``."""
    n = shape[0] if len(shape) >= 2 else 0
    return n > 0 and n * (shape.numel() // n) > min_rate * (n + shape.numel() // n) * rank


def initial_q(name: str, cols: int, rank: int, salt: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A random cols x rank start, the same on every rank: seeded from the parameter's name and ``salt``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{salt}".encode()))
    return torch.randn(cols, rank, generator=g, dtype=dtype).to(device)


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


class PowerSGDState(ThreadedState):
    """Backward passes seen, residuals and Q factors (saved), bucket plans and buffers, group and thread."""

    __slots__ = ("passes", "residuals", "qs", "plans", "buffers", "hierarchy", "shards")

    def __init__(self, group: Optional[dist.ProcessGroup] = None, thread: Optional[comm.CommThread] = None) -> None:
        super().__init__(group, thread)
        self.passes = 0  # synchronized backward passes (saved as "steps")
        self.residuals = FlatState()  # error feedback, per parameter
        self.qs: dict[str, torch.Tensor] = {}  # warm-start factors, per parameter
        self.plans: dict[tuple[str, ...], BucketPlan] = {}
        self.buffers: dict[tuple[str, ...], tuple[torch.Tensor, LowRank]] = {}  # first message, factors
        # hierarchical=True: the two levels (their thread is the state's, ``group`` the nodes' group), and
        # per bucket the offsets of its shards (whole parameters) and this process's parameters [lo, hi)
        self.hierarchy: Optional[Hierarchy] = None
        self.shards: dict[tuple[str, ...], tuple[list[int], int, int]] = {}

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
