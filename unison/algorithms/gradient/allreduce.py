"""Gradient averaging: each bucket is summed across ranks with one allreduce.

Gradients are scaled by 1/world_size while they are copied into the bucket, so
the allreduce's sum is the average (as torch DDP does).

With ``hierarchical=True`` a bucket is reduce-scattered inside each node, each
local rank allreduces its shard with the same local rank of the other nodes,
and the shards are all-gathered inside the node (``unison.engine.hierarchy.TwoLevel``):
the slow inter-node link carries one copy per node instead of one per process,
split over every process's link. Nodes come from ``unison.init()``
(``UNISON_NODES`` simulates them).

With ``autotune=True`` the bucket size is tuned online: a few candidate sizes
are each used for a few steps, timed, and the fastest (agreed on by all ranks)
is kept; ``chosen_bucket_mb`` and ``autotune_gain`` say what was picked and how
much faster it made a step than the model's ``bucket_cap_mb`` (see
``bucket_tuner``). The tuning starts again when the algorithm is set up again
(a switch, a new model) and is not saved in checkpoints.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist

from ...engine import comm
from ...engine.buckets import Bucket
from ...engine.comm import Waitable
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Algorithm, Recovery, State
from .bucket_tuner import BucketTuner


class AllReduceState(State):
    """The autotuner and the two levels (``hierarchical=True``), when asked for."""

    __slots__ = ("tuner", "levels")

    def __init__(self, tuner: Optional[BucketTuner], levels: Optional[TwoLevel]) -> None:
        super().__init__()
        self.tuner, self.levels = tuner, levels

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


class BucketAllReduce(Algorithm[R]):
    """One allreduce per gradient bucket, overlapped with backward: what allreduce and
    nonblocking share (they differ in when the average is applied, and in autotune).

    Args:
        hierarchical: reduce-scatter inside each node, allreduce each shard
            across nodes, all-gather inside the node.
    """

    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    def base_state(self, replica: Replica, autotune: bool = False) -> AllReduceState:
        """The autotuner and the two levels, as the options ask."""
        self.check_optimizers(replica)
        tuner = BucketTuner(replica.bucket_cap_mb) if autotune else None
        levels = (
            TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True)
            if self.hierarchical
            else None
        )
        return AllReduceState(tuner, levels)

    def teardown(self, replica: Replica, state: R) -> None:
        if state.levels is not None:
            state.levels.close()
            state.levels = None

    def before_forward(self, replica: Replica, state: R) -> None:
        if state.tuner is not None and torch.is_grad_enabled():
            state.tuner.forward_started()

    def after_backward(self, replica: Replica, state: R) -> None:
        if state.tuner is not None:
            state.tuner.backward_ended(replica)

    def reduce_bucket(
        self, replica: Replica, state: R, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        h = state.levels
        if h is not None:
            return h.submit(h.run, bucket.flat, h.allreduce)
        return super().reduce_bucket(replica, state, bucket, group)

    def bucket_wire_bytes(self, replica: Replica, state: R, bucket: Bucket, world_size: int) -> int:
        h = state.levels
        if h is not None:
            shard = h.shard_numel(bucket.flat.numel()) * bucket.flat.element_size()
            return h.wire_bytes(bucket.flat, comm.ring_bytes(shard, h.nodes))
        return super().bucket_wire_bytes(replica, state, bucket, world_size)


class AllReduce(BucketAllReduce[AllReduceState]):
    """Gradients averaged in buckets, one allreduce each, overlapped with backward.

    Args:
        hierarchical: reduce-scatter inside each node, allreduce each shard
            across nodes, all-gather inside the node.
        autotune: time a few bucket sizes online and keep the fastest.

    Example::

        model = unison.DataParallel(net, algorithm=unison.algorithms.create("allreduce", hierarchical=True))
    """

    name = "allreduce"
    recovery = Recovery()
    fsdp2 = FSDP2(gradients=True)  # averaged across the replicas as torch's HSDP does
    autotune: bool = False

    def __post_init__(self) -> None:
        options.boolean("autotune", self.autotune)
        super().__post_init__()

    def setup(self, replica: Replica) -> AllReduceState:
        return self.base_state(replica, self.autotune)
