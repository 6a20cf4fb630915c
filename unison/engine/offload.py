"""Copies kept on the host: the state an algorithm touches only at a sync (``offload=True``).

DiLoCo's global weights and outer momentum, decentralized gossip's public copy and
neighbour replicas, and fault tolerance's saved state are read and written only at
a sync. ``keep(t, offload=True)`` puts such a copy in host memory (pinned where CUDA
is available, so that copies to the GPU overlap), and a sync moves it to the
parameters' device piece by piece (``pieces``: at most ``PIECE_BYTES`` each), so
the GPU holds only what local training holds plus one piece. Where the
parameters already live on the host (CPU training) offload changes nothing.
See docs/algorithms.md#memory-and-offload.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .comm import STAGING_BYTES

#: The largest piece of an offloaded copy a sync moves to the device at once.
PIECE_BYTES = STAGING_BYTES

HOST = torch.device("cpu")


def home(device: torch.device, offload: bool) -> torch.device:
    """Where a copy of a tensor on ``device`` lives: the host when offloaded, else ``device``."""
    return HOST if offload else torch.device(device)


def empty_like(t: torch.Tensor, offload: bool) -> torch.Tensor:
    """An uninitialized tensor shaped like ``t``, where ``home`` says (pinned host memory when
    offloaded from an accelerator): the buffer a copy made at every sync is written into.

    Example::

        before = empty_like(residual, offload=True)   # on the host; on the residual's device on CPU training
        before.copy_(residual)
    """
    where = home(t.device, offload)
    if where == t.device:
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=t.dtype, device=where, pin_memory=torch.cuda.is_available())


def keep(t: torch.Tensor, offload: bool) -> torch.Tensor:
    """A detached copy of ``t`` where ``home`` says (pinned host memory when offloaded from CUDA).

    Example::

        public = keep(flat, offload=True)   # on the host; a no-op move on CPU training
    """
    t = t.detach()
    if not offload or t.device.type == "cpu":
        return t.clone()
    return empty_like(t, offload).copy_(t)


def pieces(numel: int, element_size: int, cap_bytes: int = PIECE_BYTES) -> Iterator[slice]:
    """Consecutive slices covering ``numel`` values of ``element_size`` bytes, each at most ``cap_bytes``."""
    step = max(1, cap_bytes // max(1, element_size))
    for start in range(0, numel, step):
        yield slice(start, min(numel, start + step))
