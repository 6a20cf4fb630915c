"""Gradient averaging in 8 bits: about a quarter of allreduce's bytes on the wire.

Each bucket is cut into one part per rank, quantized (``unison.engine.codecs``,
8-bit min-max per chunk) and exchanged with one all_to_all; each rank sums the
part it owns, quantizes the sum again and all_gathers it, and every rank
decodes the same gathered bytes, so all end with bit-identical gradients.
A large bucket goes in parts of whole chunks, pipelined (``Exchange``). With
``hierarchical=True`` the node's processes sum in full precision and each
carries its shard across nodes through the Exchange (``unison.engine.hierarchy.TwoLevel``).
See docs/algorithms.md#bytegrad.
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from ...engine.buckets import Bucket
from ...engine.comm import CommThread, Waitable
from ...engine.exchange import PART_VALUES, Exchange, wire_bytes_8bit
from ...engine.flatstate import FlatState
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import Algorithm, Recovery, ThreadedState, open_thread

__all__ = [
    "PART_VALUES",
    "ByteGrad",
    "ByteGradState",
    "Exchange",
    "bucket_exchange",
    "exchange_cross",
    "wire_bytes_8bit",
]


def bucket_exchange(
    cache: dict[Any, Exchange], bucket: Bucket, world: int, chunk_size: int, numel: Optional[int] = None
) -> Exchange:
    """The reusable Exchange of ``bucket`` (or of ``numel`` values of it: a shard) kept in ``cache``
    (rebuilt if the bucket changed size). The cache's Exchanges run on one thread, so they share
    one set of message buffers."""
    numel = bucket.flat.numel() if numel is None else numel
    ex = cache.get(bucket.index)
    if ex is None or ex.codec.numel != numel or ex.codec.rows != world:
        first = next(iter(cache.values()), None)
        slots = first.slots if first is not None else None
        ex = cache[bucket.index] = Exchange(numel, world, chunk_size, bucket.flat.device, slots=slots)
    return ex


def exchange_cross(
    h: TwoLevel, ex: Exchange, residual: Optional[torch.Tensor], shard: torch.Tensor, offset: int
) -> torch.Tensor:
    """The cross-node step in 8 bits: the node's sum of a shard through ``ex`` over the nodes (with
    the shard's part of the bucket's ``residual``: error feedback where the compression happens)."""
    part = None if residual is None else residual[offset : offset + shard.numel()]
    return ex.run(shard, h.inter, part)


class ByteGradState(ThreadedState):
    """Error-feedback residuals (with ``error_feedback``), the buckets' Exchanges, group and thread."""

    __slots__ = ("residuals", "exchanges", "levels")

    def __init__(
        self,
        residuals: Optional[FlatState],
        group: Optional[dist.ProcessGroup] = None,
        thread: Optional[CommThread] = None,
        levels: Optional[TwoLevel] = None,
    ) -> None:
        super().__init__(group, thread)
        self.residuals: Optional[FlatState] = residuals
        self.exchanges: dict[Any, Exchange] = {}
        self.levels = levels

    def close(self) -> None:
        super().close()
        if self.levels is not None:
            self.levels.close()
            self.levels = None

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
        hierarchical: sum in full precision inside each node (reduce-scatter),
            send only each process's shard of the node's sum across nodes in
            8 bits, all-gather inside the node (the residuals are the shard's).

    Example::

        model = unison.DataParallel(net, algorithm="bytegrad:error_feedback=True")
    """

    name = "bytegrad"
    #: It reduces 8-bit buckets with error feedback: sparse gradients (nn.Embedding(sparse=True)) are refused at construction.
    sparse_gradients: ClassVar[bool] = False
    recovery = Recovery(rank_local=("residuals",))  # error feedback belongs to the rank
    chunk_size: int = 1024
    error_feedback: bool = False
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.integer("chunk_size", self.chunk_size)
        options.boolean("error_feedback", self.error_feedback)
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    def setup(self, replica: Replica) -> ByteGradState:
        h = (
            TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True)
            if self.hierarchical
            else None
        )
        state = ByteGradState(FlatState() if self.error_feedback else None, levels=h)
        if replica.distributed and h is None:
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
        h = state.levels
        if h is not None:
            ex = bucket_exchange(state.exchanges, bucket, h.nodes, self.chunk_size, h.shard_numel(bucket.flat.numel()))
            return h.submit(h.run, bucket.flat, partial(exchange_cross, h, ex, residual))
        ex = bucket_exchange(state.exchanges, bucket, world, self.chunk_size)
        return state.running_thread().submit(ex.run, bucket.flat, state.group, residual)

    def bucket_wire_bytes(self, replica: Replica, state: ByteGradState, bucket: Bucket, world_size: int) -> int:
        h = state.levels
        if h is not None:
            shard = h.shard_numel(bucket.flat.numel())
            return h.wire_bytes(bucket.flat, wire_bytes_8bit(shard, h.nodes, self.chunk_size))
        return wire_bytes_8bit(bucket.flat.numel(), world_size, self.chunk_size)
