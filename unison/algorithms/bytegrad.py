"""Gradient averaging in 8 bits: about a quarter of allreduce's bytes on the wire.

Each bucket is cut into one part per rank, quantized (``unison.engine.codecs``,
8-bit min-max per chunk) and exchanged with one all_to_all; each rank sums the
part it owns, quantizes the sum again and all_gathers it, and every rank
decodes the same gathered bytes, so all end with bit-identical gradients.
A large bucket goes in parts of whole chunks, pipelined (``Exchange``).
See docs/algorithms.md#bytegrad.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.buckets import Bucket
from ..engine.codecs import MinMax8
from ..engine.comm import CommThread, Waitable
from ..engine.flatstate import FlatState
from ..replica import Replica
from .base import Algorithm, ThreadedState, open_thread
from .options import Bool, Int

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
        self, numel: int, world: int, chunk_size: int, device: torch.device, part_values: int = PART_VALUES
    ) -> None:
        self.codec = MinMax8(numel, rows=world, chunk_size=chunk_size, device=device)
        self.parts = self.codec.split(max(1, numel // max(1, part_values)))
        self.buffers = [(p.empty(), p.empty(), p.empty(1)) for p in self.parts]

    def run(
        self, flat: torch.Tensor, group: Optional[dist.ProcessGroup], residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Sum ``flat`` across ``group`` in 8 bits, in place (blocking: run it on a CommThread).

        ``flat`` holds this rank's share (already divided by the world size).
        With ``residual``, it is added first and replaced by what this rank's
        quantization lost.
        """
        pad = self.codec.pad_value(flat, residual)
        parts, bufs, count = self.parts, self.buffers, len(self.parts)
        sent: list[Any] = [None] * count
        gathered: list[Any] = [None] * count

        def send(k: int) -> None:
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


@lru_cache(maxsize=256)
def wire_bytes_8bit(numel: int, world: int, chunk_size: int, part_values: int = PART_VALUES) -> int:
    """Bytes an Exchange sends from one rank: world-1 packed rows of every part in each of its two collectives."""
    if world == 1 or numel == 0:
        return 0
    codec = MinMax8(numel, rows=world, chunk_size=chunk_size, device=torch.device("meta"))
    return 2 * (world - 1) * sum(p.row_bytes for p in codec.split(max(1, numel // max(1, part_values))))


def bucket_exchange(cache: dict[Any, Exchange], bucket: Bucket, world: int, chunk_size: int) -> Exchange:
    """The reusable Exchange of ``bucket`` kept in ``cache`` (rebuilt if the bucket changed size)."""
    ex = cache.get(bucket.index)
    if ex is None or ex.codec.numel != bucket.flat.numel() or ex.codec.rows != world:
        ex = cache[bucket.index] = Exchange(bucket.flat.numel(), world, chunk_size, bucket.flat.device)
    return ex


class ByteGradState(ThreadedState):
    """Error-feedback residuals (with ``error_feedback``), the buckets' Exchanges, group and thread."""

    __slots__ = ("residuals", "exchanges")

    def __init__(
        self,
        residuals: Optional[FlatState],
        group: Optional[dist.ProcessGroup] = None,
        thread: Optional[CommThread] = None,
    ) -> None:
        super().__init__(group, thread)
        self.residuals: Optional[FlatState] = residuals
        self.exchanges: dict[Any, Exchange] = {}

    def state_dict(self) -> dict[str, Any]:
        """The residuals by parameter name (nothing without error feedback)."""
        return {} if self.residuals is None else {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by ``state_dict``; refused without error feedback."""
        unknown = sorted(set(state) - {"residuals"})
        if unknown:
            raise ValueError(f"bytegrad state has unknown entries {unknown}; expected 'residuals'")
        if "residuals" not in state:
            return
        if self.residuals is None:
            raise ValueError(
                "this state holds error-feedback residuals but bytegrad runs with error_feedback=False; create it with error_feedback=True"
            )
        self.residuals.load_state_dict(state["residuals"])


class ByteGrad(Algorithm[ByteGradState]):
    """8-bit compressed averaging: all_to_all of quantized parts, sum, all_gather of quantized sums.

    Args:
        chunk_size: values per quantization chunk (each has its own min and
            scale, 8 bytes; the default 1024 costs under 1% over the codes).
        error_feedback: keep each rank's quantization error and add it to the
            next step's gradient (saved in the state dict).

    Example::

        model = unison.DataParallel(net, algorithm="bytegrad:error_feedback=True")
    """

    name = "bytegrad"
    chunk_size = Int(1024)
    error_feedback = Bool(False)

    def setup(self, replica: Replica) -> ByteGradState:
        state = ByteGradState(FlatState() if self.error_feedback else None)
        if replica.distributed:
            state.group, state.thread = open_thread(replica, self.name)
        return state

    def reduce_bucket(
        self, replica: Replica, state: ByteGradState, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        world = dist.get_world_size(group)
        if world == 1 or bucket.flat.numel() == 0:
            return None
        if not bucket.flat.is_floating_point():
            raise TypeError(
                f"bytegrad reduces floating-point gradients; bucket {bucket.index} holds {bucket.flat.dtype}"
            )
        residual = state.residuals.get(bucket) if state.residuals is not None else None
        ex = bucket_exchange(state.exchanges, bucket, world, self.chunk_size)
        return state.running_thread().submit(ex.run, bucket.flat, state.group, residual)

    def bucket_wire_bytes(self, replica: Replica, state: ByteGradState, bucket: Bucket, world_size: int) -> int:
        return wire_bytes_8bit(bucket.flat.numel(), world_size, self.chunk_size)
