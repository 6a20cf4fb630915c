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

Two schedules (``engine.codecs.schedule``): ``"blocked"`` loops over the runs and cache-sized
blocks of their chunks (the CPU's); ``"whole"`` issues a fixed number of ops whatever the
values' count (GPUs, ``meta``): one ``topk`` per group of runs of one chunk size and ``k``
(``Plan``), the quantizers' per-run and per-chunk statistics as segment sums over all entries at
once (``index_add`` by a run id per entry), the bit packing as arithmetic on whole buffers, and
``mean_into`` one ``index_add_`` per message. The same values as the blocked schedule, bit for bit,
but for the bins' mean and deviation: sums in another order, so the bins' edges may move by a few
ulps (tests/unit/codecs/test_topk_schedules.py states the tolerance).

``mean_into`` decodes many messages into a dense target: the plain mean over the ranks, or, as the
references do, each coordinate's mean over the ranks that sent it (a sum and a count, added in
rank order: the same bits on every rank). A zero sent is not counted: a chunk of zeros sends
zeros at whatever places its ties fell on, and they must not dilute the others' values there.

See docs/algorithms.md#sparseloco.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from .schedule import WHOLE, schedule_for
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
        schedule: ``"blocked"`` or ``"whole"`` (``engine.codecs.schedule``); default
            ``schedule_for(device)``: blocked on the CPU, whole elsewhere.

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
        schedule: Optional[str] = None,
    ) -> None:
        if not runs:
            raise ValueError("a codec needs at least one run of chunks")
        self.runs, self.bits, self.quantizer = list(runs), bits, quantizer
        self.scale_dtype, self.device = scale_dtype, torch.device(device)
        self.schedule = schedule_for(self.device, schedule)
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
        self.slots = slots = self.count + (self.count % 2 if self.width == 12 else 0)  # 12 bits go in pairs
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
        # the blocked schedule's work buffers, allocated once: the chosen entries, their positions and codes
        blocked = self.schedule != WHOLE
        self._chosen = torch.zeros(self.count if blocked else 0, dtype=torch.float32, device=self.device)
        self._where = torch.zeros(slots if blocked else 0, dtype=torch.int32, device=self.device)
        codes = 0 if self.raw or not blocked else self.codes_count
        self._codes_buffer = torch.zeros(codes, dtype=torch.uint8, device=self.device)
        self.block_numel = max(BLOCK, max(r.size for r in self.runs))
        self._scratch: Optional[torch.Tensor] = None
        self._entry_run: Optional[torch.Tensor] = None  # built by the first clipped mean
        self._plan = Plan(self) if self.schedule == WHOLE else None

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
        if self._plan is not None:
            return self._plan.encode(values, message, feedback)
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
        if self._plan is not None:
            where, values = self._plan.decode(message[None])
            return where[0], values[0]
        slots = torch.empty(self.slots, dtype=torch.int64, device=message.device)
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

    @property
    def entry_run(self) -> torch.Tensor:
        """Each entry's run (its tensor under the ``"tiles"`` cut), on the codec's device: what
        ``clip`` takes norms by. Built at the first use (int64, one per entry sent: only a clipped
        mean pays for it)."""
        if self._entry_run is None:
            counts = torch.tensor([r.count for r in self.runs], dtype=torch.int64)
            self._entry_run = torch.repeat_interleave(torch.arange(len(self.runs)), counts).to(self.device)
        return self._entry_run

    def mean_into(
        self, messages: torch.Tensor, target: torch.Tensor, alpha: float = 1.0, senders: bool = True, clip: bool = False
    ) -> torch.Tensor:
        """``target += alpha * mean`` of the ``[ranks, nbytes]`` ``messages`` (``target`` flat
        float32, ``numel`` long): with ``senders`` each coordinate's mean over the messages that
        sent it (the references' ``scatter_reduce(reduce="mean", include_self=False)``), else the
        plain mean over all of them. Added in message order: the same bits on every rank.

        ``clip`` (Templar's): each message's decoded values of a run (a tensor, under the
        ``"tiles"`` cut) are first scaled by ``min(1, median / norm)``, ``norm`` their L2 norm and
        ``median`` the median of the messages' norms of that run (the lower of the two middle ones
        for an even number): no message weighs more than the median one."""
        if self._plan is not None:
            return self._plan.mean_into(messages, target, alpha, senders, clip)
        decoded = [self.decode(m) for m in messages]
        if clip:
            clipped = clip_to_median(torch.stack([v for _, v in decoded]), self.entry_run, len(self.runs))
            decoded = [(where, values) for (where, _), values in zip(decoded, clipped.unbind(0))]
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


