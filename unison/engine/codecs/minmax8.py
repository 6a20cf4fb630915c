"""Wire codecs: flat tensors turned into fewer bytes and back, with no communication.

8-bit min-max, the one 8-bit wire format of unison ("bytegrad", "qadam",
"low_precision_decentralized"): values are cut into equal chunks and each chunk
is mapped linearly from its own [min, max] onto the integers 0..255. A chunk
costs one byte per value plus 8 bytes of side data (its float32 min and
scale), and decodes to within half a quantization step (``scale / 2``) of the
input. A constant chunk has scale 0 and decodes exactly. A chunk holding inf
or NaN decodes to NaN, so overflow checks (AMP's grad scaler) still see it.

``encode_`` / ``decode_`` are the arithmetic; ``MinMax8`` is the packed layout
with reusable buffers that the algorithms send (tests/unit/codecs/codec_reference.py
holds the same arithmetic as plain allocating functions, for the tests).

``MinMax8`` has two schedules of the same arithmetic (``schedule.py``). The
blocked one (the CPU's) works block by block (``BLOCK`` values): every
elementwise pass of a block runs in the core's L2 cache, so a codec costs about
one trip through memory instead of one per operation (several times faster on
CPU), and needs no buffer of the input's size. The whole one (every other
device's) runs each method as a fixed number of ops on whole buffers (the real
values as one strided view, the padding as one small piece), so a GPU launches
as many kernels for 64M values as for 4M; it makes work buffers of the input's
size while it runs. Both give the same bytes and values, bit for bit.
"""

from __future__ import annotations

import copy
from typing import Callable, Optional

import torch

from .schedule import WHOLE, schedule_for

#: The largest 8-bit code: a chunk's max maps to it, its min to 0.
LEVELS = 255
#: Side data per chunk: a float32 min and a float32 scale.
SIDE_BYTES = 8
CPU = torch.device("cpu")

#: Values per block of MinMax8's blocked loops: a block and its scratch fit a core's L2 cache.
BLOCK = 1 << 18


def encode_(
    values: torch.Tensor,
    mins: torch.Tensor,
    scales: torch.Tensor,
    codes: torch.Tensor,
    scratch: Optional[torch.Tensor] = None,
    work: Optional[torch.Tensor] = None,
) -> None:
    """Quantize ``values`` (float32 ``[..., chunks, size]``) chunk by chunk.

    Writes each chunk's min and step ``(max - min) / 255`` into ``mins`` and
    ``scales`` (float32 ``[..., chunks]``) and the codes ``(x - min) / scale``
    rounded to nearest into ``codes`` (uint8, shaped like ``values``). A
    constant chunk gets code 0 everywhere. ``scratch`` (float32
    ``[2, ..., chunks]``) avoids allocating the per-chunk factors; ``work``
    (shaped like ``values``) is overwritten instead of ``values``.
    """
    torch.amin(values, dim=-1, out=mins)
    torch.amax(values, dim=-1, out=scales)
    scales.sub_(mins).div_(LEVELS)
    if scratch is None:
        scratch = values.new_empty((2, *mins.shape))
    inverse, shift = scratch[0], scratch[1]
    torch.reciprocal(scales, out=inverse).nan_to_num_(0.0, 0.0, 0.0)  # scale 0 (or non-finite): factor 0
    torch.mul(mins, inverse, out=shift).neg_().add_(0.5)
    # Separate same-dtype in-place steps: mixed-dtype fused ones are several times slower on CPU.
    work = torch.mul(values, inverse[..., None], out=values if work is None else work)
    work.add_(shift[..., None]).clamp_(0, LEVELS)
    # Truncation of x + 0.5: rounding to nearest. Through int32 in place (the same bytes):
    # float32 -> int32 -> uint8 is over twice as fast as float32 -> uint8 on CPU.
    whole = work.view(torch.int32) if work.is_contiguous() else None
    codes.copy_(whole.copy_(work) if whole is not None else work)


