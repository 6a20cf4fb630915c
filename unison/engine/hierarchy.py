"""Two-level reduction over nodes: the one seam of every hierarchical algorithm (``hierarchical=True``).

A flat buffer is cut into one shard per local rank. Inside each node the shards
are summed at full precision with one reduce-scatter over the fast link; each
local rank then carries its shard (the node's sum of that part) across nodes
with the algorithm's own scheme (``cross``: a plain allreduce, a cast one, the
8-bit exchange, PowerSGD's factors) over the group of the processes with its
local rank on every node; one all-gather inside the node puts the result
together again. Every process uses its own link to the other nodes, and each
node sends the buffer across once, not once per process. The model-averaging
algorithms run the same legs on the weights (``average``, or ``mean_shards`` and
``join_shards`` around a cross-node step of their own), and DASO uses its groups.
``TwoLevel.build`` checks the layout and builds the groups; a ``TwoLevel`` also
counts what it sends and may own the thread its rounds run on.
See docs/algorithms.md#hierarchical-reduction.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist

from ..runtime import Topology
from . import comm
from .averaging import average_async
from .flat import Flats

# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``cross(shard, offset)``: sum ``shard`` (the node's sum of ``flat[offset:offset + len]``) across
#: nodes in place, blocking; every process of the same local rank calls it with the same sizes.
Cross = Callable[[torch.Tensor, int], object]

#: ``private_group(tag, group)``: a private copy of ``group`` for the caller's own collectives,
#: found again under ``tag`` (``Replica.private_group``).
PrivateGroup = Callable[[str, Optional[dist.ProcessGroup]], Optional[dist.ProcessGroup]]


class Meter(Protocol):
    """What counts an algorithm's bytes (its state)."""

    bytes_sent: int


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


