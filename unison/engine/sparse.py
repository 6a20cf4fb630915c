"""Sparse gradients (``nn.Embedding(..., sparse=True)``): which parameters get them, and
the pieces of their reduction.

A sparse gradient cannot live in a flat bucket, so the gradient engine keeps
such parameters out of the buckets and sums each one with the sparse allreduce
gloo offers (``dist.all_reduce`` on a COO tensor), as torch DDP does. Which
parameters get sparse gradients is decided at construction, by torch DDP's rule
(``DistributedDataParallel._build_params_for_reducer``): the weights of
``nn.Embedding`` and ``nn.EmbeddingBag`` built with ``sparse=True``.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def expected(modules: Iterable[nn.Module]) -> set[int]:
    """``id()`` of the parameters that get sparse gradients: those of the modules that
    produce them (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``)."""
    ids: set[int] = set()
    for m in modules:
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            ids.update(id(p) for p in m.parameters(recurse=False))
    return ids


def empty(param: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A sparse gradient of ``param`` with no entry: what a rank without one contributes."""
    indices = torch.empty(sparse_dim, 0, dtype=torch.int64, device=param.device)
    values = torch.empty((0, *param.shape[sparse_dim:]), dtype=param.dtype, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape, is_coalesced=True, check_invariants=True)


def nbytes(grad: torch.Tensor) -> int:
    """Bytes of a coalesced sparse tensor's indices and values (what each rank sends of it)."""
    indices, values = grad.indices(), grad.values()
    return indices.numel() * indices.element_size() + values.numel() * values.element_size()


def finite(grad: torch.Tensor) -> bool:
    """Whether every stored value of a coalesced sparse gradient is finite."""
    return bool(torch.isfinite(grad.values()).all())
