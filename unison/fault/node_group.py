"""A process group over this node's processes that lives as long as the node, under fault tolerance.

Every membership of a fault-tolerant job builds torch.distributed's default group again, and
``destroy_process_group`` destroys every group torch knows of. A model sharded by FSDP2 over the
node's processes keeps the group it was sharded over (its DeviceMesh and DTensors resolve it by
name), and the node's processes fail, leave and come back together: so the node's group must
outlive the memberships. ``NodeGroup`` is that group: built once, over the node's ranks of the
membership that admitted the node, and around each rebuild of the default group taken out of
torch's registry (``detach``) and put back with the global ranks of the new membership
(``attach``), its connections untouched.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch.distributed as dist

from ..runtime import torch_private


class NodeGroup:
    """This node's processes as one group, kept across memberships.

    Args:
        local_rank, local_world_size: this process's place in its node; the node's processes hold
            consecutive ranks in local-rank order in every membership.
        timeout: the backstop timeout of its collectives.

    Built by every process of the node at once (``use_local_synchronization``: nobody else takes
    part), in a membership that holds the node.
    """

    def __init__(self, local_rank: int, local_world_size: int, timeout: datetime.timedelta) -> None:
        self.local_rank, self.local_world_size = local_rank, local_world_size
        first = dist.get_rank() - local_rank
        ranks = list(range(first, first + local_world_size))
        self.group: Any = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        self._saved: Optional[dict[str, Any]] = None

    def detach(self) -> None:
        """Take the group out of torch's registries, before the default group is destroyed (which
        shuts down and forgets every group registered)."""
        if self._saved is None:
            self._saved = torch_private.unregister_group(self.group)

    def attach(self) -> None:
        """Put the group back into torch's registries once a new default group is built, with
        the node's global ranks in it (this process's rank minus its local rank, onwards)."""
        if self._saved is None:
            return
        first = dist.get_rank() - self.local_rank
        torch_private.register_group(self.group, self._saved, {first + i: i for i in range(self.local_world_size)})
        self._saved = None
