"""Gradient averaging: each bucket is summed across ranks with one allreduce.

Gradients are scaled by 1/world_size while they are copied into the bucket, so
the allreduce's sum is the average (as torch DDP does).

With ``hierarchical=True`` a bucket is first reduced onto each node's leader
(local rank 0) over the intra-node group, the leaders allreduce it over the
inter-node group, and each leader broadcasts the result inside its node: the
slow inter-node link carries one copy per node instead of one per process.
Nodes come from ``unison.init()`` (``UNISON_NODES`` simulates them).
"""

from __future__ import annotations

import torch.distributed as dist

from .. import comm, runtime
from .base import Algorithm


class AllReduce(Algorithm):
    name = "allreduce"
    defaults = {"hierarchical": False}

    def validate(self) -> None:
        if not isinstance(self.options["hierarchical"], bool):
            raise ValueError(f"hierarchical must be True or False, got {self.options['hierarchical']!r}")

    def setup(self, model) -> None:
        self._hier = None
        if self.options["hierarchical"] and model.process_group is not None:
            self._hier = _Hierarchy(model.process_group, f"{model.serial}/hierarchical")

    def teardown(self, model) -> None:
        if self._hier is not None:
            self._hier.close()
            self._hier = None

    def reduce_bucket(self, bucket, group):
        if self._hier is not None:
            return self._hier.thread.submit(self._hier.reduce, bucket.flat)
        return super().reduce_bucket(bucket, group)

    def bucket_wire_bytes(self, bucket, world_size):
        if self._hier is not None:
            return self._hier.wire_bytes(bucket.nbytes)
        return super().bucket_wire_bytes(bucket, world_size)


class _Hierarchy:
    """The groups and the thread of a hierarchical reduction (reduce, allreduce, broadcast)."""

    def __init__(self, group, tag: str) -> None:
        topo = runtime.topology()
        if topo.world_size != dist.get_world_size():
            raise ValueError("hierarchical allreduce needs the node layout: call unison.init() before building DataParallel")
        if group is not dist.group.WORLD:
            raise ValueError("hierarchical allreduce runs on the whole world; it cannot be combined with a process_group subset")
        self.local_size, self.nodes = topo.local_world_size, topo.num_nodes
        self.leader = topo.node_ranks()[0]
        self.is_leader = topo.local_rank == 0
        self.intra = comm.private_group(topo.intra_node_group, tag + "/intra")
        self.inter = comm.private_group(topo.inter_node_group, tag + "/inter")
        self.thread = comm.CommThread("unison-hier")

    def reduce(self, flat) -> None:
        if self.local_size > 1:
            dist.reduce(flat, dst=self.leader, group=self.intra)
        if self.is_leader and self.nodes > 1:
            dist.all_reduce(flat, group=self.inter)
        if self.local_size > 1:
            dist.broadcast(flat, src=self.leader, group=self.intra)

    def wire_bytes(self, nbytes: int) -> int:
        if not self.is_leader:
            return nbytes  # its share of the intra-node reduce
        inter = 2 * (self.nodes - 1) * nbytes // self.nodes
        return inter + (self.local_size - 1) * nbytes  # plus the intra-node broadcast

    def close(self) -> None:
        self.thread.close()
