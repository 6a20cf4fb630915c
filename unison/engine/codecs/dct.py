"""DeMo's wire format: an orthonormal DCT-II per chunk and the chunk-wise top-k of its coefficients
(pure tensors, no communication).

``dct_matrix(n)`` is the orthonormal DCT-II basis (rows are the cosines), so a chunk's coefficients
are ``x @ D.T`` and ``c @ D`` is the chunk again. The top-k of the coefficients goes either through
``engine.codecs.topk.TopK`` (2/4/8-bit values and a scale per chunk) or ``FullTopK``: the same fixed-size
message with float32 values (the values, then the indices in the smallest integer type).

See docs/algorithms.md#demo.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .schedule import WHOLE, schedule_for
from .topk import BLOCK, TopK, index_dtype, sections

CPU = torch.device("cpu")


def dct_matrix(n: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` (``D @ D.T`` is the identity): row ``k`` is
    ``s_k cos(pi (2j + 1) k / 2n)`` over ``j``, ``s_0 = sqrt(1/n)``, ``s_k = sqrt(2/n)``.
    Computed in float64, then cast."""
    j = torch.arange(n, dtype=torch.float64)
    k = j[:, None]
    d = torch.cos(math.pi * (2 * j[None, :] + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(device=device, dtype=dtype)


def transform_(
    rows: torch.Tensor, matrix: torch.Tensor, scratch: torch.Tensor, schedule: Optional[str] = None
) -> torch.Tensor:
    """``rows = rows @ matrix`` in place (``rows`` ``[r, n]``); returns ``rows``. Blocked: a block
    of rows at a time through ``scratch`` (at least ``n`` values); whole (``schedule_for(rows.device,
    schedule)``): one product of all rows into a temporary of their size and one copy back."""
    if schedule_for(rows.device, schedule) == WHOLE:
        return rows.copy_(torch.mm(rows, matrix))
    n = matrix.shape[0]
    per = max(1, scratch.numel() // n)
    for r0 in range(0, rows.shape[0], per):
        block = rows[r0 : r0 + per]
        out = scratch[: block.numel()].view(block.shape)
        torch.mm(block, matrix, out=out)
        block.copy_(out)
    return rows


def transform_tiles_(
    tiles: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scratch: torch.Tensor, schedule: Optional[str] = None
) -> torch.Tensor:
    """``tiles[t] = left @ tiles[t] @ right`` in place for each tile of ``tiles`` (``[T, h, w]``,
    contiguous; ``left`` ``[h, h]``, ``right`` ``[w, w]``); returns ``tiles``. With ``left = D_h``
    and ``right = D_w.T`` it is each tile's 2-D DCT, with ``D_h.T`` and ``D_w`` its inverse.
    Blocked: a block of tiles at a time through ``scratch`` (at least ``h * w`` values); whole
    (``schedule_for(tiles.device, schedule)``): both products over all tiles at once (the
    right one into a temporary of their size, the left one batched back into ``tiles``)."""
    if schedule_for(tiles.device, schedule) == WHOLE:
        return torch.matmul(left, torch.matmul(tiles, right), out=tiles)
    count, h, w = tiles.shape
    per = max(1, scratch.numel() // (h * w))
    for t0 in range(0, count, per):
        block = tiles[t0 : t0 + per]
        out = scratch[: block.numel()].view(block.shape)
        torch.matmul(block, right, out=out)
        torch.matmul(left, out, out=block)
    return tiles


class FullTopK:
    """The chunk-wise top-k of ``numel`` values (a whole number of chunks of ``chunk``) with
    float32 values, in fixed-size messages: the values ``[chunks, k]``, then their positions in
    the chunk (``[chunks, k]``, uint8 up to 256 values per chunk, int16 up to 32768), padded
    to a multiple of 4 bytes. The face of ``engine.codecs.topk.TopK`` (``encode``, ``decode_add``, ``empty``).
    ``schedule`` (``engine.codecs.schedule``): the encode's top-k a block of chunks at a time
    (the CPU's) or over all chunks at once (``"whole"``, other devices); the decode is one
    scatter-add in both.

    Example::

        codec = FullTopK(x.numel(), chunk=64, topk=4)   # x.numel() a multiple of 64
        message = codec.encode(x, codec.empty())         # x keeps what was not sent
        y = torch.zeros_like(x); codec.decode_add(message, y)
    """

    def __init__(
        self,
        numel: int,
        chunk: int,
        topk: int,
        device: torch.device = CPU,
        scratch: Optional[torch.Tensor] = None,
        schedule: Optional[str] = None,
    ) -> None:
        if chunk < 1 or numel < 1 or numel % chunk:
            raise ValueError(f"numel must be a positive multiple of chunk, got numel={numel!r}, chunk={chunk!r}")
        if not 1 <= topk <= chunk:
            raise ValueError(f"topk must be in [1, chunk={chunk}], got {topk!r}")
        self.numel, self.size, self.k = numel, chunk, topk
        self.chunks = numel // chunk
        self.device = torch.device(device)
        self.schedule = schedule_for(self.device, schedule)
        self.index_dtype = index_dtype(chunk)
        width = torch.empty((), dtype=self.index_dtype).element_size()
        count = self.chunks * topk
        self._values = (0, 4 * count)
        self._indices = (self._values[1], self._values[1] + width * count)
        self.nbytes = -(-self._indices[1] // 4) * 4
        self.block = max(1, min(self.chunks, BLOCK // chunk))
        if scratch is None:
            scratch = torch.empty(self.block * chunk, dtype=torch.float32, device=self.device)
        self._magnitudes = scratch[: self.block * chunk].view(self.block, chunk)

    @property
    def padded(self) -> int:
        return self.numel

    def empty(self, rows: Optional[int] = None) -> torch.Tensor:
        """A new message (``rows``: that many messages, ``[rows, nbytes]``)."""
        shape = (self.nbytes,) if rows is None else (rows, self.nbytes)
        return torch.zeros(shape, dtype=torch.uint8, device=self.device)

    def parts(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one message: values ``[chunks, k]`` (float32) and indices ``[chunks, k]``."""
        v, i = self._values, self._indices
        values = message[v[0] : v[1]].view(torch.float32).view(self.chunks, self.k)
        return values, message[i[0] : i[1]].view(self.index_dtype).view(self.chunks, self.k)

    def encode(self, values: torch.Tensor, message: torch.Tensor, feedback: bool = True) -> torch.Tensor:
        """Top-k by magnitude of each chunk of ``values`` (flat float32) into ``message``; with
        ``feedback`` the sent entries are set to zero in ``values`` (the rest stays). Returns ``message``."""
        grid = values.view(self.chunks, self.size)
        sent, indices = self.parts(message)
        if self.schedule == WHOLE:
            _, where = torch.topk(grid.abs(), self.k, dim=1, sorted=False)
            torch.gather(grid, 1, where, out=sent)
            indices.copy_(where)
            if feedback:
                grid.scatter_(1, where, 0.0)
            return message
        for c0 in range(0, self.chunks, self.block):
            rows = grid[c0 : c0 + self.block]
            magnitudes = torch.abs(rows, out=self._magnitudes[: rows.shape[0]])
            _, where = torch.topk(magnitudes, self.k, dim=1, sorted=False)
            torch.gather(rows, 1, where, out=sent[c0 : c0 + rows.shape[0]])
            indices[c0 : c0 + rows.shape[0]].copy_(where)
            if feedback:
                rows.scatter_(1, where, 0.0)
        return message

    def decode_add(self, message: torch.Tensor, target: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``target += alpha * decode(message)`` (``target`` flat float32, ``numel`` long); returns it.
        One scatter-add with no repeated position: the same bits on every rank."""
        sent, indices = self.parts(message)
        values = sent * alpha if alpha != 1.0 else sent
        target.view(self.chunks, self.size).scatter_add_(1, indices.long(), values)
        return target

    def count_add(self, message: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``counts += 1`` where ``message`` sends a nonzero value (``counts`` flat float32,
        ``numel`` long): a chunk of zeros sends zeros at places its ties chose, which count for nothing."""
        sent, indices = self.parts(message)
        counts.view(self.chunks, self.size).scatter_add_(1, indices.long(), (sent != 0).float())
        return counts

    def add_all(
        self, messages: torch.Tensor, target: torch.Tensor, alpha: float = 1.0, counts: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``decode_add(m, target, alpha)`` (and with ``counts``, ``count_add(m, counts)``) for each
        message of ``messages`` (``[W, nbytes]``), in their order: the same values and bits, with the
        messages' parts read once for all of them and then one scatter-add a message (two with
        ``counts``), so the ops grow with ``W`` alone. Returns ``target``."""
        rows = messages.shape[0]
        v, i = self._values, self._indices
        sent = messages[:, v[0] : v[1]].view(torch.float32).view(rows, self.chunks, self.k)
        indices = messages[:, i[0] : i[1]].view(self.index_dtype).view(rows, self.chunks, self.k).long()
        values = sent * alpha if alpha != 1.0 else sent
        grid = target.view(self.chunks, self.size)
        for where, value in zip(indices.unbind(0), values.unbind(0)):
            grid.scatter_add_(1, where, value)
        if counts is not None:
            tally = counts.view(self.chunks, self.size)
            for where, nonzero in zip(indices.unbind(0), (sent != 0).float().unbind(0)):
                tally.scatter_add_(1, where, nonzero)
        return target


Codec = Union[TopK, FullTopK]


def codec(
    numel: int,
    chunk: int,
    topk: int,
    bits: Optional[int],
    device: torch.device,
    scratch: torch.Tensor,
    scale_dtype: torch.dtype = torch.float32,
    schedule: Optional[str] = None,
) -> Codec:
    """The top-k codec of ``numel`` values (whole chunks): float32 values (``bits=None``) or
    ``bits``-bit values with one ``scale_dtype`` scale per chunk (``TopK``); both share ``scratch``
    (at least ``scratch_numel(numel, chunk)`` float32 values) for a block of magnitudes.
    ``schedule`` goes to the codec (None: ``schedule_for(device)``)."""
    if bits is None:
        return FullTopK(numel, chunk, topk, device, scratch, schedule)
    return TopK(
        numel, chunk, topk=topk, bits=bits, device=device, scratch=scratch, scale_dtype=scale_dtype, schedule=schedule
    )


def message_bytes(
    numel: int, chunk: int, topk: int, bits: Optional[int], scale_dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of one message of ``codec(numel, chunk, topk, bits, ..., scale_dtype)`` (``numel`` a
    whole number of chunks)."""
    if bits is not None:
        return sections(numel // chunk, topk, chunk, bits, scale_dtype)[3]
    width = torch.empty((), dtype=index_dtype(chunk)).element_size()
    return -(-(4 + width) * (numel // chunk) * topk // 4) * 4
