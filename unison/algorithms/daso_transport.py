"""DASO's transport: the node and inter-node groups, and the weight syncs between nodes.

Gradients are averaged over a private copy of the node's group. Weights travel over one inter-node
group at a time (the processes of one local rank on every node), as differences from the last average
that group agreed on (the "anchor"), in the wire dtype; the member then broadcasts them in its node.
Syncs travel in flat buffers, cast slice by slice through a small scratch. See docs/algorithms.md#daso.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..engine import comm
from ..replica import Replica
from .hierarchical import check_uniform
from .state import State

SLICE = 1 << 20  #: elements per slice of the cast and add loops (the scratch stays in cache)


class Sync(comm.Finished):
    """A global sync in flight: ``wait()`` returns its average, in the views it lands in."""

    def __init__(self, works: list[Any], values: list[torch.Tensor]) -> None:
        super().__init__(values)
        self.works = works

    def wait(self) -> list[torch.Tensor]:
        while self.works:
            self.works.pop(0).wait()
        return super().wait()


def sliced(fn: Callable[..., Any], *flats: torch.Tensor) -> None:
    """``fn(*slices)`` over consecutive slices of at most SLICE elements of equally long 1-D tensors."""
    for i in range(0, flats[0].numel(), SLICE):
        fn(*(f[i : i + SLICE] for f in flats))


@dataclass(eq=False, repr=False, slots=True)
class Transport:
    """The groups DASO talks over, and the weight syncs between nodes.

    Args:
        params: the weights global syncs carry (the trainable parameters).
        grad_group: the node's group for gradients (None: one process per node).
        intra: the node's group for broadcasts (None: one process per node, or one node).
        inter: this rank's inter-node group (None: one node).
        local_rank, local_size, nodes: where this process sits.
        wire: the dtype syncs travel in (None: the weights' own, whole).
        chunk_elems: elements per collective (slices of the flat buffer).

    Example::

        t = Transport.build(replica, wire=torch.bfloat16, chunk_elems=10_000_000)
        t.start()  # at batch b, by local rank k; then t.receive(k, batches_to_wait=1) at b + 1, on every rank
    """

    params: list[torch.Tensor]
    grad_group: Optional[dist.ProcessGroup] = None
    intra: Optional[dist.ProcessGroup] = None
    inter: Optional[dist.ProcessGroup] = None
    local_rank: int = 0
    local_size: int = 1
    nodes: int = 1
    wire: Optional[torch.dtype] = None
    chunk_elems: int = 10_000_000
    inflight: Any = field(default=None, init=False)  # this rank's sync in flight (something with wait())
    relative: bool = field(default=False, init=False)  # whether it carries differences from the anchor
    anchor: Optional[list[torch.Tensor]] = field(default=None, init=False)  # the last average its group agreed on
    meter: State = field(default_factory=State, init=False)  # counts the bytes sent (DASO gives its state)
    buffers: dict[Optional[torch.dtype], Any] = field(default_factory=dict, init=False)  # Transport.flat's

    @classmethod
    def build(cls, replica: Replica, wire: Optional[torch.dtype], chunk_elems: int) -> "Transport":
        """Private copies of the node's group (gradients, broadcasts) and of this rank's inter-node group."""
        params: list[torch.Tensor] = [p for _, p in replica.trainable]
        if replica.group is None:
            return cls(params, wire=wire, chunk_elems=chunk_elems)
        topo = replica.topology
        if topo.world_size != dist.get_world_size():
            raise ValueError("daso needs the node layout: call unison.init() before building DataParallel")
        if replica.world_size != dist.get_world_size():
            raise ValueError("daso runs on the whole world; it cannot be combined with a process_group subset")
        check_uniform(replica, "daso")
        local_size, nodes, node = topo.local_world_size, topo.num_nodes, topo.intra_node_group
        grad = replica.private_group("daso/grad", node) if local_size > 1 else None
        intra = replica.private_group("daso/intra", node) if local_size > 1 and nodes > 1 else None
        inter = replica.private_group("daso/inter", topo.inter_node_group) if nodes > 1 else None
        return cls(params, grad, intra, inter, topo.local_rank, local_size, nodes, wire, chunk_elems)

    # ---- one global sync --------------------------------------------------
    def flat(self, dtype: Optional[torch.dtype]) -> tuple[list, list, list]:
        """(flat buffers, views shaped like the weights, each weight's scratch): one buffer per weight
        dtype and device, in ``dtype`` (None: the weights' own); kept if it is the wire's."""
        if dtype in self.buffers:
            return self.buffers[dtype]
        kind_of = [(p.dtype, p.device) for p in self.params]
        kinds = {k: [i for i, ki in enumerate(kind_of) if ki == k] for k in dict.fromkeys(kind_of)}
        flats: list[torch.Tensor] = []
        views: list[Any] = [None] * len(self.params)
        scratches: list[Any] = [None] * len(self.params)
        for (kind, device), idx in kinds.items():
            sizes = [self.params[i].numel() for i in idx]
            flats.append(torch.empty(sum(sizes), dtype=dtype or kind, device=device))
            scratch = torch.empty(min(SLICE, sum(sizes)), dtype=kind, device=device)
            for i, v in zip(idx, flats[-1].split(sizes)):
                views[i], scratches[i] = v.view(self.params[i].shape), scratch
        if dtype == self.wire:
            self.buffers[dtype] = (flats, views, scratches)
        return flats, views, scratches

    def start(self) -> None:
        """Launch this rank's part of its inter-node group's average (non-blocking). Cast, it carries
        the difference from the anchor; a group's first sync (no anchor yet) the weights, uncast."""
        relative, world = self.wire is not None and self.anchor is not None, dist.get_world_size(self.inter)
        flats, views, scratches = self.flat(self.wire if relative else None)
        with torch.no_grad():
            if not relative:
                torch._foreach_copy_(views, [p.detach() for p in self.params])
            anchor = (self.anchor or []) if relative else []
            for p, v, a, s in zip(self.params, views, anchor, scratches):  # p - anchor, cast
                sub = lambda w, x, y, s=s: w.copy_(torch.sub(x, y, out=s[: x.numel()]))  # noqa: E731
                sliced(sub, v.view(-1), p.reshape(-1), a.reshape(-1))
            parts = [part for f in flats for part in f.div_(world).split(self.chunk_elems)]
        works = [comm.start(dist.all_reduce, part, group=self.inter) for part in parts]
        sent = sum(comm.ring_bytes(part.numel() * part.element_size(), world) for part in parts)
        self.inflight, self.relative = Sync(works, views), relative
        self.meter.bytes_sent += sent

    def finish(self) -> list[torch.Tensor]:
        """The group's average from the sync in flight; it becomes the group's new anchor."""
        values, self.inflight = self.inflight.wait(), None
        if self.relative:  # anchor += the average difference, cast back slice by slice
            with torch.no_grad():
                for a, d, s in zip(self.anchor or [], values, self.flat(self.wire)[2]):
                    sliced(lambda x, y, s=s: x.add_(s[: y.numel()].copy_(y)), a.view(-1), d.reshape(-1))
            values = self.anchor
        if self.wire is not None:
            self.anchor = values  # a full-precision sync's buffer is not kept: the anchor owns it
        return values

    def drop(self) -> None:
        """Wait for this rank's sync in flight (its peers launched it too) and forget it."""
        if self.inflight is not None:
            self.inflight, _ = None, self.inflight.wait()

    def receive(self, local_rank: int, batches_to_wait: int) -> None:
        """The group of ``local_rank`` merges its stale average ``a`` into its weights ``x``
        as (2B x + P a) / (2B + P), and shares the result in its node (every rank calls it)."""
        if self.local_rank == local_rank and self.inflight is not None:
            two_b, nodes = 2.0 * batches_to_wait, float(self.nodes)
            with torch.no_grad():
                for p, a in zip(self.params, self.finish()):
                    p.mul_(two_b / (two_b + nodes)).add_(a, alpha=nodes / (two_b + nodes))
        self.broadcast(local_rank)

    def blocking(self, local_rank: int) -> None:
        """The group of ``local_rank`` replaces its weights by their average now, and shares
        it in each node: every replica is then identical (every rank calls it)."""
        if self.local_rank == local_rank:
            self.start()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.finish())
        self.broadcast(local_rank)

    def broadcast(self, local_rank: int) -> None:
        """Give the node's other processes the weights of its process ``local_rank``."""
        if self.intra is None:
            return
        comm.AsyncBroadcast(self.params, self.intra, source=local_rank).finish()
        if self.local_rank == local_rank:
            self.meter.bytes_sent += (self.local_size - 1) * sum(p.numel() * p.element_size() for p in self.params)

    # ---- state ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sync in flight and the anchor, so a resumed run merges it at the same batch. No new
        communication: a sync in flight is waited for (every peer launched it) and kept, not yet merged."""
        inflight = None
        if self.inflight is not None:  # values in the weights' dtype, as they were before syncs were kept flat
            values = [v.to(p.dtype, copy=True) for v, p in zip(self.inflight.wait(), self.params)]
            self.inflight = comm.Finished(values)
            inflight = {"values": values, "relative": self.relative}
        return {"inflight": inflight, "anchor": None if self.anchor is None else [a.clone() for a in self.anchor]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sync in flight and the anchor (without one, the next sync re-establishes it)."""
        self.drop()
        anchor, inflight = state.get("anchor"), state.get("inflight")
        self.anchor = None if anchor is None else [a.clone(memory_format=torch.contiguous_format) for a in anchor]
        self.inflight = None if inflight is None else comm.Finished([v.clone() for v in inflight["values"]])
        self.relative = bool(inflight and inflight["relative"])
