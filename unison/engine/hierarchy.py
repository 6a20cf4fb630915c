"""Two-level reduction over nodes: the seam every hierarchical gradient algorithm reduces through.

A flat buffer is cut into one shard per local rank. Inside each node the shards
are summed at full precision with one reduce-scatter over the fast link; each
local rank then carries its shard (the node's sum of that part) across nodes
with the algorithm's own scheme (``cross``: a plain allreduce, a cast one, the
8-bit exchange, PowerSGD's factors) over the group of the processes with its
local rank on every node; one all-gather inside the node puts the result
together again. Every process uses its own link to the other nodes, and each
node sends the buffer across once, not once per process. See
docs/algorithms.md#hierarchical-reduction.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import comm

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``cross(shard, offset)``: sum ``shard`` (the node's sum of ``flat[offset:offset + len]``) across
#: nodes in place, blocking; every process of the same local rank calls it with the same sizes.
Cross = Callable[[torch.Tensor, int], object]


def even_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` offsets cutting ``numel`` values into parts of ``ceil(numel / parts)`` (the last shorter)."""
    width = -(-numel // parts) if parts else 0
    return [min(numel, k * width) for k in range(parts + 1)]


def aligned_bounds(sizes: Sequence[int], parts: int) -> list[int]:
    """``parts + 1`` offsets cutting consecutive tensors of ``sizes`` into ``parts`` runs of about equal
    length, only between tensors (a shard of whole matrices, for PowerSGD); a run may be empty."""
    ends = [0]
    for n in sizes:
        ends.append(ends[-1] + n)
    bounds = [0]
    for k in range(1, parts):
        target = ends[-1] * k / parts
        bounds.append(max(bounds[-1], min(ends, key=lambda e: abs(e - target))))
    return bounds + [ends[-1]]


class TwoLevel:
    """Reduce-scatter inside the node, the shard across nodes, all-gather inside the node.

    Args:
        intra: the processes of this node (a private group: run this on a CommThread).
        inter: the processes of this local rank on every node (a private group too).
        local_rank, local_size, nodes: where this process sits.
        node: this process's node (its rank in ``inter``: the node groups are ordered by node).

    Buffers are kept per (buffer length, bounds, dtype, device) and reused: no
    allocation per step. ``run`` is blocking: submit it to a ``CommThread``.

    Example::

        two = TwoLevel(intra, inter, topo.local_rank, topo.local_world_size, topo.num_nodes)
        thread.submit(two.run, bucket.flat, lambda shard, _: dist.all_reduce(shard, group=inter))
    """

    def __init__(
        self,
        intra: Optional[dist.ProcessGroup],
        inter: Optional[dist.ProcessGroup],
        local_rank: int,
        local_size: int,
        nodes: int,
        node: int = 0,
    ) -> None:
        self.intra, self.inter = intra, inter
        self.local_rank, self.local_size, self.nodes, self.node = local_rank, local_size, nodes, node
        # gloo's reduce-scatter takes twice as long as a reduce to each shard's owner (measured on CPU):
        # on gloo the first level is one reduce and one broadcast per shard, in place, with no scratch.
        self.by_owner = intra is not None and local_size > 1 and dist.get_backend(intra) == "gloo"
        self.owners = [comm.src_rank(intra, k) for k in range(local_size)] if self.by_owner else []
        self._buffers: dict[tuple, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}

    def bounds(self, numel: int) -> list[int]:
        """The default shards of ``numel`` values: equal, one per local rank."""
        return even_bounds(numel, self.local_size)

    def shard(self, bounds: Sequence[int]) -> tuple[int, int]:
        """This process's part ``[start, end)`` of a buffer cut at ``bounds``."""
        return bounds[self.local_rank], bounds[self.local_rank + 1]

    def _scratch(self, flat: torch.Tensor, bounds: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The shard buffer (the widest shard's length) and a padded receive buffer per narrower shard."""
        key = (flat.numel(), tuple(bounds), flat.dtype, flat.device)
        if key not in self._buffers:
            sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            width = max(sizes)
            pads = {k: flat.new_empty(width) for k, n in enumerate(sizes) if n != width}
            self._buffers[key] = (flat.new_empty(width), pads)
        return self._buffers[key]

    def run(self, flat: torch.Tensor, cross: Cross, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Sum ``flat`` over every process in place, the node's sums crossing nodes by ``cross``; returns ``flat``."""
        bounds = self.bounds(flat.numel()) if bounds is None else bounds
        if flat.numel() == 0:
            return flat
        start, end = self.shard(bounds)
        shard = self.scatter(flat, bounds)
        if self.nodes > 1 and end > start:
            cross(shard, start)
        return self.gather(flat, shard, bounds)

    def scatter(self, flat: torch.Tensor, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The node's sum of this process's shard of ``flat`` (a view of ``flat`` or of a reused buffer,
        valid until the next call; ``flat`` itself is left partly summed)."""
        bounds = self.bounds(flat.numel()) if bounds is None else bounds
        start, end = self.shard(bounds)
        if self.local_size == 1:
            return flat[start:end]
        if self.by_owner:  # each shard reduced onto its owner, in place
            for work in [comm.start(dist.reduce, p, dst=o, group=self.intra) for o, p in self._owned(flat, bounds)]:
                comm.wait(work)
            return flat[start:end]
        shard, pads = self._scratch(flat, bounds)
        if not pads:  # equal shards: the single-tensor collective, no list to pack or unpack
            comm.wait(comm.start(_reduce_scatter, shard, flat, group=self.intra))
            return shard
        parts = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        comm.wait(comm.start(dist.reduce_scatter, shard[: end - start], parts, group=self.intra))
        return shard[: end - start]

    def gather(self, flat: torch.Tensor, shard: torch.Tensor, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Write every local rank's shard into ``flat`` (this process's is ``shard``: the one ``scatter``
        returned, changed in place or not, or any tensor of its length); returns ``flat``."""
        bounds = self.bounds(flat.numel()) if bounds is None else bounds
        start, end = self.shard(bounds)
        mine = flat[start:end]
        if self.local_size == 1 or self.by_owner:
            if shard.data_ptr() != mine.data_ptr():
                mine.copy_(shard)
            if self.local_size == 1:
                return flat
            for work in [comm.start(dist.broadcast, p, src=o, group=self.intra) for o, p in self._owned(flat, bounds)]:
                comm.wait(work)
            return flat
        scratch, pads = self._scratch(flat, bounds)
        if shard.data_ptr() != scratch.data_ptr():
            scratch[: end - start].copy_(shard)
        if not pads:
            comm.wait(comm.start(_all_gather, flat, scratch, group=self.intra))
            return flat
        parts = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        outputs = [pads.get(k, part) for k, part in enumerate(parts)]
        comm.wait(comm.start(dist.all_gather, outputs, scratch, group=self.intra))
        for k, pad in pads.items():
            parts[k].copy_(pad[: parts[k].numel()])
        return flat

    def _owned(self, flat: torch.Tensor, bounds: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """(its owner's group rank in ``intra``, the shard) for every shard that is not empty."""
        return [(self.owners[k], flat[a:b]) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]

    def intra_bytes(self, numel: int, itemsize: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Bytes this process sends inside its node for one ``run``: its share of the reduce-scatter
        and of the all-gather (each ``(local_size - 1)`` shards of the widest's length)."""
        bounds = self.bounds(numel) if bounds is None else bounds
        width = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
        return 2 * (self.local_size - 1) * width * itemsize
