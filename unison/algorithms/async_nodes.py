"""The hierarchical round of "async" (``hierarchical=True``): the snapshots are averaged
inside the node, each local rank averages its shard with the other nodes', and the node
gathers the shards (``engine.node_average``), all on the averaging thread."""

from __future__ import annotations

from typing import Sequence

import torch

from ..engine.hierarchy import TwoLevel
from ..engine.node_average import NodeAverage
from .averaging_thread import FlatRound


class NodeRound(FlatRound):
    """``FlatRound``'s snapshot and average buffers, averaged in two levels over ``levels``.

    ``launch`` runs the three legs (blocking: the averaging thread calls it, and each leg
    waits for the one before); ``wire_bytes`` is what the last round sent, both legs.
    """

    def __init__(self, params: Sequence[torch.Tensor], levels: TwoLevel) -> None:
        super().__init__(params, levels.intra)
        self.node = NodeAverage(self.snap_views, levels)

    def launch(self) -> "NodeRound":
        before = self.node.sent
        torch._foreach_copy_(self.delta_views, self.node.run(self.snap_views))
        self.wire_bytes = self.node.sent - before
        return self

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass
