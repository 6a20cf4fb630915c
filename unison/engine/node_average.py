"""Two-level averaging for nodes of several processes: each node averages inside first
(a reduce-scatter over its fast link), each local rank carries its shard of the node's
mean across nodes with the algorithm's own scheme, and the node gathers the shards
back (an all-gather).

Every process's cross-node link is used and each carries 1/P of the values, so a
node's link carries one copy per node, not one per process. The cross-node leg is
the algorithm's (``average_shard``, a gossip exchange, 8-bit codes); this module
only scatters and gathers. See docs/algorithms.md (hierarchical variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from .averaging import average_async
from .buckets import split
from .comm import start, wait

# torch 2.13 names them ``*_single`` (the ``*_tensor`` names warn); older versions have only those.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Nodes:
    """Where the two legs run: the node's group (fast link) and this local rank's group across
    nodes (one process per node, ordered by node: its group rank is the node's index)."""

    intra: Optional[dist.ProcessGroup]
    inter: Optional[dist.ProcessGroup]
    local_rank: int
    local_size: int
    count: int  # nodes
    node: int  # this process's node


class Shards:
    """Tensors of one dtype and device, flattened into a buffer padded to a multiple of the
    node's processes; this local rank owns the piece ``[local_rank * size, (local_rank + 1) * size)``.

    ``scatter(values)`` leaves the node's mean of that piece in ``shard``; ``gather(piece)``
    writes every local rank's piece back into the buffer and returns it cut like the tensors.
    Buffers are allocated once: results are views, valid until the next call.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], nodes: Nodes) -> None:
        self.nodes, self.like = nodes, list(tensors)
        self.numel = sum(t.numel() for t in self.like)
        self.size = -(-self.numel // nodes.local_size)  # the shard's length (the last one padded)
        first = self.like[0]
        self.flat = torch.zeros(self.size * nodes.local_size, dtype=first.dtype, device=first.device)
        self.shard = torch.zeros(self.size, dtype=first.dtype, device=first.device)
        self.views = split(self.flat, self.like)
        self.intra_bytes = 0  # sent over the node's link by this process, so far

    @property
    def shard_nbytes(self) -> int:
        return self.size * self.shard.element_size()

    def scatter(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The node's mean of this rank's piece of ``values`` (laid out like the tensors), in ``shard``."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, [v.detach() for v in values])
            if self.nodes.local_size == 1:
                self.shard.copy_(self.flat)
                return self.shard
            self.flat.div_(self.nodes.local_size)
            wait(start(_REDUCE_SCATTER, self.shard, self.flat, group=self.nodes.intra))
        self.intra_bytes += (self.nodes.local_size - 1) * self.shard_nbytes
        return self.shard

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Every local rank's ``piece`` (this rank's given), joined; cut like the tensors (views)."""
        with torch.no_grad():
            if self.nodes.local_size == 1:
                self.flat.copy_(piece)
            else:
                wait(start(_ALL_GATHER, self.flat, piece.contiguous(), group=self.nodes.intra))
                self.intra_bytes += (self.nodes.local_size - 1) * self.shard_nbytes
        return self.views


def shards_of(tensors: Sequence[torch.Tensor], nodes: Nodes) -> tuple[list[Shards], list[int]]:
    """One ``Shards`` per dtype and device of ``tensors``, and the order that lists the tensors kind
    by kind (``values[i] for i in order`` is what the shards take, one kind after the other)."""
    kinds: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    order = [i for idx in kinds.values() for i in idx]
    return [Shards([tensors[i] for i in idx], nodes) for idx in kinds.values()], order


class NodeAverage:
    """The two-level average of ``tensors`` (any kinds): node mean, each piece averaged across
    nodes over this rank's cross-node group (``wire_dtype`` as ``average_async`` takes it, with
    ``feedback`` for 8-bit codes), gathered back. Blocking; run it on a ``CommThread`` to overlap.

    ``inter_bytes`` and ``intra_bytes`` count what this process sent across nodes and inside its node.

    Example::

        avg = NodeAverage(params, nodes)
        values = avg.run([p.detach() for p in params])  # every process of every node: the mean
    """

    def __init__(self, tensors: Sequence[torch.Tensor], nodes: Nodes) -> None:
        self.nodes, self.tensors = nodes, list(tensors)
        self.kinds, self.order = shards_of(tensors, nodes)
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
        if self.nodes.count == 1:
            return shard
        pending = average_async([shard], self.nodes.inter, wire_dtype, feedback)
        self.inter_bytes += pending.wire_bytes
        return pending.wait()[0]
