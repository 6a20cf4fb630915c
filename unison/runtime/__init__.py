"""The runtime: starting the process group, the node layout, private groups and
rank-failure detection. It imports nothing else of unison."""

from __future__ import annotations

from . import ending, health
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
    """End the job: the process group started by ``init()`` destroyed, the topology and unison's
    groups forgotten and, when no collective is in flight, every wrapper released (no collective)
    and every group's threads joined (``ending``: a gloo thread alive when the interpreter
    finalizes can abort the process). Called at exit when the script did not."""
    ending.end()


__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchInfo",
    "RankFailure",
    "Topology",
    "client_env",
    "collective_timeout",
    "detect_launch",
    "ending",
    "first_host",
    "forget_private_groups",
    "forget_topology",
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
