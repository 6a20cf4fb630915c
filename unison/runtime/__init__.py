"""The runtime: starting the process group, the node layout, private groups and
rank-failure detection. It imports nothing else of unison."""

from __future__ import annotations

import torch.distributed as dist

from . import health
from .groups import forget_private_groups, private_group, src_rank
from .health import RankFailure
from .launch import (
    DEFAULT_TIMEOUT,
    LaunchInfo,
    Topology,
    client_env,
    collective_timeout,
    detect_launch,
    first_host,
    forget_topology,
    init,
    node_mesh,
    replica_group,
    serve_store,
    topology,
)


def shutdown() -> None:
    """Destroy the process group started by ``init()`` and forget the topology and unison's groups."""
    forget_topology()
    forget_private_groups()
    health.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchInfo",
    "RankFailure",
    "Topology",
    "client_env",
    "collective_timeout",
    "detect_launch",
    "first_host",
    "health",
    "init",
    "node_mesh",
    "private_group",
    "replica_group",
    "serve_store",
    "shutdown",
    "src_rank",
    "topology",
]
