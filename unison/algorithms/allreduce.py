"""Gradient averaging: each bucket is summed across ranks with one allreduce.

Gradients are scaled by 1/world_size while they are copied into the bucket, so
the allreduce's sum is the average (as torch DDP does).
"""

from __future__ import annotations

import torch.distributed as dist

from .base import Algorithm


class AllReduce(Algorithm):
    name = "allreduce"
    defaults = {}

    def reduce_bucket(self, bucket, group):
        return dist.all_reduce(bucket.flat, group=group, async_op=True)

    def bucket_wire_bytes(self, bucket, world_size):
        # A ring allreduce sends 2 (n-1)/n of the buffer from every rank.
        return 2 * (world_size - 1) * bucket.nbytes // world_size
