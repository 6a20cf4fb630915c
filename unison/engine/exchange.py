"""The 8-bit average of a flat buffer over a group: bytegrad's and qadam's exchange.

Each rank's buffer is cut into one part per rank, quantized (``MinMax8``) and
exchanged with one all_to_all; each rank sums the part it owns, quantizes the
sum again and all_gathers it, and every rank decodes the same gathered bytes,
so all end with bit-identical values. See docs/algorithms.md#bytegrad.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm
from .codecs import MinMax8

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only that one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: Values per pipelined part of an Exchange, about: 4 MiB of float32, 1 MiB on the wire.
PART_VALUES = 1 << 20


class Exchange:
    """The reusable buffers of the 8-bit average of one flat buffer of ``numel`` values over ``world`` ranks.

    Args:
        numel: the buffer's length.
        world: ranks in the group (one packed part each).
        chunk_size: values per quantization chunk, at most.
        device: where the buffers live.
        part_values: values per pipelined part, about (whole codec blocks).
        slots: the message buffers, shared by Exchanges that run one after another
            (default: its own).

    The buffer is cut into parts of whole chunks (``MinMax8.split``), each
    exchanged with its own asynchronous collectives: encoding part k+1 and
    summing part k overlap the transfers of the parts before. A part
    quantizes the same chunks as the whole buffer would, so the result is
    the same bit for bit.

    Example::

        ex = Exchange(bucket.flat.numel(), world, 1024, bucket.flat.device)
        thread.submit(ex.run, bucket.flat, group)
    """

    def __init__(
        self,
        numel: int,
        world: int,
        chunk_size: int,
        device: torch.device,
        part_values: int = PART_VALUES,
        slots: Optional["Slots"] = None,
    ) -> None:
        self.slots = Slots() if slots is None else slots
        self.codec = MinMax8(
            numel, rows=world, chunk_size=chunk_size, device=device, scratch=lambda n: self.slots.scratch(n, device)
        )
        self.parts = self.codec.split(max(1, numel // max(1, part_values)))

    def run(
        self, flat: torch.Tensor, group: Optional[dist.ProcessGroup], residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Sum ``flat`` across ``group`` in 8 bits, in place (blocking: run it on a CommThread).

        ``flat`` holds this rank's share (already divided by the world size).
        With ``residual``, it is added first and replaced by what this rank's
        quantization lost.
        """
        pad = self.codec.pad_value(flat, residual)
        parts, count = self.parts, len(self.parts)
        bufs: list[Any] = [None] * count
        sent: list[Any] = [None] * count
        gathered: list[Any] = [None] * count

        def send(k: int) -> None:
            bufs[k] = self.slots.buffers(k % len(self.slots), parts[k])
            parts[k].encode_from(flat, bufs[k][0], feedback=residual, pad=pad)
            sent[k] = dist.all_to_all_single(bufs[k][1].view(-1), bufs[k][0].view(-1), group=group, async_op=True)

        send(0)
        for k in range(count):
            if k + 1 < count:
                send(k + 1)
            comm.wait(sent[k])
            parts[k].sum_encode(bufs[k][1], bufs[k][2])
            gathered[k] = _all_gather(bufs[k][1].view(-1), bufs[k][2].view(-1), group=group, async_op=True)
            if k > 0:
                comm.wait(gathered[k - 1])
                parts[k - 1].decode_into(bufs[k - 1][1], flat)
        comm.wait(gathered[-1])
        return parts[-1].decode_into(bufs[-1][1], flat)


class Slots:
    """The message buffers of Exchanges run one after another (on one thread): one set per part
    in flight (part k-1 gathering, k summing, k+1 sending), grown to the largest part, so an
    8-bit average costs three parts' messages, not its buffer's nor a model's.

    Example::

        slots = Slots()
        exchanges = [Exchange(b.flat.numel(), world, 1024, device, slots=slots) for b in buckets]
    """

    def __init__(self, count: int = 3) -> None:
        self._raw: list[Optional[torch.Tensor]] = [None] * count
        self._scratch: Optional[torch.Tensor] = None

    def scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        """The codecs' shared float32 work buffer, of at least ``numel`` values (``MinMax8(scratch=)``)."""
        if self._scratch is None or self._scratch.numel() < numel or self._scratch.device != torch.device(device):
            self._scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return self._scratch

    def __len__(self) -> int:
        return len(self._raw)

    def buffers(self, slot: int, part: MinMax8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s (sent rows, received rows, owned row) laid out for ``part``."""
        rows, width = part.rows * part.row_bytes, part.row_bytes
        raw = self._raw[slot]
        if raw is None or raw.numel() < 2 * rows + width or raw.device != part.device:
            raw = self._raw[slot] = torch.empty(2 * rows + width, dtype=torch.uint8, device=part.device)
        return (
            raw[:rows].view(part.rows, width),
            raw[rows : 2 * rows].view(part.rows, width),
            raw[2 * rows : 2 * rows + width].view(1, width),
        )


@lru_cache(maxsize=256)
def wire_bytes_8bit(numel: int, world: int, chunk_size: int, part_values: int = PART_VALUES) -> int:
    """Bytes an Exchange sends from one rank: world-1 packed rows of every part in each of its two collectives."""
    if world == 1 or numel == 0:
        return 0
    codec = MinMax8(numel, rows=world, chunk_size=chunk_size, device=torch.device("meta"))
    return 2 * (world - 1) * sum(p.row_bytes for p in codec.split(max(1, numel // max(1, part_values))))
