"""SparseLoCo's compression written plainly (loops, no packing, no buffers): what
``unison.engine.topk`` and the ``sparseloco`` algorithm must compute, for the tests."""

from __future__ import annotations

import math

import torch


def quantized_topk(
    x: torch.Tensor, chunk: int, k: int, bits: int, scale_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The dense values a message of ``x`` carries: in each chunk (the fewest chunks of at most
    ``chunk`` values, all of one size, zero padding last), its ``k`` entries of largest magnitude
    on ``2**bits`` levels symmetric about zero scaled by the chunk's largest (the scale rounded to
    ``scale_dtype``); zeros elsewhere."""
    n = x.numel()
    chunks = max(1, math.ceil(n / chunk))
    size = max(1, math.ceil(n / chunks))
    padded = torch.zeros(chunks * size)
    padded[:n] = x.reshape(-1).float()
    out = torch.zeros_like(padded)
    top = 2**bits - 1
    for c in range(chunks):
        row = padded[c * size : (c + 1) * size]
        idx = torch.argsort(row.abs(), descending=True)[: min(k, size)]
        v = row[idx]
        scale = (2 * v.abs().max() / top).to(scale_dtype).float()
        if scale == 0:
            continue
        q = torch.round(v / scale + top / 2).clamp(0, top)
        out[c * size + idx] = (q - top / 2) * scale
    return out[:n]


def sparseloco_sync(
    global_: torch.Tensor, errors: list[torch.Tensor], weights: list[torch.Tensor], *, beta, outer_lr, chunk, k, bits
) -> torch.Tensor:
    """One outer step of SparseLoCo over the ranks' flat ``weights``: each rank's error becomes
    ``beta * e + (global - w)``, sends ``quantized_topk`` of it and keeps the rest (``errors``
    updated in place); returns ``global - outer_lr * mean(sent)``."""
    sent = []
    for e, w in zip(errors, weights):
        e.mul_(beta).add_(global_ - w)
        s = quantized_topk(e, chunk, k, bits)
        e.sub_(s)
        sent.append(s)
    return global_ - outer_lr * torch.stack(sent).mean(0)
