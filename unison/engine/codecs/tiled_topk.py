"""SparseLoCo's (and DeMo's tiled) wire format: the top-k of each chunk of a ``Tiles`` layout, its
values in 2, 4 or 8 bits (or float32), and the mean of many messages (pure tensors, no communication).

Every message of a codec has the same size, so the ranks exchange them with one all-gather of
equal buffers. Two quantizers:

- ``"bins"`` (SparseLoCo's release, Templar): the values a run sends (one tensor's, or a
  shard's piece of one) are centred on their mean and cut into ``L = 2**bits`` bins of width
  ``6 sigma / L`` (codes ``round(v / width + L // 2)``, clamped); each code decodes to the mean
  of the values that fell into its bin, a table of ``L`` values per run that travels with the
  message. What is sent sums to what was chosen: one outlier costs its bin, not the chunk.
- ``"max"``: each chunk's values on ``L`` levels symmetric about zero, scaled by the chunk's
  largest magnitude (one scale per chunk on the wire).

With ``bits=32`` the values travel as float32 (no table, no scale): DeMo's paper sends them so.

Layout of one message (uint8, a multiple of 4 bytes): the tables (``[runs, L]``) or the scales
(``[chunks]``) in float32 (or bfloat16), then the indices (each chunk's positions: uint8 up to
256 values a chunk, 12 bits packed two to 3 bytes up to 4096, int16 up to 32768, else int32),
then the codes bit-packed ``8 // bits`` to a byte, low bits first (or the float32 values); each
section 4-byte aligned.

``mean_into`` decodes many messages into a dense target: the plain mean over the ranks, or, as the
references do, each coordinate's mean over the ranks that sent it (a sum and a count, added in
rank order: the same bits on every rank). A zero sent is not counted: a chunk of zeros sends
zeros at whatever places its ties fell on, and they must not dilute the others' values there.

See docs/algorithms.md#sparseloco.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from .tiles import Run
from .topk import pack, unpack

Quantizer = Literal["bins", "max"]
#: Values per block of the encode's and decode's loops (the decode's takes two: sums and counts).
BLOCK = 1 << 15
#: The bins' range, in standard deviations of the values sent (the references' 6: +-3 sigma).
SIGMAS = 6.0
CPU = torch.device("cpu")


def index_width(size: int) -> int:
    """Bits per index for chunks of ``size`` values: 8, 12, 16 or 32."""
    return 8 if size <= 1 << 8 else 12 if size <= 1 << 12 else 16 if size <= 1 << 15 else 32


def index_bytes(count: int, width: int) -> int:
    """Bytes of ``count`` indices of ``width`` bits (12 bits: two to 3 bytes)."""
    return 3 * -(-count // 2) if width == 12 else count * width // 8


def pack_indices(where: torch.Tensor, width: int, out: torch.Tensor) -> None:
    """Write ``where`` (flat integers, an even count for 12 bits) into ``out`` (uint8, ``index_bytes`` long)."""
    if width == 8:
        out.copy_(where)
    elif width == 12:
        a, b = where[0::2], where[1::2]
        out[0::3].copy_(a & 0xFF)
        out[1::3].copy_((a >> 8) | ((b & 0xF) << 4))
        out[2::3].copy_(b >> 4)
    else:
        out.view(torch.int16 if width == 16 else torch.int32).copy_(where)


def unpack_indices(packed: torch.Tensor, width: int, out: torch.Tensor) -> torch.Tensor:
    """The indices ``pack_indices`` wrote, into ``out`` (flat int64); returns ``out``."""
    if width == 8:
        out.copy_(packed)
    elif width == 12:
        b0, b1, b2 = (packed[j::3].long() for j in range(3))
        out[0::2].copy_(b0 | ((b1 & 0xF) << 8))
        out[1::2].copy_((b1 >> 4) | (b2 << 4))
    else:
        out.copy_(packed.view(torch.int16 if width == 16 else torch.int32))
    return out


def _aligned(n: int) -> int:
    return -(-n // 4) * 4


class TiledTopK:
    """Messages of the chunk-wise top-k of a buffer laid out in ``runs``.

    Args:
        runs: the runs of chunks (``Tiles.runs``, or ``Tiles.slice`` for a shard).
        bits: bits per value: 2, 4 or 8, or 32 (float32 values, no quantizer).
        quantizer: ``"bins"`` (a table per run) or ``"max"`` (a scale per chunk); unused with 32 bits.
        scale_dtype: the dtype of the tables or scales on the wire (float32 or bfloat16; what
            is sent is what every rank decodes with, the feedback included).
        device: the buffers' device.

    Example::

        tiles = Tiles([p.shape for p in params], "tiles", 64, density=1 / 64)
        codec = TiledTopK(tiles.runs)
        message = codec.encode(e, codec.empty())       # e keeps what was not sent
        codec.mean_into(torch.stack([message]), out)   # out += decode(message)
    """

    def __init__(
        self,
        runs: Sequence[Run],
        bits: int = 2,
        quantizer: Quantizer = "bins",
        scale_dtype: torch.dtype = torch.float32,
        device: torch.device = CPU,
    ) -> None:
        if not runs:
            raise ValueError("a codec needs at least one run of chunks")
        self.runs, self.bits, self.quantizer = list(runs), bits, quantizer
        self.scale_dtype, self.device = scale_dtype, torch.device(device)
        self.levels = 1 << bits
        self.half = (self.levels - 1) / 2
        self.numel = max(r.offset + r.numel for r in self.runs)
        self.count = sum(r.count for r in self.runs)
        self.chunks = sum(r.chunks for r in self.runs)
        # where each run's chunks start among all the chunks (the scales of quantizer="max")
        self._first_chunk = [sum(r.chunks for r in self.runs[:i]) for i in range(len(self.runs))]
        ks = {r.k for r in self.runs}
        self.k: Optional[int] = ks.pop() if len(ks) == 1 else None  # the entries per chunk, where all send alike
        self.width = index_width(max(r.size for r in self.runs))
        slots = self.count + (self.count % 2 if self.width == 12 else 0)  # 12 bits go in pairs
        self.raw = bits == 32  # float32 values: no codes, no heads
        per = 1 if self.raw else 8 // bits
        self.codes_count = -(-self.count // per) * per
        item = torch.empty((), dtype=scale_dtype).element_size()
        heads = 0 if self.raw else len(self.runs) * self.levels if quantizer == "bins" else self.chunks
        head_end = heads * item
        index_start = _aligned(head_end)
        index_end = index_start + index_bytes(slots, self.width)
        code_start = _aligned(index_end)
        code_end = code_start + self.codes_count * bits // 8
        self._heads, self._indices, self._codes = (
            slice(0, head_end),
            slice(index_start, index_end),
            slice(code_start, code_end),
        )
        self.nbytes = _aligned(code_end)
        # work buffers, allocated once: the chosen entries, their positions and codes
        self._chosen = torch.zeros(self.count, dtype=torch.float32, device=self.device)
        self._where = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self._codes_buffer = torch.zeros(0 if self.raw else self.codes_count, dtype=torch.uint8, device=self.device)
        self.block_numel = max(BLOCK, max(r.size for r in self.runs))
        self._scratch: Optional[torch.Tensor] = None

    def empty(self, rows: Optional[int] = None) -> torch.Tensor:
        """A new message (``rows``: that many, ``[rows, nbytes]``)."""
        shape = (self.nbytes,) if rows is None else (rows, self.nbytes)
        return torch.zeros(shape, dtype=torch.uint8, device=self.device)

    def share(self, scratch: torch.Tensor) -> None:
        """Work in ``scratch`` (float32, at least ``2 * block_numel``), shared by codecs run one at a time."""
        self._scratch = scratch

    def _block(self, which: int, rows: int, size: int) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty(2 * self.block_numel, dtype=torch.float32, device=self.device)
        base = which * self.block_numel
        return self._scratch[base : base + rows * size].view(rows, size)

    def heads(self, message: torch.Tensor) -> torch.Tensor:
        """The message's tables (``[runs, L]``) or scales (``[chunks]``); empty with 32 bits."""
        out = message[self._heads].view(self.scale_dtype)
        return out.view(len(self.runs), self.levels) if self.quantizer == "bins" and not self.raw else out

    def encode(self, values: torch.Tensor, message: torch.Tensor, feedback: bool = True) -> torch.Tensor:
        """The top-k of each chunk of ``values`` (flat float32, ``numel`` long) into ``message``;
        returns ``message``. With ``feedback`` what is sent (as decoded) is subtracted from
        ``values``, which keep the rest: afterwards ``values + decode(message)`` is what ``values`` was."""
        heads = self.heads(message)
        for i, run in enumerate(self.runs):
            grid = values[run.offset : run.offset + run.numel].view(run.chunks, run.size)
            chosen = self._chosen[run.first : run.first + run.count].view(run.chunks, run.k)
            where = self._where[run.first : run.first + run.count].view(run.chunks, run.k)
            per = max(1, min(run.chunks, self.block_numel // run.size))
            for c0 in range(0, run.chunks, per):
                rows = grid[c0 : c0 + per]
                magnitudes = torch.abs(rows, out=self._block(0, rows.shape[0], run.size))
                _, at = torch.topk(magnitudes, run.k, dim=1, sorted=False)
                where[c0 : c0 + per].copy_(at)
                torch.gather(rows, 1, at, out=chosen[c0 : c0 + per])
            if self.raw:
                if feedback:
                    grid.scatter_(1, where.long(), 0.0)
                continue
            codes = self._codes_buffer[run.first : run.first + run.count].view(run.chunks, run.k)
            if self.quantizer == "bins":
                table = self._bins(chosen, codes)
                heads[i].copy_(table)
                sent = table.to(self.scale_dtype).float()[codes.long()]
            else:
                first_chunk = self._first_chunk[i]
                scale = torch.amax(chosen.abs(), dim=1).mul_(2 / (self.levels - 1))
                if self.scale_dtype != torch.float32:
                    scale = scale.to(self.scale_dtype).float()  # quantize with the scale the ranks decode with
                inverse = torch.reciprocal(scale).nan_to_num_(0.0, 0.0, 0.0)  # scale 0 (or not finite): factor 0
                q = (chosen * inverse[:, None]).add_(self.half).round_().clamp_(0, self.levels - 1)
                codes.copy_(q)
                heads[first_chunk : first_chunk + run.chunks].copy_(scale)
                sent = q.sub_(self.half).mul_(scale[:, None])
            if feedback:
                grid.scatter_add_(1, where.long(), sent.neg_())
        pack_indices(self._where, self.width, message[self._indices])
        if self.raw:
            message[self._codes].view(torch.float32).copy_(self._chosen)
        else:
            pack(self._codes_buffer, self.bits, message[self._codes])
        return message

    def _bins(self, chosen: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Codes of ``chosen`` (a run's values) into ``codes``; returns the table of ``L`` values
        each code decodes to: the mean of the values in its bin (0 for an empty bin)."""
        values = chosen.reshape(-1)
        shift = values.mean()
        centred = values - shift
        n = values.numel()
        std = centred.norm() / (n - 1) ** 0.5 if n > 1 else torch.zeros((), device=values.device)
        width = std * (SIGMAS / self.levels)
        width = torch.where((width > 0) & torch.isfinite(width), width, torch.ones_like(width))
        q = centred.div(width).add_(self.levels // 2).round_().clamp_(0, self.levels - 1)
        codes.view(-1).copy_(q)
        where = q.long()
        sums = torch.zeros(self.levels, device=values.device).scatter_add_(0, where, centred)
        counts = torch.zeros(self.levels, device=values.device).scatter_add_(0, where, torch.ones_like(centred))
        return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums)) + shift

    def decode(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(where, values)``: each sent entry's position in its chunk (int64) and decoded value
        (float32), flat in the runs' order (``run.first`` on)."""
        slots = torch.empty(self._where.numel(), dtype=torch.int64, device=message.device)
        where = unpack_indices(message[self._indices], self.width, slots)[: self.count]
        if self.raw:
            return where, message[self._codes].view(torch.float32)
        codes = unpack(message[self._codes], self.bits)[: self.count]
        heads = self.heads(message).float()
        values = torch.empty(self.count, dtype=torch.float32, device=message.device)
        for i, run in enumerate(self.runs):
            q = codes[run.first : run.first + run.count]
            if self.quantizer == "bins":
                torch.index_select(heads[i], 0, q.long(), out=values[run.first : run.first + run.count])
            else:
                first_chunk = self._first_chunk[i]
                scale = heads[first_chunk : first_chunk + run.chunks]
                out = values[run.first : run.first + run.count].view(run.chunks, run.k)
                out.copy_(q.view(run.chunks, run.k)).sub_(self.half).mul_(scale[:, None])
        return where, values

    def mean_into(
        self, messages: torch.Tensor, target: torch.Tensor, alpha: float = 1.0, senders: bool = True
    ) -> torch.Tensor:
        """``target += alpha * mean`` of the ``[ranks, nbytes]`` ``messages`` (``target`` flat
        float32, ``numel`` long): with ``senders`` each coordinate's mean over the messages that
        sent it (the references' ``scatter_reduce(reduce="mean", include_self=False)``), else the
        plain mean over all of them. Added in message order: the same bits on every rank."""
        decoded = [self.decode(m) for m in messages]
        ranks = len(decoded)
        for run in self.runs:
            grid = target[run.offset : run.offset + run.numel].view(run.chunks, run.size)
            entries = slice(run.first, run.first + run.count)
            if not senders:
                for where, values in decoded:
                    w = where[entries].view(run.chunks, run.k)
                    grid.scatter_add_(1, w, values[entries].view(run.chunks, run.k) * (alpha / ranks))
                continue
            per = max(1, min(run.chunks, self.block_numel // run.size))
            for c0 in range(0, run.chunks, per):
                rows = grid[c0 : c0 + per]
                total = self._block(0, rows.shape[0], run.size).zero_()
                count = self._block(1, rows.shape[0], run.size).zero_()
                for where, values in decoded:
                    w = where[entries].view(run.chunks, run.k)[c0 : c0 + per]
                    v = values[entries].view(run.chunks, run.k)[c0 : c0 + per]
                    total.scatter_add_(1, w, v)
                    count.scatter_add_(1, w, (v != 0).float())  # a chunk of zeros sends zeros wherever its ties fell
                rows.add_(total.div_(count.clamp_(min=1)), alpha=alpha)
        return target
