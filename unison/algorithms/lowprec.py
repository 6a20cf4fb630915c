"""Gradient averaging in half precision on the wire ("fp16" and "bf16").

Each bucket (already divided by the world size, so an fp16 sum cannot
overflow where the fp32 average would not) is cast to the wire dtype, summed
with one allreduce, and cast back into the bucket. Works on gloo, where torch's
own bf16 hook refuses to run.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from ..comm import ring_bytes, start
from .base import Algorithm


class CastAllReduce(Algorithm):
    """Allreduce of a bucket cast to ``wire_dtype``; half the bytes of fp32."""

    wire_dtype: ClassVar[torch.dtype]
    defaults = {}

    def setup(self, model) -> None:
        self._wire: dict[int, torch.Tensor] = {}

    def _wire_buffer(self, bucket) -> torch.Tensor:
        """A reusable wire-dtype buffer the size of ``bucket`` (no per-step allocation)."""
        buf = self._wire.get(bucket.index)
        if buf is None or buf.numel() != bucket.flat.numel() or buf.device != bucket.flat.device:
            buf = self._wire[bucket.index] = torch.empty(bucket.flat.numel(), dtype=self.wire_dtype, device=bucket.flat.device)
        return buf

    def reduce_bucket(self, bucket, group):
        if bucket.flat.dtype == self.wire_dtype:
            return start(dist.all_reduce, bucket.flat, group=group)
        wire = self._wire_buffer(bucket)
        wire.copy_(bucket.flat)
        future = start(dist.all_reduce, wire, group=group).get_future()
        flat = bucket.flat
        return future.then(lambda _: flat.copy_(wire))

    def bucket_wire_bytes(self, bucket, world_size):
        itemsize = torch.tensor([], dtype=self.wire_dtype).element_size()
        return ring_bytes(bucket.flat.numel() * itemsize, world_size)


class FP16(CastAllReduce):
    name = "fp16"
    wire_dtype = torch.float16


class BF16(CastAllReduce):
    name = "bf16"
    wire_dtype = torch.bfloat16
