"""Gradient averaging in half precision on the wire ("fp16" and "bf16").

Each bucket (already divided by the world size, so an fp16 sum cannot
overflow where the fp32 average would not) is cast to the wire dtype, summed
with one allreduce, and cast back into the bucket. Works on gloo, where torch's
own bf16 hook refuses to run. With ``hierarchical=True`` the node's processes
sum in full precision and only each shard's crossing of nodes is cast
(``unison.engine.hierarchy.TwoLevel``).
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar, Optional

import torch
import torch.distributed as dist

from ...engine.buckets import Bucket
from ...engine.codecs import halfcast
from ...engine.comm import Waitable, ring_bytes, start
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Algorithm, Recovery, State


class CastState(State):
    """The two levels when asked for. No wire buffer: a bucket is cast in its own bytes
    (``unison.engine.codecs.halfcast``), so a cast costs no memory beyond the bucket."""

    __slots__ = ("levels",)

    def __init__(self, levels: Optional[TwoLevel] = None) -> None:
        super().__init__()
        self.levels = levels

    def close(self) -> None:
        if self.levels is not None:
            self.levels.close()
            self.levels = None


class CastAllReduce(Algorithm[CastState]):
    """Allreduce of a bucket cast to ``wire_dtype``; half the bytes of fp32.

    Args:
        hierarchical: sum in full precision inside each node (reduce-scatter),
            cast only the shard each process carries across nodes, all-gather
            inside the node.

    Example::

        model = unison.DataParallel(net, algorithm="bf16")
    """

    wire_dtype: ClassVar[torch.dtype]
    recovery = Recovery()
    fsdp2 = FSDP2(gradients=True)  # in wire_dtype, across the replicas
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    def setup(self, replica: Replica) -> CastState:
        if not self.hierarchical:
            return CastState()
        return CastState(TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True))

    def reduce_bucket(
        self, replica: Replica, state: CastState, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        h = state.levels
        if h is not None:
            cross = h.allreduce if bucket.flat.dtype == self.wire_dtype else partial(_cast_cross, h, self.wire_dtype)
            return h.submit(h.run, bucket.flat, cross)
        if bucket.flat.dtype == self.wire_dtype:
            return start(dist.all_reduce, bucket.flat, group=group)
        flat = bucket.flat
        wire = halfcast.to_wire(flat, self.wire_dtype)
        future = start(dist.all_reduce, wire, group=group).get_future()
        return future.then(lambda _: halfcast.from_wire(wire, flat))

    def bucket_wire_bytes(self, replica: Replica, state: CastState, bucket: Bucket, world_size: int) -> int:
        itemsize = torch.tensor([], dtype=self.wire_dtype).element_size()
        h = state.levels
        if h is not None:
            return h.wire_bytes(bucket.flat, ring_bytes(h.shard_numel(bucket.flat.numel()) * itemsize, h.nodes))
        return ring_bytes(bucket.flat.numel() * itemsize, world_size)


def _cast_cross(h: TwoLevel, dtype: torch.dtype, shard: torch.Tensor, offset: int) -> None:
    """The cross-node step in the wire dtype: the node's sum of the shard, cast, summed, cast back."""
    wire = halfcast.to_wire(shard, dtype)
    h.allreduce(wire, offset)
    halfcast.from_wire(wire, shard)


class FP16(CastAllReduce):
    name = "fp16"
    wire_dtype = torch.float16


class BF16(CastAllReduce):
    name = "bf16"
    wire_dtype = torch.bfloat16
