"""Chunk-wise top-k with low-bit values: SparseLoCo's wire format (pure tensors, no communication).

A flat tensor is cut into equal chunks (``layout``); each chunk sends its ``k`` entries of
largest magnitude: their positions in the chunk (in the smallest integer type that holds the
chunk's size) and their values quantized to ``bits`` bits (2, 4 or 8) on a symmetric grid of
``2**bits`` levels scaled by one float32 (or bfloat16) per chunk. Every message of a codec has the same size,
so the ranks exchange them with one all-gather of equal buffers; each rank decodes every
message (``decode_add``: a scatter-add into a dense target).

Layout of one message (uint8, a multiple of 4 bytes): the chunks' scales (float32, or bfloat16
padded to 4 bytes), the indices (``[chunks, k]``), then the codes bit-packed ``8 // bits`` to a byte, low bits first.

See docs/algorithms.md#sparseloco.
"""

from __future__ import annotations

from typing import Optional

import torch

from .schedule import WHOLE, schedule_for

#: Values per block of ``TopK.encode``'s loop: a block's magnitudes fit a core's L2 cache.
BLOCK = 1 << 16
BITS = (2, 4, 8)
#: The dtypes a chunk's scale may travel in, by name: float32 (exact) or bfloat16 (half the bytes).
SCALE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU = torch.device("cpu")


