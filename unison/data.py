"""Sharding data across ranks: a sampler and a DataLoader helper.

``ShardSampler`` is torch's DistributedSampler with its rank and world size
taken from the running process group (a world of one when there is none), so
the same script runs alone or distributed. It can also resume mid-epoch: a
checkpoint records how far the epoch got, and the resumed pass yields the
rest of the epoch in the order the uninterrupted pass would have. Under fault
tolerance it re-deals the rest of an epoch when the members change.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def group_rank_and_size(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class ShardSampler(DistributedSampler):
    """Equal-length shards of ``dataset``, one per rank, reshuffled each epoch.

    Every rank gets ``ceil(len / world)`` indices (the last few repeat the
    first ones, so shards stay equal) unless ``drop_last=True``. Call
    ``set_epoch(epoch)`` before each epoch so all ranks shuffle alike; the
    order is exactly torch's DistributedSampler's.

    Resuming: ``set_epoch(epoch, start=n)`` makes the next pass skip the first
    ``n`` indices of this rank's shard (``n`` = steps already done in the
    epoch x batch size). ``state_dict()`` records the epoch and how many
    indices the current pass has handed out; after ``load_state_dict`` the next
    pass over that epoch (``set_epoch`` with the same epoch keeps it) yields
    the remaining indices. The count is of indices handed to the DataLoader,
    which is exact with ``num_workers=0``; worker processes read ahead, so with
    them save at epoch ends or pass ``start`` yourself.

    Fault tolerance: ``model.ft.attach(sampler=sampler)`` heals the epoch and
    position into a joiner and calls ``reshard`` on every membership change,
    which deals the rest of the epoch over the new members (see
    docs/fault-tolerance.md).
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
        group_rank, group_size = group_rank_and_size(group)
        super().__init__(
            dataset,
            num_replicas=group_size if num_replicas is None else num_replicas,
            rank=group_rank if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        # Both count positions in the epoch's order across all ranks (rank r's
        # shard is every num_replicas-th index of it, starting at r).
        self._skip = 0  # to skip at the start of the next pass
        self._consumed = 0  # handed out so far in this epoch
        self._deal: Optional[list[int]] = None  # the current pass's positions (the epoch's order, fitted)
        self._dealt_epoch = -1

    def set_epoch(self, epoch: int, start: Optional[int] = None) -> None:
        """Shuffle for ``epoch``; the next pass starts ``start`` indices into this rank's shard.

        Without ``start``, a new epoch starts at its beginning, and the epoch
        restored by ``load_state_dict`` resumes where it was saved.
        """
        if start is not None:
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(
                    f"start must be a non-negative integer (samples of this rank's shard to skip), got {start!r}"
                )
            skip = start * self.num_replicas
        elif epoch == self.epoch:
            skip = self._skip
        else:
            skip = 0
        super().set_epoch(epoch)
        self._skip = self._consumed = skip

    def _permutation(self) -> list[int]:
        """The epoch's order of the whole dataset, before padding or cutting."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _deal_from(self, start: int) -> list[int]:
        """Deal the epoch from position ``start`` on over the current ranks: its order as torch's
        DistributedSampler has it for this world, the rest refitted to equal shards (a resume or a
        re-deal may start anywhere)."""
        order = _fit(self._permutation(), self.total_size, self.drop_last)
        start = min(start, len(order))
        rest = order[start:]
        self._deal = order[:start] + _fit(rest, _round(len(rest), self.num_replicas, self.drop_last), self.drop_last)
        self._dealt_epoch = self.epoch
        return self._deal

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0  # a resume applies to one pass only
        self._deal_from(skip)
        self._consumed = skip
        epoch = self.epoch
        # Rank r's shard is every num_replicas-th position from the current one; both are read
        # afresh for each index, so a re-deal (``reshard``) or a heal takes effect mid-pass.
        while self.epoch == epoch:
            deal = self._deal
            assert deal is not None  # dealt above; a re-deal replaces it
            position = self._consumed + self.rank
            if position >= len(deal):
                return
            self._consumed += self.num_replicas
            yield deal[position]

    def reshard(self, rank: int, world_size: int) -> str:
        """Deal the rest of the epoch over a new membership (fault tolerance calls this on every
        change): no position is dealt twice, and every member's shard stays equal. Returns what it did."""
        if rank < 0 or world_size <= rank:
            raise ValueError(f"reshard needs 0 <= rank < world_size, got rank {rank} of {world_size}")
        self.rank, self.num_replicas = rank, world_size
        self.total_size = _round(len(self.dataset), world_size, self.drop_last)  # type: ignore[arg-type]
        self.num_samples = self.total_size // world_size
        if self._deal is None or self._dealt_epoch != self.epoch:
            return f"epoch {self.epoch}: dealt over {world_size} rank(s) from its next pass"
        left = max(len(self._deal_from(self._consumed)) - self._consumed, 0)
        return f"epoch {self.epoch}: {left} indices left, dealt over {world_size} rank(s)"

    def __len__(self) -> int:
        """Indices the next pass yields on this rank (fewer when it resumes mid-epoch)."""
        remaining = max(self.total_size - self._skip, 0)
        return _round(remaining, self.num_replicas, self.drop_last) // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """The epoch and how far into it the current pass has got (plain values)."""
        return {
            "epoch": self.epoch,
            "consumed": self._consumed,
            "num_replicas": self.num_replicas,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Position the sampler where ``state_dict()`` was taken: the next pass over
        that epoch yields the rest of it. The dataset, seed and shuffling must match."""
        for key, mine in (("dataset_len", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):  # type: ignore[arg-type]
            if state[key] != mine:
                raise ValueError(
                    f"the saved sampler has {key}={state[key]!r} but this one has {key}={mine!r}; the data order would differ"
                )
        super().set_epoch(int(state["epoch"]))
        self._skip = self._consumed = int(state["consumed"])
        if self._deal is not None and self._dealt_epoch == self.epoch:  # a heal mid-pass: go on from there
            self._deal_from(self._consumed)


def _round(length: int, world: int, drop_last: bool) -> int:
    """``length`` rounded to a multiple of ``world``: down with ``drop_last``, else up."""
    return (length // world if drop_last else math.ceil(length / world)) * world


def _fit(order: list[int], size: int, drop_last: bool) -> list[int]:
    """``order`` cut to ``size``, or padded by repeating it from its start (DistributedSampler's rule)."""
    if drop_last or len(order) >= size or not order:
        return order[:size]
    padding = size - len(order)
    return order + (order * math.ceil(padding / len(order)))[:padding]


def sharded_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    **loader_kwargs: Any,
) -> DataLoader:
    """A DataLoader over this rank's shard; ``loader.sampler.set_epoch(e)`` reshuffles.

    Unless given a ``generator``, the loader draws its workers' seeds from a
    private one (seeded from ``seed`` and the rank): a DataLoader without one
    draws from torch's global RNG each time it starts a pass, so a run resumed
    mid-epoch (one extra pass) would see different dropout masks.
    """
    sampler = ShardSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, group=group)
    if loader_kwargs.get("generator") is None:
        loader_kwargs["generator"] = torch.Generator().manual_seed(seed * 1_000_003 + sampler.rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
