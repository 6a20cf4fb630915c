"""Two-level averaging of model weights for nodes of several processes: the buffers of the
hierarchical model-averaging algorithms on ``hierarchy.TwoLevel``'s two legs.

Each node averages inside first (``TwoLevel.scatter``), each local rank carries its shard
of the node's mean across nodes with the algorithm's own scheme, and the node gathers
the shards back (``TwoLevel.gather``), the layout every hierarchical algorithm uses.
This module keeps the weights' buffers (one per dtype and device, padded to equal
shards) and the plain cross-node leg (``average_shard``); a gossip exchange or 8-bit
codes are the algorithm's. See docs/algorithms.md#hierarchical-reduction.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .averaging import average_async
from .buckets import split
from .hierarchy import TwoLevel


class Shards:
    """Tensors of one dtype and device, flattened into a buffer padded to a multiple of the
    node's processes; this local rank owns the piece ``[local_rank * size, (local_rank + 1) * size)``.

    ``scatter(values)`` gives the node's mean of that piece; ``gather(piece)`` writes every
    local rank's piece back into the buffer and returns it cut like the tensors. Both legs
    are ``levels``' (``TwoLevel.scatter`` and ``gather``). Buffers are allocated once:
    results are views, valid until the next call.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], levels: TwoLevel) -> None:
        self.levels, self.like = levels, list(tensors)
        self.numel = sum(t.numel() for t in self.like)
        self.size = -(-self.numel // levels.local_size)  # the shard's length (the last one padded)
        first = self.like[0]
        self.flat = torch.zeros(self.size * levels.local_size, dtype=first.dtype, device=first.device)
        self.views = split(self.flat, self.like)
        self.intra_bytes = 0  # sent over the node's link by this process, so far

    @property
    def shard_nbytes(self) -> int:
        return self.size * self.flat.element_size()

    def new_shard(self) -> torch.Tensor:
        """A zero tensor the size and kind of this rank's piece (a receive buffer)."""
        return self.flat.new_zeros(self.size)

    def scatter(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The node's mean of this rank's piece of ``values`` (laid out like the tensors)."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, [v.detach() for v in values])
            if self.levels.local_size > 1:
                self.flat.div_(self.levels.local_size)
            shard = self.levels.scatter(self.flat)
        self.intra_bytes += (self.levels.local_size - 1) * self.shard_nbytes
        return shard

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Every local rank's ``piece`` (this rank's given), joined; cut like the tensors (views)."""
        with torch.no_grad():
            self.levels.gather(self.flat, piece)
        self.intra_bytes += (self.levels.local_size - 1) * self.shard_nbytes
        return self.views


def shards_of(tensors: Sequence[torch.Tensor], levels: TwoLevel) -> tuple[list[Shards], list[int]]:
    """One ``Shards`` per dtype and device of ``tensors``, and the order that lists the tensors kind
    by kind (``values[i] for i in order`` is what the shards take, one kind after the other)."""
    kinds: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    order = [i for idx in kinds.values() for i in idx]
    return [Shards([tensors[i] for i in idx], levels) for idx in kinds.values()], order


class NodeAverage:
    """The two-level average of ``tensors`` (any kinds) over ``levels``: node mean, each piece averaged
    across nodes over this rank's cross-node group (``wire_dtype`` as ``average_async`` takes it, with
    ``feedback`` for 8-bit codes), gathered back. Blocking; run it on a ``CommThread`` to overlap.

    ``inter_bytes`` and ``intra_bytes`` count what this process sent across nodes and inside its node.

    Example::

        avg = NodeAverage(params, levels)
        values = avg.run([p.detach() for p in params])  # every process of every node: the mean
    """

    def __init__(self, tensors: Sequence[torch.Tensor], levels: TwoLevel) -> None:
        self.levels, self.tensors = levels, list(tensors)
        self.kinds, self.order = shards_of(tensors, levels)
        self.inter_bytes = 0

    @property
    def intra_bytes(self) -> int:
        return sum(k.intra_bytes for k in self.kinds)

    @property
    def sent(self) -> int:
        """Bytes this process sent so far, both legs."""
        return self.intra_bytes + self.inter_bytes

    @property
    def feedback_numel(self) -> int:
        """Values of the error feedback of 8-bit codes: one per value of this rank's pieces."""
        return sum(k.size for k in self.kinds)

    def scatter(self, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The node's mean of this rank's pieces, one per kind."""
        out, first = [], 0
        for k in self.kinds:
            out.append(k.scatter([values[i] for i in self.order[first : first + len(k.like)]]))
            first += len(k.like)
        return out

    def gather(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The pieces of every local rank joined, cut like the tensors, in their order (views)."""
        joined = [v for k, piece in zip(self.kinds, pieces) for v in k.gather(piece)]
        out: list[Optional[torch.Tensor]] = [None] * len(joined)
        for i, v in zip(self.order, joined):
            out[i] = v
        return out  # type: ignore[return-value]  # every position filled

    def run(
        self,
        values: Sequence[torch.Tensor],
        wire_dtype: Union[torch.dtype, str, None] = None,
        feedback: Optional[torch.Tensor] = None,
    ) -> list[torch.Tensor]:
        """The average of ``values`` over every process of every node (views of reused buffers)."""
        pieces, first = [], 0
        for shard in self.scatter(values):
            fb = feedback[first : first + shard.numel()] if feedback is not None else None
            first += shard.numel()
            pieces.append(self.average_shard(shard, wire_dtype, fb))
        return self.gather(pieces)

    def average_shard(
        self, shard: torch.Tensor, wire_dtype: Union[torch.dtype, str, None], feedback: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``shard`` averaged over this rank's cross-node group (one per node)."""
        if self.levels.nodes == 1:
            return shard
        pending = average_async([shard], self.levels.inter, wire_dtype, feedback)
        self.inter_bytes += pending.wire_bytes
        return pending.wait()[0]
