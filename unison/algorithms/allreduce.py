"""Gradient averaging: each bucket is summed across ranks with one allreduce.

Gradients are scaled by 1/world_size while they are copied into the bucket, so
the allreduce's sum is the average (as torch DDP does).

With ``hierarchical=True`` a bucket is first reduced onto each node's leader
(local rank 0) over the intra-node group, the leaders allreduce it over the
inter-node group, and each leader broadcasts the result inside its node: the
slow inter-node link carries one copy per node instead of one per process.
Nodes come from ``unison.init()`` (``UNISON_NODES`` simulates them).

With ``autotune=True`` the bucket size is tuned online: a few candidate sizes
are each used for a few steps, timed, and the fastest (agreed on by all ranks)
is kept; ``chosen_bucket_mb`` and ``autotune_gain`` say what was picked and how
much faster it made a step than the model's ``bucket_cap_mb`` (see
``bucket_tuner``). The tuning starts again when the algorithm is set up again
(a switch, a new model) and is not saved in checkpoints.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import comm, runtime
from .base import Algorithm
from .bucket_tuner import BucketTuner


class AllReduce(Algorithm):
    name = "allreduce"
    defaults = {"hierarchical": False, "autotune": False}

    def validate(self) -> None:
        for name in self.defaults:  # subclasses (nonblocking) keep only some of these options
            if not isinstance(self.options[name], bool):
                raise ValueError(f"{name} must be True or False, got {self.options[name]!r}")

    def setup(self, model) -> None:
        self._tuner = BucketTuner(model.bucket_cap_mb) if self.options.get("autotune") else None
        self._hier = None
        if self.options["hierarchical"] and model.process_group is not None:
            self._hier = _Hierarchy(model.process_group, f"{model.serial}/hierarchical")

    def teardown(self, model) -> None:
        if self._hier is not None:
            self._hier.close()
            self._hier = None

    def before_forward(self, model) -> None:
        if self._tuner is not None and getattr(model, "training", True) and torch.is_grad_enabled():
            self._tuner.forward_started()

    def after_backward(self, model) -> None:
        if self._tuner is not None and getattr(model, "_reducer", None) is not None:
            self._tuner.backward_ended(model._reducer)

    @property
    def tuning(self) -> Optional[dict[str, Any]]:
        """The autotuning's measurements and choice, once made (None before, or without autotune)."""
        tuner = getattr(self, "_tuner", None)
        return None if tuner is None else tuner.result

    @property
    def chosen_bucket_mb(self) -> Optional[float]:
        """The bucket size autotuning kept, in MiB (None until it has chosen)."""
        return None if self.tuning is None else self.tuning["chosen_mb"]

    @property
    def autotune_gain(self) -> Optional[float]:
        """Step time at the model's ``bucket_cap_mb`` over step time at the chosen size (>= 1)."""
        return None if self.tuning is None else self.tuning["gain"]

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