def check_layout(topology: Topology, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Raise ValueError when ``what`` cannot use the node layout: none (``unison.init()`` not called),
    a process group that is not the whole world, or nodes running different numbers of processes."""
    if topology.world_size != dist.get_world_size():
        raise ValueError(f"{what} needs the node layout: call unison.init() before building DataParallel")
    if dist.get_world_size(group) != dist.get_world_size():
        raise ValueError(f"{what} runs on the whole world; it cannot be combined with a process_group subset")
    if not topology.uniform:
        raise ValueError(
            f"{what} needs the same number of processes on every node; the ranks' local world sizes "
            f"are {list(topology.local_sizes)}: launch as many processes per node everywhere, or pass hierarchical=False"
        )


class TwoLevel:
    """Reduce-scatter inside the node, the shard across nodes, all-gather inside the node.

    Args:
        intra: the processes of this node (a private group: run this on a CommThread; None with
            one process per node).
        inter: the processes of this local rank on every node (a private group too; None on one node).
        local_rank, local_size, nodes: where this process sits.
        node: this process's node (its rank in ``inter``: the node groups are ordered by node).
        thread: name a CommThread of its own to run rounds on (``submit``; ``close`` stops it).

    Buffers are kept per (buffer length, bounds, dtype, device) and reused: no
    allocation per step. ``run`` is blocking: ``submit`` it to the thread.
    ``intra_bytes`` and ``inter_bytes`` count what this process sent inside its
    node and across nodes (a cross-node step the algorithm writes adds its own).

    Example::

        two = TwoLevel(intra, inter, topo.local_rank, topo.local_world_size, topo.num_nodes, thread="mine")
        two.submit(two.run, bucket.flat, two.allreduce)
    """

    def __init__(
        self,
        intra: Optional[dist.ProcessGroup],
        inter: Optional[dist.ProcessGroup],
        local_rank: int,
        local_size: int,
        nodes: int,
        node: int = 0,
        thread: Optional[str] = None,
    ) -> None:
        self.intra, self.inter = intra, inter
        self.local_rank, self.local_size, self.nodes, self.node = local_rank, local_size, nodes, node
        # gloo's reduce-scatter takes twice as long as a reduce to each shard's owner (measured on CPU):
        # on gloo the first level is one reduce and one broadcast per shard, in place, with no scratch.
        self.by_owner = intra is not None and local_size > 1 and dist.get_backend(intra) == "gloo"
        self.owners = [comm.src_rank(intra, k) for k in range(local_size)] if self.by_owner else []
        self._buffers: dict[tuple, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self.intra_bytes = 0  # sent inside the node by this process, so far
        self.inter_bytes = 0  # sent across nodes by this process, so far
        self.thread: Optional[comm.CommThread] = comm.CommThread(f"unison-{thread}-nodes") if thread else None

    @classmethod
    def build(
        cls,
        topology: Topology,
        group: Optional[dist.ProcessGroup],
        private_group: PrivateGroup,
        name: str,
        tag: str = "hierarchical",
        thread: bool = False,
    ) -> Optional["TwoLevel"]:
        """The two levels of hierarchical algorithm ``name`` over the nodes, or None to run flat.

        Raises ValueError when the layout cannot support it (``check_layout``). Runs flat
        (returns None) alone, on a single node, where nothing crosses nodes, and with one
        process per node, where flat is what two levels would do (with a warning). Every
        rank calls it: it creates private groups (``tag + "/intra"``, ``tag + "/inter"``),
        and with ``thread`` the CommThread its rounds run on.
        """
        if group is None or dist.get_world_size(group) == 1:
            return None
        check_layout(topology, group, f"hierarchical {name}")
        if topology.num_nodes == 1:
            return None
        if topology.local_world_size == 1:
            warnings.warn(
                f"hierarchical {name} with one process per node is the flat algorithm: running flat", stacklevel=3
            )
            return None
        return cls.of(topology, private_group, tag, name if thread else None)

    @classmethod
    def of(cls, topology: Topology, private_group: PrivateGroup, tag: str, thread: Optional[str] = None) -> "TwoLevel":
        """The levels of ``topology`` as they are, unchecked: the node's group when a node has several
        processes and there are several nodes, the cross-node group when there are several nodes."""
        several = topology.local_world_size > 1 and topology.num_nodes > 1
        intra = private_group(tag + "/intra", topology.intra_node_group) if several else None
        inter = private_group(tag + "/inter", topology.inter_node_group) if topology.num_nodes > 1 else None
        nodes, size = topology.num_nodes, topology.local_world_size
        return cls(intra, inter, topology.local_rank, size, nodes, topology.node, thread)

    # ---- the thread ----------------------------------------------------------------
    @property
    def sent(self) -> int:
        """Bytes this process sent so far, both levels."""
        return self.intra_bytes + self.inter_bytes

    def submit(self, fn: Callable[..., Any], *args: Any, meter: Optional[Meter] = None) -> comm.Pending:
        """Run ``fn(*args)`` on the thread; with ``meter``, what the levels send meanwhile is added
        to ``meter.bytes_sent`` (only this thread sends over them)."""
        if self.thread is None:
            raise RuntimeError("these two levels have no thread (closed, or built without one)")
        if meter is None:
            return self.thread.submit(fn, *args)

        def counted() -> Any:
            before = self.sent
            try:
                return fn(*args)
            finally:
                meter.bytes_sent += self.sent - before

        return self.thread.submit(counted)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()
            self.thread = None

    # ---- one flat buffer -----------------------------------------------------------
    def bounds(self, numel: int) -> list[int]:
        """The default shards of ``numel`` values: equal, one per local rank."""
        return even_bounds(numel, self.local_size)

    def shard(self, bounds: Sequence[int]) -> tuple[int, int]:
        """This process's part ``[start, end)`` of a buffer cut at ``bounds``."""
        return bounds[self.local_rank], bounds[self.local_rank + 1]

    def shard_numel(self, numel: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Values of this process's shard of a buffer of ``numel`` (cut at ``bounds``, default even)."""
        start, end = self.shard(self.bounds(numel) if bounds is None else bounds)
        return end - start

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

    def allreduce(self, shard: torch.Tensor, offset: int = 0) -> None:
        """The plain cross-node step: sum the shard over the nodes at its own precision."""
        comm.wait(comm.start(dist.all_reduce, shard, group=self.inter))
        self.inter_bytes += comm.ring_bytes(shard.numel() * shard.element_size(), self.nodes)

    def scatter(self, flat: torch.Tensor, bounds: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The node's sum of this process's shard of ``flat`` (a view of ``flat`` or of a reused buffer,
        valid until the next call; ``flat`` itself is left partly summed)."""
        bounds = self.bounds(flat.numel()) if bounds is None else bounds
        start, end = self.shard(bounds)
        if self.local_size == 1:
            return flat[start:end]
        self.intra_bytes += self.leg_bytes(flat.numel(), flat.element_size(), bounds)
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
        if self.local_size > 1:
            self.intra_bytes += self.leg_bytes(flat.numel(), flat.element_size(), bounds)
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

    def leg_bytes(self, numel: int, itemsize: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Bytes this process sends inside its node for one leg (``scatter`` or ``gather``) of a buffer
        of ``numel`` values: ``(local_size - 1)`` shards of the widest's length."""
        bounds = self.bounds(numel) if bounds is None else bounds
        width = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
        return (self.local_size - 1) * width * itemsize

    def wire_bytes(self, flat: torch.Tensor, cross_bytes: int, bounds: Optional[Sequence[int]] = None) -> int:
        """Bytes this process sends for one ``run`` of ``flat``: both legs inside the node, plus
        ``cross_bytes`` (what its shard's crossing sends)."""
        return 2 * self.leg_bytes(flat.numel(), flat.element_size(), bounds) + cross_bytes

    # ---- tensors of any kinds (the model-averaging algorithms' weights) -------------------
    def flats(self, tensors: Sequence[torch.Tensor]) -> Flats:
        """Buffers for ``tensors`` (one per dtype and device), padded to equal shards, allocated once."""
        return Flats(tensors, multiple=self.local_size)

    def shards_numel(self, flats: Flats) -> int:
        """Values of this process's shards of ``flats``, every kind (the error feedback of 8-bit codes)."""
        return sum(self.shard_numel(part.flat.numel()) for part in flats.parts)

    def new_shards(self, flats: Flats) -> list[torch.Tensor]:
        """Zero tensors the size and kind of this process's shard of each of ``flats``' buffers (receive buffers)."""
        return [part.flat.new_zeros(self.shard_numel(part.flat.numel())) for part in flats.parts]

    def mean_shards(self, flats: Flats, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The node's mean of this process's shard of ``values`` (laid out like ``flats.tensors``), one
        per kind (views of reused buffers, valid until the next call)."""
        shards = []
        with torch.no_grad():
            flats.load(values)
            for part in flats.parts:
                if self.local_size > 1:
                    part.flat.div_(self.local_size)
                shards.append(self.scatter(part.flat))
        return shards

    def join_shards(self, flats: Flats, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every local rank's shards (this process's given, one per kind) joined, cut like
        ``flats.tensors``, in their order (views of the buffers)."""
        with torch.no_grad():
            for part, shard in zip(flats.parts, shards):
                self.gather(part.flat, shard)
        return flats.views

    def average(
        self,
        flats: Flats,
        values: Sequence[torch.Tensor],
        wire_dtype: Union[torch.dtype, str, None] = None,
        feedback: Optional[torch.Tensor] = None,
    ) -> list[torch.Tensor]:
        """The average of ``values`` over every process of every node (views of ``flats``): the node's
        mean, each shard averaged across nodes (``wire_dtype`` as ``average_async`` takes it, with
        ``feedback`` for 8-bit codes: ``shards_numel`` values), gathered back. Blocking."""
        pieces, first = [], 0
        for shard in self.mean_shards(flats, values):
            fb = feedback[first : first + shard.numel()] if feedback is not None else None
            first += shard.numel()
            pieces.append(self.cross_average(shard, wire_dtype, fb))
        return self.join_shards(flats, pieces)

    def cross_average(
        self,
        shard: torch.Tensor,
        wire_dtype: Union[torch.dtype, str, None] = None,
        feedback: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``shard`` averaged over this process's cross-node group (one process per node)."""
        if self.nodes == 1:
            return shard
        pending = average_async([shard], self.inter, wire_dtype, feedback)
        self.inter_bytes += pending.wire_bytes
        return pending.wait()[0]
