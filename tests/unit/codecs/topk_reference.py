"""SparseLoCo's compression written plainly (loops, no packing, no buffers): what
``unison.engine.codecs.topk`` and the ``sparseloco`` algorithm must compute, for the tests."""

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


def _divisor(n: int, side: int) -> int:
    return max(d for d in range(1, min(n, side) + 1) if n % d == 0)


def cut_as_tiles(shape: tuple[int, ...], side: int) -> bool:
    """Whether the references cut a tensor of ``shape`` into tiles (a matrix whose tiles hold at
    least ``side`` values), not into a vector's chunks."""
    if len(shape) < 2:
        return False
    rows, cols = shape[0], math.prod(shape) // shape[0]
    return _divisor(rows, side) * _divisor(cols, side) >= side


def tile_positions(shape: tuple[int, ...], side: int) -> list[torch.Tensor]:
    """The positions (in the flat tensor) of each chunk SparseLoCo's references cut a tensor of
    ``shape`` into: ``h x w`` tiles of a matrix (``shape[0] x rest``; the largest divisors up to
    ``side``) read row by row, else chunks of a vector (the largest divisor of its length up to
    ``side``, or even chunks with padding, as -1, when that divisor is under half of ``side``)."""

    def divisor(n: int) -> int:
        return _divisor(n, side)

    n = math.prod(shape)
    if cut_as_tiles(shape, side):
        rows, cols = shape[0], n // shape[0]
        h, w = divisor(rows), divisor(cols)
        out = []
        for i in range(rows // h):
            for j in range(cols // w):
                out.append(
                    torch.tensor([r * cols + c for r in range(i * h, i * h + h) for c in range(j * w, j * w + w)])
                )
        return out
    size = divisor(n)
    if 2 * size < min(side, n):
        chunks = math.ceil(n / side)
        size = math.ceil(n / chunks)
        padded = list(range(n)) + [-1] * (chunks * size - n)
        return [torch.tensor(padded[c * size : (c + 1) * size]) for c in range(chunks)]
    return [torch.arange(c * size, (c + 1) * size) for c in range(n // size)]


def binned(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The references' ``2**bits``-bin quantizer written plainly: what each of ``values`` decodes to."""
    levels = 2**bits
    shift = values.mean()
    centred = values - shift
    n = values.numel()
    std = centred.norm() / math.sqrt(n - 1) if n > 1 else torch.tensor(0.0)
    width = 6 * std / levels
    if not (width > 0 and math.isfinite(width)):
        width = torch.tensor(1.0)
    codes = torch.round(centred / width + levels // 2).clamp(0, levels - 1)
    out = torch.empty_like(values)
    for q in range(levels):
        where = codes == q
        if where.any():
            out[where] = centred[where].mean() + shift
    return out


def tiled_message(
    e: torch.Tensor, side: int, density: float, bits: int, fixed_k: bool = False, dense_vectors: bool = False
) -> torch.Tensor:
    """The dense values one tensor's message carries: the top ``round(density * size)`` entries
    of each chunk (``tile_positions``), quantized together by ``binned``; zeros elsewhere.
    Templar's forms: ``fixed_k``, every chunk the top ``round(density * side**2)`` (its length at
    most); ``dense_vectors``, every value of a tensor cut in chunks of a vector."""
    flat = e.reshape(-1)
    chosen = []
    vector = not cut_as_tiles(tuple(e.shape), side)
    for positions in tile_positions(tuple(e.shape), side):
        row = torch.stack([flat[p] if p >= 0 else torch.tensor(0.0) for p in positions.tolist()])
        if dense_vectors and vector:
            k = len(positions)
        elif fixed_k:
            k = min(len(positions), max(1, round(density * side * side)))
        else:
            k = min(len(positions), max(1, round(density * len(positions))))
        top = torch.argsort(row.abs(), descending=True)[:k]
        chosen += [(int(positions[t]), row[t]) for t in top.tolist()]
    decoded = binned(torch.stack([v for _, v in chosen]), bits)
    out = torch.zeros_like(flat)
    for (p, _), v in zip(chosen, decoded):
        if p >= 0:
            out[p] = v
    return out.view(e.shape)


def sparseloco_tiled_sync(
    global_: list[torch.Tensor],
    errors: list[list[torch.Tensor]],
    weights: list[list[torch.Tensor]],
    *,
    beta: float,
    outer_lr: float,
    side: int,
    density: float,
    bits: int,
    fixed_k: bool = False,
    dense_vectors: bool = False,
    median_clip: bool = False,
) -> list[torch.Tensor]:
    """One outer step of SparseLoCo as its references run it, tensor by tensor: each rank's error
    becomes ``beta * e + (global - w)``, sends ``tiled_message`` of it and keeps the rest
    (``errors[rank][tensor]`` updated in place); returns ``global - outer_lr * m`` with ``m`` each
    coordinate's mean over the ranks that sent it."""
    out = []
    for t, g in enumerate(global_):
        total, count = torch.zeros_like(g), torch.zeros_like(g)
        sents = []
        for rank, w in enumerate(weights):
            e = errors[rank][t]
            e.mul_(beta).add_(g - w[t])
            sent = tiled_message(e, side, density, bits, fixed_k, dense_vectors)
            e.sub_(sent)  # the error feedback keeps what this rank sent, before any clipping
            sents.append(sent)
        if median_clip:  # Templar's: each rank's values scaled by min(1, median norm / own norm)
            norms = [float(s.norm()) for s in sents]
            median = sorted(norms)[(len(norms) - 1) // 2]
            sents = [s * (median / n) if n > median else s for s, n in zip(sents, norms)]
        for sent in sents:
            total += sent
            count += (sent != 0).float()
        out.append(g - outer_lr * total / count.clamp(min=1))
    return out
