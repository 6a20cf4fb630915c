"""The hierarchical rounds of the streamed model-averaging algorithms (local_sgd,
decentralized, low_precision_decentralized, diloco with ``hierarchical=True``).

A round averages the fragment inside the node (reduce-scatter), runs the
algorithm's cross-node leg on this local rank's piece (an average, a gossip
exchange with the neighbour nodes, 8-bit differences), and gathers the pieces back
inside the node (``engine.node_average``). The three legs depend on each other, so a
round runs on one communication thread over private groups: its result is waited
for at the merge, as a flat round's is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..engine.comm import CommThread, Pending
from ..engine.hierarchy import TwoLevel
from ..engine.node_average import NodeAverage
from .state import State


class NodeRounds:
    """The two levels, the communication thread, and one ``NodeAverage`` (its buffers) per fragment.

    Args:
        levels: the two levels (``hierarchical.two_level``).
        fragments: per fragment, the tensors a round carries (their shapes and kinds).
        name: names the thread.

    Example::

        rounds = NodeRounds(levels, [params], "local_sgd")
        pending = rounds.average(state, 0, [p.detach().clone() for p in params])
        averaged = pending.wait()
    """

    def __init__(self, levels: TwoLevel, fragments: Sequence[Sequence[torch.Tensor]], name: str) -> None:
        self.levels = levels
        self.averages = [NodeAverage(f, levels) for f in fragments]
        self.thread: Optional[CommThread] = CommThread(f"unison-{name}-nodes")

    @property
    def inter_bytes(self) -> int:
        """Bytes this process sent across nodes so far."""
        return sum(a.inter_bytes for a in self.averages)

    @property
    def intra_bytes(self) -> int:
        """Bytes this process sent inside its node so far."""
        return sum(a.intra_bytes for a in self.averages)

    def submit(self, meter: State, fragment: int, fn: Callable[[NodeAverage], Any]) -> Pending:
        """Run ``fn(fragment's NodeAverage)`` on the thread; what it sends is added to ``meter.bytes_sent``."""
        if self.thread is None:
            raise RuntimeError("the hierarchical rounds were closed")
        avg = self.averages[fragment]

        def run() -> Any:
            before = avg.sent
            try:
                return fn(avg)
            finally:
                meter.bytes_sent += avg.sent - before

        return self.thread.submit(run)

    def average(
        self,
        meter: State,
        fragment: int,
        values: Sequence[torch.Tensor],
        wire_dtype: Union[torch.dtype, str, None] = None,
        feedback: Optional[torch.Tensor] = None,
    ) -> Pending:
        """The average of ``values`` (laid out like the fragment) over every process, in flight;
        ``wait()`` gives new tensors."""
        return self.submit(meter, fragment, lambda avg: [v.clone() for v in avg.run(values, wire_dtype, feedback)])

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()
            self.thread = None