class Plan:
    """The whole schedule of a ``TiledTopK``: its index tensors, built once on the codec's device,
    and its encode, decode and mean, each a fixed number of ops on whole buffers.

    The runs are grouped by ``(size, k)``: one ``topk`` takes every chunk of a group (a view of
    the buffer where the group's runs lie end to end, else its rows gathered by their starts).
    The chosen entries are then in the message's order (run by run, chunk by chunk) and every
    statistic is a segment op over all of them: ``run`` (the run of each entry), ``chunk``
    (its chunk among all), ``start`` (its chunk's offset in the buffer).
    """

    def __init__(self, codec: TiledTopK) -> None:
        self.codec = codec
        runs, device, levels = codec.runs, codec.device, codec.levels
        self.groups: list[tuple[int, int, int, int, Optional[torch.Tensor]]] = []  # size, k, offset, chunks, starts
        keys: list[tuple[int, int]] = []
        for r in runs:
            if (r.size, r.k) not in keys:
                keys.append((r.size, r.k))
        order: list[torch.Tensor] = []  # each group's entries, by their place in the message
        for size, k in keys:
            members = [r for r in runs if (r.size, r.k) == (size, k)]
            adjacent = all(b.offset == a.offset + a.numel for a, b in zip(members, members[1:]))
            chunks = sum(r.chunks for r in members)
            starts = None if adjacent else torch.cat([r.offset + size * torch.arange(r.chunks) for r in members])
            self.groups.append((size, k, members[0].offset, chunks, starts if starts is None else starts.to(device)))
            order.extend(torch.arange(r.first, r.first + r.count) for r in members)
        placed = torch.cat(order)  # the message's entry at each place of the groups' concatenation
        self.perm: Optional[torch.Tensor] = None
        if not torch.equal(placed, torch.arange(codec.count)):
            self.perm = torch.empty_like(placed).scatter_(0, placed, torch.arange(codec.count)).to(device)
        entries = [torch.arange(r.count) // r.k for r in runs]  # each entry's chunk in its run
        self.start = torch.cat([r.offset + r.size * e for r, e in zip(runs, entries)]).to(device)
        bins = not codec.raw and codec.quantizer == "bins"
        levels = levels if bins else 0  # no tables: no bins
        counts = torch.tensor([r.count for r in runs])
        run = torch.repeat_interleave(torch.arange(len(runs)), counts) if bins else torch.zeros(0, dtype=torch.int64)
        self.run = run.to(device)
        self.run_bins = (run * levels).to(device)  # the first of the entry's run's bins in the tables
        self.bin_run = torch.arange(len(runs)).repeat_interleave(levels).to(device)
        self.n = counts.float().to(device)
        self.root = torch.tensor([(c - 1) ** 0.5 if c > 1 else 1.0 for c in counts.tolist()]).to(device)
        self.ones = torch.ones(1, device=device).expand(codec.count)
        self.zero_runs = torch.zeros(len(runs), device=device)
        self.zero_bins = torch.zeros(len(runs) * levels, device=device)
        scales = not codec.raw and codec.quantizer == "max"
        chunk = torch.cat([f + e for f, e in zip(codec._first_chunk, entries)]) if scales else entries[0][:0]
        self.chunk = chunk.to(device)
        self.zero_chunks = torch.zeros(codec.chunks if scales else 0, device=device)
        per = 1 if codec.raw else 8 // codec.bits
        self.weights = torch.tensor([float(1 << (codec.bits * j)) for j in range(per)], device=device)
        self.shifts = torch.tensor([codec.bits * j for j in range(per)], dtype=torch.uint8, device=device)
        self.code_pad = torch.zeros(codec.codes_count - codec.count, device=device)
        self.index_pad = torch.zeros(codec.slots - codec.count, dtype=torch.int64, device=device)
        self.pairs = torch.tensor([1, 1 << 12], device=device)  # two 12-bit indices in 24 bits
        self.triples = torch.tensor([1, 1 << 8, 1 << 16], device=device)
        self.bytes = torch.tensor([0, 8, 16], device=device)
        self.halves = torch.tensor([0, 12], device=device)

    def encode(self, values: torch.Tensor, message: torch.Tensor, feedback: bool) -> torch.Tensor:
        """``TiledTopK.encode`` on whole buffers."""
        codec = self.codec
        magnitudes = torch.abs(values if values.numel() == codec.numel else values[: codec.numel])
        found = []
        for size, k, offset, chunks, starts in self.groups:
            if starts is None:  # the group's runs lie end to end
                rows = magnitudes.as_strided((chunks, size), (size, 1), offset)
            else:  # every window of ``size`` values, of which the rows at ``starts``
                rows = magnitudes.as_strided((codec.numel - size + 1, size), (1, 1)).index_select(0, starts)
            found.append(torch.topk(rows, k, dim=1, sorted=False)[1].view(-1))
        where = torch.cat(found) if len(found) > 1 else found[0]
        if self.perm is not None:
            where = where.index_select(0, self.perm)
        at = where + self.start  # each entry's place in the buffer
        chosen = values.take(at)
        if codec.raw:
            if feedback:
                values.index_fill_(0, at, 0.0)
            message[codec._codes].view(torch.float32).copy_(chosen)
        else:
            heads = message[codec._heads].view(codec.scale_dtype)
            if codec.quantizer == "bins":
                q, table, bins = self.bins(chosen)
                heads.copy_(table)
                sent = table.to(codec.scale_dtype).float().take(bins)
            else:
                q, scale = self.max(chosen)
                heads.copy_(scale)
                sent = (q - codec.half).mul_(scale.index_select(0, self.chunk))
            if feedback:
                values.index_add_(0, at, sent, alpha=-1)
            self.pack(q, message[codec._codes])
        self.pack_indices(where, message[codec._indices])
        return message

    def bins(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``TiledTopK._bins`` of every run at once: the codes (float), the tables (flat
        ``[runs * L]``) and each entry's place in them."""
        levels = self.codec.levels
        shift = self.zero_runs.index_add(0, self.run, chosen).div_(self.n)
        centred = chosen - shift.index_select(0, self.run)
        square = self.zero_runs.index_add(0, self.run, centred * centred)
        width = square.sqrt_().div_(self.root).mul_(SIGMAS / levels).nan_to_num_(1.0, 1.0, 1.0)
        width.masked_fill_(width <= 0, 1.0)
        q = centred.div(width.index_select(0, self.run)).add_(levels // 2).round_().clamp_(0, levels - 1)
        bins = q.long().add_(self.run_bins)
        sums = self.zero_bins.index_add(0, bins, centred)
        counts = self.zero_bins.index_add(0, bins, self.ones)
        return q, sums.div_(counts.clamp_(min=1)).add_(shift.index_select(0, self.bin_run)), bins

    def max(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (float) and the chunks' scales (float32, as the ranks decode them) of ``quantizer="max"``."""
        codec = self.codec
        scale = self.zero_chunks.scatter_reduce(0, self.chunk, chosen.abs(), "amax", include_self=False)
        scale.mul_(2 / (codec.levels - 1))
        if codec.scale_dtype != torch.float32:
            scale = scale.to(codec.scale_dtype).float()  # quantize with the scale the ranks decode with
        inverse = torch.reciprocal(scale).nan_to_num_(0.0, 0.0, 0.0)  # scale 0 (or not finite): factor 0
        q = chosen.mul(inverse.index_select(0, self.chunk)).add_(codec.half).round_().clamp_(0, codec.levels - 1)
        return q, scale

    def pack(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """``pack`` of the codes ``q`` (float) into ``out`` as sums of ``code << bits * j``."""
        q = torch.cat([q, self.code_pad])  # even when empty: the same ops for every count
        if self.weights.numel() == 1:
            out.copy_(q)
        else:
            out.copy_(q.view(-1, self.weights.numel()).mul_(self.weights).sum(1))

    def pack_indices(self, where: torch.Tensor, out: torch.Tensor) -> None:
        """``pack_indices`` of ``where`` (int64): 12 bits as pairs summed into 24 bits, then their bytes."""
        width = self.codec.width
        if width == 8:
            out.copy_(where)
        elif width == 12:
            where = torch.cat([where, self.index_pad])
            pairs = where.view(-1, 2).mul(self.pairs).sum(1, keepdim=True)
            out.view(-1, 3).copy_(pairs.bitwise_right_shift(self.bytes).bitwise_and_(0xFF))
        else:
            out.view(torch.int16 if width == 16 else torch.int32).copy_(where)

    def unpack_indices(self, packed: torch.Tensor) -> torch.Tensor:
        """The indices of ``packed`` (``[messages, bytes]``): int64 ``[messages, count]``."""
        codec, width = self.codec, self.codec.width
        if width == 8:
            where = packed.long()
        elif width == 12:
            triples = packed.view(packed.shape[0], -1, 3).long().mul_(self.triples).sum(2, keepdim=True)
            where = triples.bitwise_right_shift(self.halves).bitwise_and_(0xFFF).view(packed.shape[0], -1)
        else:
            where = packed.view(torch.int16 if width == 16 else torch.int32).long()
        return where[:, : codec.count]

    def decode(self, messages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``TiledTopK.decode`` of each of ``messages`` (``[messages, nbytes]``): ``[messages, count]`` each."""
        codec = self.codec
        where = self.unpack_indices(messages[:, codec._indices])
        packed = messages[:, codec._codes]
        if codec.raw:
            return where, packed.view(torch.float32)
        if self.shifts.numel() > 1:
            packed = packed.unsqueeze(2).bitwise_right_shift(self.shifts).bitwise_and_(codec.levels - 1)
            packed = packed.view(messages.shape[0], -1)
        codes = packed[:, : codec.count]
        heads = messages[:, codec._heads].view(codec.scale_dtype).float()
        if codec.quantizer == "bins":
            return where, heads.gather(1, codes.long().add_(self.run_bins))
        return where, codes.float().sub_(codec.half).mul_(heads.index_select(1, self.chunk))

    def mean_into(
        self, messages: torch.Tensor, target: torch.Tensor, alpha: float, senders: bool, clip: bool = False
    ) -> torch.Tensor:
        """``TiledTopK.mean_into``: every message decoded at once, then one ``index_add_`` per message
        and sum (each message's places differ, so every device adds in message order)."""
        where, values = self.decode(messages)
        if clip:
            values = clip_to_median(values, self.codec.entry_run, len(self.codec.runs))
        at = where.add_(self.start)
        ranks = messages.shape[0]
        if not senders:
            for place, value in zip(at.unbind(0), values.mul(alpha / ranks).unbind(0)):
                target.index_add_(0, place, value)
            return target
        numel = self.codec.numel
        total = torch.zeros(numel, dtype=torch.float32, device=target.device)
        count = torch.zeros(numel, dtype=torch.float32, device=target.device)
        for place, value, sent in zip(at.unbind(0), values.unbind(0), values.ne(0).float().unbind(0)):
            total.index_add_(0, place, value)
            count.index_add_(0, place, sent)  # a chunk of zeros sends zeros wherever its ties fell
        mine = target if target.numel() == numel else target[:numel]
        mine.add_(total.div_(count.clamp_(min=1)), alpha=alpha)
        return target


def clip_to_median(values: torch.Tensor, entry_run: torch.Tensor, runs: int) -> torch.Tensor:
    """``values`` (``[messages, entries]``, decoded) with each message's entries of each run scaled
    by ``min(1, median / norm)``: ``norm`` the L2 norm of that message's entries of the run,
    ``median`` the median of those norms over the messages (``torch.median``: the lower middle one).
    A norm of zero is left as it is."""
    squares = values.new_zeros(values.shape[0], runs).index_add_(1, entry_run, values * values)
    norms = squares.sqrt_()
    median = norms.median(dim=0).values
    scale = torch.where(norms > median, median / norms, torch.ones_like(norms))
    return values * scale.index_select(1, entry_run)