def layout(numel: int, chunk: int) -> tuple[int, int]:
    """``(chunks, size)``: ``numel`` values cut into the fewest chunks of at most ``chunk``
    values, all of one size (the last padded by fewer than ``chunks`` values)."""
    chunks = max(1, -(-numel // chunk))
    return chunks, max(1, -(-numel // chunks))


def scratch_numel(numel: int, chunk: int) -> int:
    """The float32 values ``TopK(numel, chunk)`` asks of a shared ``scratch``: one block of chunks."""
    chunks, size = layout(numel, chunk)
    return max(1, min(chunks, BLOCK // size)) * size


def index_dtype(size: int) -> torch.dtype:
    """The smallest integer type that holds every position in a chunk of ``size`` values."""
    return torch.uint8 if size <= 1 << 8 else torch.int16 if size <= 1 << 15 else torch.int32


def sections(
    chunks: int, k: int, size: int, bits: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[slice, slice, slice, int]:
    """Where a message of ``chunks`` chunks of ``size`` values, ``k`` sent each, keeps its scales,
    indices and packed codes (byte slices), and its size in bytes: the scales first, then the
    indices from a 4-byte boundary, then the codes, the whole padded to 4 bytes."""
    scales = chunks * torch.empty((), dtype=scale_dtype).element_size()
    start = -(-scales // 4) * 4  # the indices start 4-byte aligned
    count = chunks * k
    indices = start + count * torch.empty((), dtype=index_dtype(size)).element_size()
    codes = indices + -(-count // (8 // bits)) * (8 // bits) * bits // 8  # whole bytes of codes
    return slice(0, scales), slice(start, indices), slice(indices, codes), -(-codes // 4) * 4


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """Pack ``codes`` (flat uint8, each below ``2**bits``, a multiple of ``8 // bits`` of them)
    into ``out`` (uint8, ``len(codes) * bits // 8`` bytes), low bits first; returns ``out``."""
    per = 8 // bits
    grouped = codes.view(-1, per)
    out.copy_(grouped[:, 0])
    for j in range(1, per):
        out.bitwise_or_(grouped[:, j] << (bits * j))
    return out


def unpack(packed: torch.Tensor, bits: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The codes ``pack`` packed into ``packed``: uint8, ``8 // bits`` per byte."""
    per, mask = 8 // bits, (1 << bits) - 1
    if out is None:
        out = torch.empty(packed.numel() * per, dtype=torch.uint8, device=packed.device)
    grouped = out.view(-1, per)
    for j in range(per):
        torch.bitwise_and(packed >> (bits * j), mask, out=grouped[:, j])
    return out


class TopK:
    """The top-k message of ``numel`` values, with its layout and a small reusable scratch.

    Args:
        numel: values in the flat tensors it encodes.
        chunk: at most this many values per chunk (``layout``).
        density: the share of each chunk sent, ``k = round(density * size)`` (at least 1).
        topk: ``k`` itself (at most the chunk's size), instead of ``density``.
        bits: bits per value: 2, 4 or 8.
        scale_dtype: the dtype of each chunk's scale on the wire: float32, or bfloat16 (2 bytes
            instead of 4, where small chunks make the scales a large share of a message).
        device: where the scratch lives (the tensors' device).
        scratch: a float32 buffer of at least ``scratch_numel(numel, chunk)`` values for the
            magnitudes of a block of chunks, shared by codecs run one at a time (default: its own).
        schedule: ``"blocked"`` (a loop over cache-sized blocks of chunks) or ``"whole"`` (one
            ``topk`` over all chunks, a temporary of the input's size: the same ops for any
            size); default ``schedule_for(device)`` (``engine.codecs.schedule``).

    The values are quantized on ``2**bits`` levels symmetric about zero, ``(q - (L-1)/2) * scale``
    for ``q`` in ``0..L-1``, with ``scale = 2 max|v| / (L-1)``: the chunk's largest value is sent
    exactly, each other to within ``scale / 2``; a chunk of zeros has scale 0 and decodes to zeros.
    A bfloat16 scale is rounded before the values are quantized with it, so the largest value is
    sent to within 0.4% and clamped to the top level; what is sent is what every rank decodes.

    Example::

        codec = TopK(x.numel(), chunk=4096, density=0.02, bits=2)
        e = torch.zeros(codec.padded); e[: x.numel()] = x
        message = codec.encode(e, codec.empty())   # e keeps what was not sent
        y = torch.zeros(codec.padded); codec.decode_add(message, y)
    """

    def __init__(
        self,
        numel: int,
        chunk: int = 4096,
        density: float = 0.02,
        topk: Optional[int] = None,
        bits: int = 2,
        device: torch.device = CPU,
        scratch: Optional[torch.Tensor] = None,
        scale_dtype: torch.dtype = torch.float32,
        schedule: Optional[str] = None,
    ) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}, got {bits!r}")
        if chunk < 1 or numel < 1:
            raise ValueError(f"chunk and numel must be positive integers, got chunk={chunk!r}, numel={numel!r}")
        if topk is None and not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if topk is not None and topk < 1:
            raise ValueError(f"topk must be a positive integer, got {topk!r}")
        if scale_dtype not in SCALE_DTYPES.values():
            raise ValueError(f"scale_dtype must be torch.float32 or torch.bfloat16, got {scale_dtype!r}")
        self.scale_dtype = scale_dtype
        self.numel, self.bits, self.device = numel, bits, torch.device(device)
        self.schedule = schedule_for(self.device, schedule)
        self.chunks, self.size = layout(numel, chunk)
        self.k = min(self.size, topk if topk is not None else max(1, round(density * self.size)))
        self.levels = 1 << bits
        self.half = (self.levels - 1) / 2
        self.index_dtype = index_dtype(self.size)
        count = self.chunks * self.k
        self.codes_count = -(-count // (8 // bits)) * (8 // bits)  # whole bytes of codes
        self._scales, self._indices, self._codes, self.nbytes = sections(
            self.chunks, self.k, self.size, bits, scale_dtype
        )
        self.block = max(1, min(self.chunks, BLOCK // self.size))
        # the chunks one pass of ``encode`` takes: a block of them, or all at once (whole)
        self._rows = self.chunks if self.schedule == WHOLE else self.block
        self._magnitudes: Optional[torch.Tensor] = None  # whole: a temporary per encode
        if self.schedule != WHOLE:
            if scratch is None:
                scratch = torch.empty(self.block * self.size, dtype=torch.float32, device=self.device)
            self._magnitudes = scratch[: self.block * self.size].view(self.block, self.size)
        self._codes_buffer = torch.zeros(self.codes_count, dtype=torch.uint8, device=self.device)

    @property
    def padded(self) -> int:
        """Values of a padded flat tensor in this layout: ``chunks * size``."""
        return self.chunks * self.size

    def empty(self, rows: Optional[int] = None) -> torch.Tensor:
        """A new message (``rows``: that many messages, ``[rows, nbytes]``)."""
        shape = (self.nbytes,) if rows is None else (rows, self.nbytes)
        return torch.zeros(shape, dtype=torch.uint8, device=self.device)

    def parts(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of one message: scales ``[chunks]`` (``scale_dtype``), indices ``[chunks, k]``, packed codes."""
        scales = message[self._scales].view(self.scale_dtype)
        indices = message[self._indices].view(self.index_dtype).view(self.chunks, self.k)
        return scales, indices, message[self._codes]

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Values of ``codes`` (``[c, k]``) in chunks of ``scales`` (``[c]``): new float32 ``[c, k]``."""
        return codes.float().sub_(self.half).mul_(scales[:, None])

    def encode(self, values: torch.Tensor, message: torch.Tensor, feedback: bool = True) -> torch.Tensor:
        """Top-k of ``values`` (flat float32, ``padded`` long) into ``message``; returns ``message``.

        With ``feedback`` what is sent (dequantized) is subtracted from ``values``, which keep the
        rest (error feedback): afterwards ``values + decode(message)`` is what ``values`` was.
        """
        grid = values.view(self.chunks, self.size)
        scales, indices, packed = self.parts(message)
        codes = self._codes_buffer[: self.chunks * self.k].view(self.chunks, self.k)
        for c0 in range(0, self.chunks, self._rows):
            rows = grid[c0 : c0 + self._rows]
            if self._magnitudes is None:
                magnitudes = torch.abs(rows)
            else:
                magnitudes = torch.abs(rows, out=self._magnitudes[: rows.shape[0]])
            top, where = torch.topk(magnitudes, self.k, dim=1, sorted=False)
            chosen = torch.gather(rows, 1, where)
            scale = torch.amax(top, dim=1).mul_(2 / (self.levels - 1))
            if self.scale_dtype != torch.float32:
                scale = scale.to(self.scale_dtype).float()  # quantize with the scale the ranks decode with
            inverse = torch.reciprocal(scale).nan_to_num_(0.0, 0.0, 0.0)  # scale 0 (or not finite): factor 0
            q = chosen.mul_(inverse[:, None]).add_(self.half).round_().clamp_(0, self.levels - 1)
            codes[c0 : c0 + rows.shape[0]].copy_(q)
            scales[c0 : c0 + rows.shape[0]].copy_(scale)
            indices[c0 : c0 + rows.shape[0]].copy_(where)
            if feedback:
                rows.scatter_add_(1, where, q.sub_(self.half).mul_(scale[:, None]).neg_())
        pack(self._codes_buffer, self.bits, packed)
        return message

    def decode_add(self, message: torch.Tensor, target: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``target += alpha * decode(message)`` (``target`` flat float32, ``padded`` long); returns it.

        One scatter-add with no repeated position (a chunk's indices differ): deterministic on
        every device, so ranks adding the same messages in the same order get the same bits.
        """
        scales, indices, packed = self.parts(message)
        codes = unpack(packed, self.bits)[: self.chunks * self.k].view(self.chunks, self.k)
        values = self.dequantize(codes, scales)
        if alpha != 1.0:
            values.mul_(alpha)
        target.view(self.chunks, self.size).scatter_add_(1, indices.long(), values)
        return target

    def count_add(self, message: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``counts += 1`` where ``message`` sends a nonzero value (``counts`` flat float32,
        ``padded`` long): a chunk of zeros (scale 0) sends zeros at places its ties chose, which count for nothing."""
        scales, indices, packed = self.parts(message)
        codes = unpack(packed, self.bits)[: self.chunks * self.k].view(self.chunks, self.k)
        sent = self.dequantize(codes, scales.float()) != 0
        counts.view(self.chunks, self.size).scatter_add_(1, indices.long(), sent.float())
        return counts

    def add_all(
        self, messages: torch.Tensor, target: torch.Tensor, alpha: float = 1.0, counts: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``decode_add(m, target, alpha)`` (and with ``counts``, ``count_add(m, counts)``) for each
        message of ``messages`` (``[W, nbytes]``), in their order: the same values and bits, with
        every message unpacked and dequantized at once and then one scatter-add a message (two
        with ``counts``), so the ops grow with ``W`` alone, not with the values. Returns ``target``."""
        rows, count = messages.shape[0], self.chunks * self.k
        scales = messages[:, self._scales].view(self.scale_dtype).float()
        indices = messages[:, self._indices].view(self.index_dtype).view(rows, self.chunks, self.k).long()
        codes = unpack(messages[:, self._codes].reshape(-1), self.bits).view(rows, -1)[:, :count]
        values = codes.view(rows, self.chunks, self.k).float().sub_(self.half).mul_(scales[..., None])
        sent = (values != 0).float() if counts is not None else None
        if alpha != 1.0:
            values.mul_(alpha)
        grid = target.view(self.chunks, self.size)
        for where, value in zip(indices.unbind(0), values.unbind(0)):
            grid.scatter_add_(1, where, value)
        if counts is not None and sent is not None:
            tally = counts.view(self.chunks, self.size)
            for where, nonzero in zip(indices.unbind(0), sent.unbind(0)):
                tally.scatter_add_(1, where, nonzero)
        return target

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The dense values ``message`` carries: new float32, ``numel`` long."""
        out = torch.zeros(self.padded, dtype=torch.float32, device=message.device)
        return self.decode_add(message, out)[: self.numel]