def decode_(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = codes * scale + min`` chunk by chunk (``out`` float32, shaped like ``codes``); returns ``out``."""
    out.copy_(codes)
    return out.mul_(scales[..., None]).add_(mins[..., None])


def block_chunks(chunks: int, size: int) -> int:
    """Chunks per block of ``MinMax8``'s blocked loops (``BLOCK`` values at most, one chunk at least)."""
    return max(1, min(chunks, BLOCK // size))


def work_numel(numel: int, rows: int = 1, chunk_size: int = 1024) -> int:
    """The float32 values ``MinMax8(numel, rows, chunk_size)`` asks of a shared ``scratch``."""
    chunks, size, _ = layout(numel, rows, chunk_size)
    return 2 * block_chunks(chunks, size) * size


def layout(numel: int, rows: int, chunk_size: int) -> tuple[int, int, int]:
    """``MinMax8``'s layout: (chunks per row, values per chunk, bytes per packed row)."""
    per_row = -(-numel // rows)
    chunks = max(1, -(-per_row // chunk_size))
    size = max(1, -(-per_row // chunks))
    return chunks, size, -(-(SIDE_BYTES * chunks + chunks * size) // 4) * 4


class MinMax8:
    """The packed 8-bit layout of ``numel`` values cut into ``rows`` rows, with reusable buffers.

    Args:
        numel: values in all (a flat buffer's length).
        rows: equal parts, each packed as its own row (one per rank for an all_to_all).
        chunk_size: at most this many values per chunk.
        device: where the buffers live.
        scratch: ``scratch(n)`` gives a float32 buffer of at least ``n`` values for the blocked
            loops' work, shared by codecs that run one at a time (default: its own).
        schedule: ``"blocked"`` or ``"whole"`` (default: ``schedule_for(device)``: blocked on
            the CPU, whole elsewhere). The same bytes either way.

    A packed row is one uint8 tensor: the chunks' float32 mins, their scales,
    then one code per value, padded to a multiple of 4 bytes (so the side data
    is read as float32 without a copy). The values are padded up to
    ``rows * chunks * size`` by repeating the last one, which keeps the last
    chunk's range what the real values give.

    Example::

        codec = MinMax8(x.numel(), chunk_size=1024)
        message = codec.empty()
        codec.encode(codec.load(x), message)
        y = codec.decode(message)[: x.numel()]
    """

    def __init__(
        self,
        numel: int,
        rows: int = 1,
        chunk_size: int = 1024,
        device: torch.device = CPU,
        scratch: Optional[Callable[[int], torch.Tensor]] = None,
        schedule: Optional[str] = None,
    ) -> None:
        self.numel, self.rows = numel, rows
        self.chunks, self.size, self.row_bytes = layout(numel, rows, chunk_size)
        self.side = SIDE_BYTES * self.chunks
        self.device = torch.device(device)
        self.forced = schedule
        self.schedule = schedule_for(self.device, schedule)
        # Where this codec's values lie in the flat buffer: row r, chunk c at (r * stride + (first + c) * size).
        self._stride, self._first = self.chunks * self.size, 0
        self._other_work: Optional[torch.Tensor] = None  # decode_add's blocked work on another device
        self._values: Optional[torch.Tensor] = None
        self._scratch = torch.empty(2, rows, self.chunks, dtype=torch.float32, device=device)
        block = block_chunks(self.chunks, self.size)
        shape = (2, block, self.size)
        if scratch is None:
            self._work = torch.empty(shape, dtype=torch.float32, device=device)
        else:  # shared by codecs run one at a time
            self._work = scratch(2 * block * self.size)[: 2 * block * self.size].view(shape)
        # (row, first chunk, chunks, first value, real values) of each block, in order.
        self._blocks = []
        for row in range(rows):
            for c0 in range(0, self.chunks, block):
                c = min(block, self.chunks - c0)
                start = (row * self.chunks + c0) * self.size
                self._blocks.append((row, c0, c, start, max(0, min(c * self.size, numel - start))))

    @property
    def values(self) -> torch.Tensor:
        """The full value buffer (``[rows, chunks, size]`` float32) of ``load`` and ``decode``, made on first use."""
        if self._values is None:
            self._values = torch.empty(self.rows, self.chunks, self.size, dtype=torch.float32, device=self.device)
        return self._values

    @property
    def flat(self) -> torch.Tensor:
        return self.values.view(-1)

    @property
    def nbytes(self) -> int:
        """Bytes of one message of all the rows."""
        return self.rows * self.row_bytes

    def empty(self, rows: Optional[int] = None) -> torch.Tensor:
        """A new message buffer of ``rows`` packed rows (default all)."""
        return torch.empty(self.rows if rows is None else rows, self.row_bytes, dtype=torch.uint8, device=self.device)

    def load(self, x: torch.Tensor, minus: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copy ``x`` (or ``x - minus``) into the value buffer, padded; returns it (``[rows, chunks, size]``)."""
        n, flat = self.numel, self.flat
        if minus is None:
            flat[:n].copy_(x)
        else:
            subtract_into(flat[:n], x, minus)
        flat[n:].fill_(flat[n - 1])
        return self.values

    def parts(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of packed rows: mins and scales (``[r, chunks]``) and codes (``[r, chunks, size]``)."""
        side = packed[:, : self.side].view(torch.float32).unflatten(-1, (2, self.chunks))
        codes = packed[:, self.side : self.side + self.chunks * self.size].unflatten(-1, (self.chunks, self.size))
        return side[:, 0], side[:, 1], codes

    def encode(self, values: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Quantize ``values`` (``[r, chunks, size]``, overwritten) into ``packed`` (``r`` rows); returns ``packed``."""
        mins, scales, codes = self.parts(packed)
        encode_(values, mins, scales, codes, self._scratch[:, : packed.shape[0]])
        return packed

    def decode(self, packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values ``packed`` carries, into ``out`` (default: the value buffer), ``[r, chunks, size]``."""
        mins, scales, codes = self.parts(packed)
        return decode_(codes, mins, scales, self.values[: packed.shape[0]] if out is None else out)

    def _block(
        self, x: torch.Tensor, block: tuple[int, int, int, int, int], work: torch.Tensor, pad: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """One block of the flat ``x`` as ``[c, size]``: a view if it is whole float32 values, else
        copied into ``work`` and padded with ``pad``. Also whether it is a view."""
        _, _, c, start, real = block
        if real == c * self.size and x.dtype == torch.float32:
            return x[start : start + real].view(c, self.size), True
        w = work[:c].view(-1)
        w[:real].copy_(x[start : start + real])
        w[real:].fill_(pad)
        return w.view(c, self.size), False

    def encode_from(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        feedback: Optional[torch.Tensor] = None,
        pad: Optional[torch.Tensor] = None,
        minus: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Quantize the flat ``x`` (``numel`` values, any float dtype) into ``packed`` (all rows); returns ``packed``.

        With ``feedback`` (flat, like ``x``): ``x + feedback`` is quantized,
        and ``feedback`` becomes what quantization lost (error feedback).
        With ``minus`` (flat, like ``x``, on any device): ``x - minus`` is quantized, block by
        block, the same codes as ``encode(load(x, minus=minus))`` without a buffer of ``x``'s size.
        ``pad`` (default ``pad_value(x, feedback)`` now) fills the padding.
        """
        mins, scales, codes = self.parts(packed)
        if self.schedule == WHOLE:
            self._encode_whole(x, mins, scales, codes, feedback, pad, minus)
            return packed
        if minus is not None:
            self._encode_difference(x, minus, mins, scales, codes)
            return packed
        if pad is None:
            pad = self.pad_value(x, feedback)
        source = x if feedback is None else feedback
        for block in self._blocks:
            row, c0, c, start, real = block
            if feedback is not None:
                torch.add(x[start : start + real], feedback[start : start + real], out=feedback[start : start + real])
            values, is_view = self._block(source, block, self._work[0], pad)
            out = (mins[row, c0 : c0 + c], scales[row, c0 : c0 + c], codes[row, c0 : c0 + c])
            encode_(values, *out, self._scratch[:, row, c0 : c0 + c], self._work[0, :c] if is_view else None)
            if feedback is not None:
                lost = decode_(out[2], out[0], out[1], self._work[1, :c]).view(-1)
                feedback[start : start + real].sub_(lost[:real])
        return packed

    def _encode_difference(
        self, x: torch.Tensor, minus: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor
    ) -> torch.Tensor:
        """``encode_from``'s ``x - minus``: each block's difference made in the work buffer (as ``load``
        makes it: in float32, or in ``minus``'s precision rounded to float32), padded with the last."""
        n = self.numel
        if n == 0:
            return codes
        pad = difference(x[n - 1 : n], minus[n - 1 : n].to(x.device))[0]
        for row, c0, c, start, real in self._blocks:
            w = self._work[0, :c].view(-1)
            a, b = x[start : start + real], to_device(minus[start : start + real], x.device)
            subtract_into(w[:real], a, b)
            w[real:].fill_(pad)
            out = (mins[row, c0 : c0 + c], scales[row, c0 : c0 + c], codes[row, c0 : c0 + c])
            encode_(w.view(c, self.size), *out, self._scratch[:, row, c0 : c0 + c])
        return codes

    def decode_add(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add the values ``packed`` (all rows) carries to the flat ``out`` (``numel`` values, any float
        dtype, on any device): ``out += decode(packed)``.

        It decodes where ``out`` lives, in the schedule of that device: ``packed`` (one byte a
        value) is copied there first, a blocking copy, so host memory is never read before a
        device's copy into it has landed. The blocked schedule needs no buffer of ``out``'s size.
        """
        if packed.device != out.device:
            packed = packed.to(out.device)
        mins, scales, codes = self.parts(packed)
        if schedule_for(out.device, self.forced) == WHOLE:
            values = self._decode_whole(mins, scales, codes)
            for dst, src in zip(self._regions(out), self._regions_of_values(values)):
                dst.add_(src)
            return out
        work = self._work if out.device == self._work.device else self._work_on(out.device)
        for row, c0, c, start, real in self._blocks:
            w = work[0, :c]
            decode_(codes[row, c0 : c0 + c], mins[row, c0 : c0 + c], scales[row, c0 : c0 + c], w)
            out[start : start + real].add_(w.view(-1)[:real])
        return out

    def _work_on(self, device: torch.device) -> torch.Tensor:
        """A blocked work buffer like the codec's on ``device`` (made on first use, then kept)."""
        if self._other_work is None or self._other_work.device != device:
            self._other_work = torch.empty(self._work.shape, dtype=torch.float32, device=device)
        return self._other_work

    # ---- the whole schedule ------------------------------------------------
    def _extent(self) -> tuple[int, int, int]:
        """``(k, at, m)``: rows ``0..k-1`` of this codec hold only real values; row ``k`` (when
        ``k < rows``) holds ``m`` real ones, from flat index ``at``; the rest is padding."""
        n, width, first = self.numel, self.chunks * self.size, self._first * self.size
        k = min(self.rows, (n - first - width) // self._stride + 1) if n >= first + width else 0
        at = k * self._stride + first
        return k, at, max(0, min(width, n - at)) if k < self.rows else 0

    def _regions(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of this codec's real values in the flat ``flat``: its whole rows (``[k, chunks * size]``,
        strided) and the real values of the next row (``[m]``)."""
        k, at, m = self._extent()
        width, first = self.chunks * self.size, self._first * self.size
        return flat[first:].as_strided((k, width), (self._stride, 1)), flat[at : at + m]

    def _regions_of_values(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same regions in a ``[rows, chunks, size]`` value buffer of this codec."""
        k, _, m = self._extent()
        width = self.chunks * self.size
        return values.view(self.rows, width)[:k], values.view(-1)[k * width : k * width + m]

    def _gather(self, regions: tuple[torch.Tensor, torch.Tensor], pad: torch.Tensor) -> torch.Tensor:
        """A new float32 value buffer (``[rows, chunks, size]``) of the real values ``regions`` views,
        padded with ``pad`` (a 0-d tensor)."""
        full, tail = regions
        values = torch.empty(self.rows, self.chunks, self.size, dtype=torch.float32, device=full.device)
        k, width = full.shape[0], self.chunks * self.size
        flat = values.view(-1)
        flat[k * width :].fill_(pad)
        dst_full, dst_tail = self._regions_of_values(values)
        dst_full.copy_(full)
        dst_tail.copy_(tail)
        return values

    def _encode_whole(
        self,
        x: torch.Tensor,
        mins: torch.Tensor,
        scales: torch.Tensor,
        codes: torch.Tensor,
        feedback: Optional[torch.Tensor],
        pad: Optional[torch.Tensor],
        minus: Optional[torch.Tensor],
    ) -> None:
        """``encode_from`` in a fixed number of ops on whole buffers: the blocked loop's arithmetic."""
        scratch = self._scratch[:, : self.rows]
        if minus is not None:
            n = self.numel
            if n == 0:
                return
            minus = to_device(minus, x.device)  # one copy when offloaded, ordered on the stream
            pad = difference(x[n - 1 : n], minus[n - 1 : n])[0]
            values = torch.empty(self.rows, self.chunks, self.size, dtype=torch.float32, device=x.device)
            values.view(-1)[self._extent()[0] * self.chunks * self.size :].fill_(pad)
            for dst, a, b in zip(self._regions_of_values(values), self._regions(x), self._regions(minus)):
                subtract_into(dst, a, b)
            encode_(values, mins, scales, codes, scratch)
            return
        if pad is None:
            pad = self.pad_value(x, feedback)
        if feedback is None:
            encode_(self._gather(self._regions(x), pad), mins, scales, codes, scratch)
            return
        kept = self._regions(feedback)
        for a, f in zip(self._regions(x), kept):
            torch.add(a, f, out=f)
        values = self._gather(kept, pad)
        encode_(values, mins, scales, codes, scratch)
        lost = decode_(codes, mins, scales, values)
        for f, d in zip(kept, self._regions_of_values(lost)):
            f.sub_(d)

    def _decode_whole(self, mins: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """A new float32 value buffer (``[rows, chunks, size]``) of the values the packed rows carry."""
        values = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        return decode_(codes, mins, scales, values)

    def pad_value(self, x: torch.Tensor, feedback: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What ``encode_from`` pads with: the last value it quantizes (a 0-d tensor, a copy)."""
        n = self.numel
        if n == 0:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        return x[n - 1].clone() if feedback is None else x[n - 1] + feedback[n - 1]

    def split(self, parts: int) -> list["MinMax8"]:
        """This codec cut into at most ``parts`` codecs, each of consecutive whole blocks of every row.

        A part quantizes the same chunks of the same values as this codec, so
        it encodes, sums and decodes them bit for bit as this codec does, into
        its own packed layout (``rows`` rows of its chunks). Its ``encode_from``
        / ``sum_encode`` / ``decode_into`` take the whole flat buffer and touch
        only its chunks (pass every part the same ``pad``: ``pad_value`` taken
        before the first). The parts share this codec's scratch: run them one at a time.
        """
        per_row = len(self._blocks) // self.rows
        step = -(-per_row // max(1, min(parts, per_row)))
        out = []
        for b0 in range(0, per_row, step):
            blocks = [
                self._blocks[r * per_row + b] for r in range(self.rows) for b in range(b0, min(b0 + step, per_row))
            ]
            c0, chunks = blocks[0][1], sum(b[2] for b in blocks) // self.rows
            part = copy.copy(self)
            part.chunks, part.side, part._values = chunks, SIDE_BYTES * chunks, None
            part.row_bytes = -(-(SIDE_BYTES * chunks + chunks * self.size) // 4) * 4
            part._scratch = self._scratch[:, :, c0 : c0 + chunks]
            part._first, part._other_work = self._first + c0, None
            part._blocks = [(r, bc0 - c0, c, start, real) for r, bc0, c, start, real in blocks]
            out.append(part)
        return out

    def decode_into(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode ``packed`` (all rows) into the flat ``out`` (``numel`` values, any float dtype); returns ``out``."""
        mins, scales, codes = self.parts(packed)
        if self.schedule == WHOLE:
            values = self._decode_whole(mins, scales, codes)
            for dst, src in zip(self._regions(out), self._regions_of_values(values)):
                dst.copy_(src)
            return out
        for row, c0, c, start, real in self._blocks:
            whole = real == c * self.size and out.dtype == torch.float32
            dst = out[start : start + real].view(c, self.size) if whole else self._work[0, :c]
            decode_(codes[row, c0 : c0 + c], mins[row, c0 : c0 + c], scales[row, c0 : c0 + c], dst)
            if not whole:
                out[start : start + real].copy_(dst.view(-1)[:real])
        return out

    def sum_encode(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Quantize the sum of the rows ``packed`` carries (each one row's layout) into the one-row ``out``."""
        mins, scales, codes = self.parts(packed)
        out_mins, out_scales, out_codes = self.parts(out)
        if self.schedule == WHOLE:  # the rows added in order, as the blocked loop adds them
            decoded = self._decode_whole(mins, scales, codes)
            total = decoded[0]
            for r in range(1, packed.shape[0]):
                total.add_(decoded[r])
            encode_(total, out_mins[0], out_scales[0], out_codes[0], self._scratch[:, 0])
            return out
        acc, term = self._work[0], self._work[1]
        for _, c0, c, _, _ in self._blocks[: len(self._blocks) // self.rows]:
            part = slice(c0, c0 + c)
            decode_(codes[0, part], mins[0, part], scales[0, part], acc[:c])
            for r in range(1, packed.shape[0]):
                acc[:c].add_(decode_(codes[r, part], mins[r, part], scales[r, part], term[:c]))
            encode_(acc[:c], out_mins[0, part], out_scales[0, part], out_codes[0, part], self._scratch[:, 0, part])
        return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a non-blocking copy onto an accelerator (ordered on its stream before
    the kernels that read it), a blocking one onto the CPU (the host reads it at once)."""
    return t.to(device, non_blocking=torch.device(device).type != "cpu")


def subtract_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a - b`` (``out`` float32), as every path of ``MinMax8`` makes a difference: in float32,
    or ``a`` widened to float32 and ``b`` subtracted in ``b``'s precision when wider; returns ``out``."""
    if a.dtype == b.dtype == torch.float32:
        return torch.sub(a, b, out=out)
    return out.copy_(a).sub_(b)


def difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` as ``subtract_into`` makes it, in a new float32 tensor (never ``a`` itself)."""
    return subtract_into(torch.empty(a.shape, dtype=torch.float32, device=a.device), a, b)
