"""Sharding data across ranks: a sampler and a DataLoader helper.

``ShardSampler`` is torch's DistributedSampler with its rank and world size
taken from the running process group (a world of one when there is none), so
the same script runs alone or distributed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def _group_rank_and_size(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class ShardSampler(DistributedSampler):
    """Equal-length shards of ``dataset``, one per rank, reshuffled each epoch.

    Every rank gets ``ceil(len / world)`` indices (the last few repeat the
    first ones, so shards stay equal) unless ``drop_last=True``. Call
    ``set_epoch(epoch)`` before each epoch so all ranks shuffle alike.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        group_rank, group_size = _group_rank_and_size(group)
        super().__init__(
            dataset,
            num_replicas=group_size if num_replicas is None else num_replicas,
            rank=group_rank if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )


def sharded_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over this rank's shard; ``loader.sampler.set_epoch(e)`` reshuffles."""
    sampler = ShardSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, group=group)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
