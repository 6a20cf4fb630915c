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

from typing import Any, Optional, TypeVar, cast

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.buckets import Bucket
from ..engine.comm import Waitable
from ..replica import Replica
from .base import Algorithm, State
from .bucket_tuner import BucketTuner
from .options import Bool


class AllReduceState(State):
    """The autotuner and the hierarchical reduction's groups, when asked for."""

    __slots__ = ("tuner", "hierarchy")

    def __init__(self, tuner: Optional[BucketTuner], hierarchy: Optional["Hierarchy"]) -> None:
        super().__init__()
        self.tuner, self.hierarchy = tuner, hierarchy

    @property
    def tuning(self) -> Optional[dict[str, Any]]:
        """The autotuning's measurements and choice, once made (None before, or without autotune)."""
        return None if self.tuner is None else self.tuner.result

    @property
    def chosen_bucket_mb(self) -> Optional[float]:
        """The bucket size autotuning kept, in MiB (None until it has chosen)."""
        return None if self.tuning is None else self.tuning["chosen_mb"]

    @property
    def autotune_gain(self) -> Optional[float]:
        """Step time at the model's ``bucket_cap_mb`` over step time at the chosen size (>= 1)."""
        return None if self.tuning is None else self.tuning["gain"]


R = TypeVar("R", bound=AllReduceState)


class AllReduce(Algorithm[R]):
    """Gradients averaged in buckets, one allreduce each, overlapped with backward.

    Args:
        hierarchical: reduce inside each node, allreduce across node leaders,
            broadcast inside the node.
        autotune: time a few bucket sizes online and keep the fastest.

    Example::

        model = unison.DataParallel(net, algorithm=unison.algorithms.create("allreduce", hierarchical=True))
    """

    name = "allreduce"
    hierarchical = Bool(False)
    autotune = Bool(False)

    def setup(self, replica: Replica) -> R:
        return cast(R, self.base_state(replica))  # nonblocking builds its own state around this one

    def base_state(self, replica: Replica) -> AllReduceState:
        """The autotuner and the hierarchy, as the options ask."""
        self.check_optimizers(replica)
        tuner = BucketTuner(replica.bucket_cap_mb) if self.autotune else None
        hierarchy = Hierarchy(replica, "hierarchical") if self.hierarchical and replica.group is not None else None
        return AllReduceState(tuner, hierarchy)

    def teardown(self, replica: Replica, state: R) -> None:
        if state.hierarchy is not None:
            state.hierarchy.thread.close()
            state.hierarchy = None

    def before_forward(self, replica: Replica, state: R) -> None:
        if state.tuner is not None and torch.is_grad_enabled():
            state.tuner.forward_started()

    def after_backward(self, replica: Replica, state: R) -> None:
        if state.tuner is not None:
            state.tuner.backward_ended(replica)

    def reduce_bucket(
        self, replica: Replica, state: R, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        if state.hierarchy is not None:
            return state.hierarchy.thread.submit(state.hierarchy.reduce, bucket.flat)
        return super().reduce_bucket(replica, state, bucket, group)

    def bucket_wire_bytes(self, replica: Replica, state: R, bucket: Bucket, world_size: int) -> int:
        if state.hierarchy is not None:
            return state.hierarchy.wire_bytes(bucket.nbytes)
        return super().bucket_wire_bytes(replica, state, bucket, world_size)


class Hierarchy:
    """The groups and the thread of a hierarchical reduction (reduce, allreduce, broadcast)."""

    def __init__(self, replica: Replica, tag: str) -> None:
        topo = replica.topology
        if topo.world_size != dist.get_world_size():
            raise ValueError(
                "hierarchical allreduce needs the node layout: call unison.init() before building DataParallel"
            )
        if replica.group is not dist.group.WORLD:
            raise ValueError(
                "hierarchical allreduce runs on the whole world; it cannot be combined with a process_group subset"
            )
        self.local_size, self.nodes = topo.local_world_size, topo.num_nodes
        self.leader = topo.node_ranks()[0]
        self.is_leader = topo.local_rank == 0
        self.intra = replica.private_group(tag + "/intra", topo.intra_node_group)
        self.inter = replica.private_group(tag + "/inter", topo.inter_node_group)
        self.thread = comm.CommThread("unison-hier")

    def reduce(self, flat: torch.Tensor) -> None:
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
