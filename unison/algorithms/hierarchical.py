"""The node layout of a hierarchical algorithm: checked once, at construction, and its TwoLevel built.

Every algorithm's ``hierarchical=True`` runs on ``unison.engine.hierarchy.TwoLevel``
(the gradient algorithms directly, the model-averaging ones through
``engine.node_average``; see docs/algorithms.md#hierarchical-reduction); this module
decides whether the layout allows it (``two_level``, the one check) and builds its groups.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.hierarchy import Cross, TwoLevel
from ..replica import Replica


class Hierarchy:
    """A ``TwoLevel`` and the CommThread its reductions run on (one per state; ``close`` stops it)."""

    __slots__ = ("levels", "thread")

    def __init__(self, levels: TwoLevel, name: str) -> None:
        self.levels, self.thread = levels, comm.CommThread(f"unison-{name}-hier")

    def submit(self, flat: torch.Tensor, cross: Cross, bounds: Optional[Sequence[int]] = None) -> comm.Pending:
        """Start ``levels.run(flat, cross, bounds)`` on the thread."""
        return self.thread.submit(self.levels.run, flat, cross, bounds)

    def allreduce(self, shard: torch.Tensor, offset: int) -> None:
        """The plain cross-node step: sum the shard over the nodes at its own precision."""
        comm.wait(comm.start(dist.all_reduce, shard, group=self.levels.inter))

    def shard_numel(self, numel: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Values of this process's shard of a buffer of ``numel`` (cut at ``bounds``, default even)."""
        start, end = self.levels.shard(self.levels.bounds(numel) if bounds is None else bounds)
        return end - start

    def wire_bytes(self, flat: torch.Tensor, cross_bytes: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Bytes this process sends for one reduction of ``flat``: inside the node, plus ``cross_bytes``
        (what its shard's crossing sends)."""
        return self.levels.intra_bytes(flat.numel(), flat.element_size(), bounds) + cross_bytes

    def close(self) -> None:
        self.thread.close()


def check_uniform(replica: Replica, what: str) -> None:
    """Raise ValueError if the nodes run different numbers of processes (``what`` needs the node groups)."""
    topo = replica.topology
    if not topo.uniform:
        raise ValueError(
            f"{what} needs the same number of processes on every node; the ranks' local world sizes "
            f"are {list(topo.local_sizes)}: launch as many processes per node everywhere, or pass hierarchical=False"
        )


def two_level(replica: Replica, name: str, tag: str = "hierarchical") -> Optional[TwoLevel]:
    """The two levels of algorithm ``name`` over this replica's nodes, or None to run flat.

    Raises ValueError when the layout cannot support it: no node layout
    (``unison.init()`` not called), a process group that is not the whole
    world, or nodes running different numbers of processes. Runs flat
    (returns None) on a single node, where nothing crosses nodes, and with one
    process per node, where flat is what two levels would do (with a warning).
    Every rank calls it (it may create private groups, found again under ``tag``).
    """
    if replica.group is None or not replica.distributed:
        return None
    topo = replica.topology
    if topo.world_size != dist.get_world_size():
        raise ValueError(f"hierarchical {name} needs the node layout: call unison.init() before building DataParallel")
    if replica.group is not dist.group.WORLD:
        raise ValueError(
            f"hierarchical {name} runs on the whole world; it cannot be combined with a process_group subset"
        )
    check_uniform(replica, f"hierarchical {name}")
    if topo.num_nodes == 1:
        return None
    if topo.local_world_size == 1:
        warnings.warn(
            f"hierarchical {name} with one process per node is the flat algorithm: running flat", stacklevel=3
        )
        return None
    intra = replica.private_group(tag + "/intra", topo.intra_node_group)
    inter = replica.private_group(tag + "/inter", topo.inter_node_group)
    return TwoLevel(intra, inter, topo.local_rank, topo.local_world_size, topo.num_nodes, topo.node)


def hierarchy(replica: Replica, name: str, tag: str = "hierarchical") -> Optional[Hierarchy]:
    """``two_level`` with the CommThread a gradient algorithm's reductions run on (None: run flat).

    The gradient algorithms share their private groups under ``tag``: only one
    algorithm of a model runs at a time.
    """
    levels = two_level(replica, name, tag)
    return Hierarchy(levels, name) if levels is not None else None
