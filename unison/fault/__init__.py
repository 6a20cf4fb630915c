"""Fault tolerance, in one package: a job that loses, stops or gains processes goes on.

- ``tolerance``: inside the job, ``DataParallel(..., fault_tolerant=True)`` and its ``model.ft``:
  a failure ends the membership's waits, then regroup, settle, redo or drop.
- ``member``: this worker's side of the job (heartbeats, memberships, regroups, polled waits).
- ``node_group``: a node's group that outlives memberships (FSDP2 inside nodes).
- ``messages``: what the processes say to each other through the coordinator's store.
- ``launcher/``: the processes that run the job: the coordinator, the nodes' agents, the
  preloaded template that forks workers, the status page.

The rest of unison imports only this face and ``unison.fault.launcher``'s; the runtime and the
engine import nothing of it, and reach the membership through ``unison.runtime.membership``.
See docs/fault-tolerance.md.
"""

from .tolerance import (
    Event,
    FaultTolerance,
    Plan,
    check_group,
    is_failure,
    joining_member,
    layout,
    rank_local,
    recovery,
    supported,
)

__all__ = [
    "Event",
    "FaultTolerance",
    "Plan",
    "check_group",
    "is_failure",
    "joining_member",
    "layout",
    "rank_local",
    "recovery",
    "supported",
]
