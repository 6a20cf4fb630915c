"""The node layout of a hierarchical model-averaging algorithm (``hierarchical=True``): its
private groups inside the node and across nodes, checked once at construction.

Every process of a node must see the same layout: processes per node that differ
between nodes are refused; one process per node has nothing to average inside,
so the algorithm runs flat, with a warning (as hierarchical allreduce does then).
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch.distributed as dist

from ..engine.comm import all_gather_objects
from ..engine.node_average import Nodes
from ..replica import Replica


def check_layout(name: str, local_sizes: Sequence[int]) -> bool:
    """Whether ``local_sizes`` (every rank's processes per node) allow a hierarchical ``name``;
    False: run flat (one process per node). Raises ValueError when nodes differ."""
    if len(set(local_sizes)) > 1:
        raise ValueError(
            f"hierarchical {name} needs the same number of processes on every node, got "
            f"{sorted(set(local_sizes))} processes per node; use {name} with hierarchical=False"
        )
    return local_sizes[0] > 1


def node_groups(replica: Replica, name: str, tag: Optional[str] = None) -> Optional[Nodes]:
    """The private groups (tagged ``tag``, default ``name``) of ``name``'s hierarchical variant on this
    replica; None when it runs flat (one process, or one process per node: warned). A collective."""
    if not replica.distributed:
        return None
    topo = replica.topology
    if topo.world_size != dist.get_world_size() or replica.group is not dist.group.WORLD:
        raise ValueError(
            f"hierarchical {name} needs unison.init() (the node layout) and the whole world as its process group"
        )
    sizes = all_gather_objects(topo.local_world_size, replica.group)
    if not check_layout(name, sizes):
        warnings.warn(
            f"hierarchical {name} with one process per node has nothing to average inside a node: it runs flat",
            stacklevel=3,
        )
        return None
    tag = tag or name
    intra = replica.private_group(f"{tag}/intra", topo.intra_node_group)
    inter = replica.private_group(f"{tag}/inter", topo.inter_node_group) if topo.num_nodes > 1 else None
    return Nodes(intra, inter, topo.local_rank, topo.local_world_size, topo.num_nodes, topo.node)
