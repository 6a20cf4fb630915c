"""Process groups unison creates for itself: private copies of a group, per tag.

A private group has the same members as the group it copies; collectives on it
run in their own sequence, so an algorithm's background thread (or a second
model) never interleaves with the main thread's collectives.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from . import ending, membership
from .launch import collective_timeout


def src_rank(group: Optional[dist.ProcessGroup], group_rank: int = 0) -> int:
    """The global rank of ``group_rank`` inside ``group`` (torch wants global ranks)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


_private_groups: dict[tuple, Optional[dist.ProcessGroup]] = {}


def private_group(group: Optional[dist.ProcessGroup], tag: Optional[str] = None) -> Optional[dist.ProcessGroup]:
    """A process group with the same members as ``group``, for one user's own traffic.

    Collectives on it never interleave with those on ``group`` (they run in
    their own sequence), so a background thread can use it safely. With a
    ``tag`` the group is created once and handed out again for the same
    (group, tag), e.g. when an algorithm is switched away and back. For the
    whole world every rank calls this in the same order; for a subgroup only
    its members do (group-local synchronization).
    """
    if group is None:
        return None
    key = (group, tag)
    if tag is not None and key in _private_groups:
        return _private_groups[key]
    timeout = collective_timeout()
    if group is dist.group.WORLD or dist.get_world_size(group) == dist.get_world_size():
        new = membership.new_group(lambda t: dist.new_group(timeout=t), timeout)
    else:
        ranks = [src_rank(group, r) for r in range(dist.get_world_size(group))]
        new = membership.new_group(
            lambda t: dist.new_group(ranks=ranks, timeout=t, use_local_synchronization=True), timeout
        )
    if tag is not None:
        _private_groups[key] = new
    return new


def forget_private_groups() -> list[dist.ProcessGroup]:
    """Drop the cached groups (when the default process group is destroyed); returns them."""
    groups = [g for g in _private_groups.values() if g is not None]
    _private_groups.clear()
    return groups


ending.forgets.append(forget_private_groups)
