"""DASO: Distributed Asynchronous and Selective Optimization (Coquelin et al., 2022).

Gradients are averaged synchronously inside each node; across nodes the
replicas exchange their weights, rarely, with non-blocking collectives whose
result is merged a few batches later. One module, three parts: ``Schedule``
says when (phases, skips, the plateau rule; pure bookkeeping), ``Transport``
moves the weights, ``DASO`` wires them to the events. See docs/algorithms.md#daso.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ...engine import comm
from ...engine.buckets import MB
from ...engine.codecs import WIRE_DTYPES
from ...engine.codecs import wire_dtype as to_wire_dtype
from ...engine.codecs.schedule import WHOLE, schedule_for
from ...engine.comm import ring_bytes
from ...engine.flat import Flats, by_kind, split
from ...engine.hierarchy import TwoLevel, check_layout
from ...replica import Replica
from .. import options
from ..contract import Algorithm, Recovery, State

log = logging.getLogger("unison.daso")

#: HeAT's plateau patience: the loss is stable after PATIENCE + 1 epochs in a row without improvement.
PATIENCE = 2

#: global_skip on entering the cycling phase (HeAT's constant), capped by max_global_skips.
FIRST_GLOBAL_SKIP = 4

#: What ``Schedule.state_dict`` keeps, apart from the sync in flight.
SAVED = tuple(
    "epoch batch batches global_skip local_skip batches_to_wait send_rank "
    "plateau_best plateau_bad syncs_sent syncs_received syncs_blocking".split()
)

#: The schedule's settings (its options).
SETTINGS = tuple(
    "warmup_epochs cooldown_epochs total_epochs max_global_skips skip_reduction_factor "
    "local_skip_factor stability_level local_size nodes".split()
)


@dataclass(frozen=True)
class PendingSync:
    """A non-blocking global sync started by the group of ``local_rank``, merged at batch ``receive_at``."""

    local_rank: int
    batches_to_wait: int
    receive_at: int


class Plan(NamedTuple):
    """What a batch's end does: a blocking sync of local rank ``blocking``'s group, or merge, then send."""

    blocking: Optional[int] = None
    merge: Optional[PendingSync] = None
    send: Optional[PendingSync] = None


class Schedule:
    """DASO's epochs and batches: when nodes sync, and how often.

    Args:
        warmup_epochs, cooldown_epochs, total_epochs: the blocking phases
            (``total_epochs`` None: no cool-down).
        max_global_skips, skip_reduction_factor, local_skip_factor,
        stability_level: the skip schedule and the plateau rule (HeAT's).
        local_size: processes per node (the inter-node groups rotate over them).
        nodes: nodes; with one there are no global syncs.

    Example::

        s = Schedule(warmup_epochs=1, cooldown_epochs=0, total_epochs=None, nodes=2)
        s.end_batch(), s.end_epoch(1.0)  # Plan(blocking=0): the warm-up syncs every batch; then cycling
    """

    __slots__ = (*SETTINGS, *SAVED, "pending_sync")

    def __init__(
        self,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        total_epochs: Optional[int] = None,
        max_global_skips: int = 8,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        stability_level: float = 0.05,
        local_size: int = 1,
        nodes: int = 1,
    ) -> None:
        self.warmup_epochs, self.cooldown_epochs, self.total_epochs = warmup_epochs, cooldown_epochs, total_epochs
        self.max_global_skips, self.skip_reduction_factor = max_global_skips, skip_reduction_factor
        self.local_skip_factor, self.stability_level = local_skip_factor, stability_level
        self.local_size, self.nodes = local_size, nodes
        self.epoch = 0  # epochs ended
        self.batch = 0  # batches ended in the current epoch
        self.batches = 0  # batches ended in all
        self.global_skip = self.local_skip = self.batches_to_wait = 0
        self.send_rank = 0  # local rank whose inter-node group syncs next
        self.pending_sync: Optional[PendingSync] = None
        self.plateau_best, self.plateau_bad = math.inf, 0
        self.syncs_sent = self.syncs_received = self.syncs_blocking = 0
        self._enter_epoch(None)

    # ---- phases ---------------------------------------------------------
    def blocking_epoch(self, e: int) -> bool:
        """Whether epoch ``e`` is in the warm-up or the cool-down."""
        cooling = self.total_epochs is not None and e >= self.total_epochs - self.cooldown_epochs
        return e < self.warmup_epochs or cooling

    @property
    def global_syncs(self) -> bool:
        """Whether there are other nodes to sync with."""
        return self.nodes > 1

    def sync_gradients(self) -> bool:
        """Whether the node averages gradients this batch: every ``local_skip``-th of a cycling epoch, else always."""
        if not self.global_syncs or self.global_skip == 0 or self.local_skip <= 1:
            return True
        return self.batch % self.local_skip == 0

    # ---- batches ----------------------------------------------------------
    def rotate(self) -> int:
        """The local rank whose inter-node group syncs now; the next sync goes to the next one."""
        k = self.send_rank % self.local_size
        self.send_rank = (k + 1) % self.local_size
        return k

    def blocking_sync(self) -> int:
        """Count a blocking sync; the local rank of the group that runs it."""
        self.syncs_blocking += 1
        return self.rotate()

    def end_batch(self) -> Plan:
        """One batch ended: what it does (blocking sync, or merge and send), then count it."""
        b, plan = self.batch, Plan()
        if self.global_syncs and self.global_skip == 0:
            plan = Plan(blocking=self.blocking_sync())
        elif self.global_syncs:
            merge = send = None
            if self.pending_sync is not None and self.pending_sync.receive_at <= b:
                merge, self.pending_sync = self.pending_sync, None
                self.syncs_received += 1
            if b % self.global_skip == 0:
                wait = min(max(1, self.batches_to_wait), self.global_skip)
                send = self.pending_sync = PendingSync(self.rotate(), wait, b + wait)
                self.syncs_sent += 1
            plan = Plan(None, merge, send)
        self.batch += 1
        self.batches += 1
        return plan

    # ---- epochs -----------------------------------------------------------
    def end_epoch(self, loss: Optional[float]) -> Optional[int]:
        """The epoch ended with ``loss`` (averaged over the ranks): set the next epoch's skips.

        Returns the local rank of the group whose blocking sync realigns the
        replicas after a cycling epoch (None when there is none); a sync in
        flight is dropped.
        """
        k = self.blocking_sync() if self.global_syncs and self.global_skip > 0 else None
        self.pending_sync = None
        self.epoch += 1
        self.batch = 0
        self._enter_epoch(loss)
        return k

    def _enter_epoch(self, loss: Optional[float]) -> None:
        """Set the skips for epoch ``self.epoch`` from its phase and the last epoch's loss."""
        if self.blocking_epoch(self.epoch):
            self.global_skip = self.local_skip = self.batches_to_wait = 0
            return
        if self.global_skip == 0:
            self.global_skip = min(FIRST_GLOBAL_SKIP, self.max_global_skips)
            self.local_skip = self.batches_to_wait = 1
        if loss is None or not self.stable(loss):
            return
        factor = self.skip_reduction_factor
        if self.global_skip > 1:
            self.global_skip = max(1, self.global_skip // factor)
            self.local_skip = max(1, self.local_skip // factor)
            self.batches_to_wait = max(1, self.batches_to_wait - 1)
        else:
            self.global_skip = self.max_global_skips
            self.local_skip = self.batches_to_wait = max(1, self.max_global_skips // self.local_skip_factor)

    def stable(self, loss: float) -> bool:
        """Plateau detection: True after PATIENCE + 1 epochs in a row without a relative
        improvement of ``stability_level`` (the count then restarts)."""
        best, level = self.plateau_best, self.stability_level
        if loss < (best * (1 - level) if best >= 0 else best * (1 + level)):
            self.plateau_best, self.plateau_bad = loss, 0
        else:
            self.plateau_bad += 1
        if self.plateau_bad > PATIENCE:
            self.plateau_bad = 0
            return True
        return False

    # ---- state ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {key: getattr(self, key) for key in SAVED}
        state["pending_sync"] = None if self.pending_sync is None else asdict(self.pending_sync)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(SAVED) - set(state))
        if missing:
            raise ValueError(f"daso state is missing {missing}")
        for key in SAVED:
            setattr(self, key, float(state[key]) if key == "plateau_best" else int(state[key]))
        pending = state.get("pending_sync")
        self.pending_sync = None if pending is None else PendingSync(**pending)


SLICE = 1 << 20  #: elements per slice of the cast and add loops (their transient stays small)


class Sync(comm.Finished):
    """A global sync in flight: ``wait()`` returns its payload (a ``Wire``, or the average's views)."""

    def __init__(self, works: list[Any], payload: Any) -> None:
        super().__init__(payload)
        self.works = works

    def wait(self) -> Any:
        while self.works:
            comm.wait(self.works.pop(0))  # comm's: the completed works (and the buffers they hold) are let go
        return super().wait()


def sliced(fn: Callable[..., Any], *flats: torch.Tensor) -> None:
    """``fn(*slices)`` over consecutive slices of at most SLICE elements of equally long 1-D tensors."""
    for i in range(0, flats[0].numel(), SLICE):
        fn(*(f[i : i + SLICE] for f in flats))


class Wire:
    """One sync's message: ``tensors``' differences from an anchor, cast to ``dtype``, laid end to end
    (per dtype and device) in pieces of at most ``piece_elems`` values. Made when a sync starts and
    dropped once it is merged: nothing is kept between syncs.

    Two schedules (see ``unison/engine/codecs/schedule.py``), the same pieces (sizes, order, dtype)
    and the same values bit for bit, so ranks on different schedules still agree:

    - ``"blocked"`` (the CPU's): separate pieces, filled and added back segment by segment in slices
      of ``SLICE`` values, so the transients stay small and in cache.
    - ``"whole"`` (every other device's): the pieces are views of one flat buffer per kind (dtype and
      device), so that on a GPU, where each kernel launch costs ~10 us, ``load`` and ``add_to`` issue
      the same ops for 4M values as for 64M: per kind, ``load`` one ``_foreach_sub`` and one ``cat``
      that casts, ``add_to`` one cast and one ``_foreach_add_`` (a wire wider than the targets: a
      ``cat``, an ``add``, a cast and a ``_foreach_copy_``). Only view ops, which launch no kernel,
      grow with the number of tensors (and one copy per tensor that is not contiguous). It holds
      work buffers of the tensors' size while ``load`` or ``add_to`` runs.

    Args:
        tensors: the tensors the message carries (their kinds, shapes and order).
        dtype: the wire dtype.
        piece_elems: values per piece at most.
        schedule: ``"blocked"`` or ``"whole"`` (default: ``schedule_for`` the first tensor's device).

    Example::

        w = Wire(params, torch.bfloat16, piece_elems=1 << 20)
        w.load(params, minus=anchor)  # params - anchor, cast
        for piece in w.pieces: dist.all_reduce(piece.div_(world))
        w.add_to(anchor)              # anchor += the average difference
    """

    def __init__(
        self, tensors: list[torch.Tensor], dtype: torch.dtype, piece_elems: int, schedule: Optional[str] = None
    ) -> None:
        self.schedule = schedule_for(tensors[0].device if tensors else "cpu", schedule)
        self.kinds = by_kind(tensors)
        self.pieces: list[torch.Tensor] = []
        # whole: the flat buffer of each kind, of which its pieces are views
        self.flats: list[torch.Tensor] = []
        # blocked: (tensor, its first and end element, piece, the first element in the piece)
        self.segments: list[tuple[int, int, int, int, int]] = []
        for idx in self.kinds:
            first, base, offset = tensors[idx[0]], len(self.pieces), 0
            total = sum(tensors[i].numel() for i in idx)
            if self.schedule == WHOLE:
                self.flats.append(torch.empty(total, dtype=dtype, device=first.device))
                self.pieces += list(self.flats[-1].split(piece_elems)) if total else []
                continue
            self.pieces += [
                torch.empty(min(piece_elems, total - at), dtype=dtype, device=first.device)
                for at in range(0, total, piece_elems)
            ]
            for i in idx:
                n, at = tensors[i].numel(), 0
                while at < n:
                    k, o = divmod(offset + at, piece_elems)
                    take = min(n - at, piece_elems - o)
                    self.segments.append((i, at, at + take, base + k, o))
                    at += take
                offset += n

    def load(self, values: list[torch.Tensor], minus: list[torch.Tensor]) -> None:
        """Write ``values - minus`` (tensors shaped alike), computed in the values' dtype, then cast."""
        if self.schedule == WHOLE:
            for idx, buf in zip(self.kinds, self.flats):
                diff = torch._foreach_sub([values[i] for i in idx], [minus[i] for i in idx])
                torch.cat([d.reshape(-1) for d in diff], out=buf)  # cast as it is written
            return
        flat = [v.reshape(-1) for v in values]
        less = [m.reshape(-1) for m in minus]
        for i, a, b, k, o in self.segments:
            sub = lambda w, x, y: torch.sub(x, y, out=w)  # noqa: E731  # computed in x's dtype, then cast
            sliced(sub, self.pieces[k][o : o + b - a], flat[i][a:b], less[i][a:b])

    def add_to(self, targets: list[torch.Tensor]) -> None:
        """``targets += the pieces' values`` (contiguous tensors shaped and typed like the message's),
        each sum computed in the wider of the targets' and the wire's dtypes."""
        if self.schedule == WHOLE:
            for idx, buf in zip(self.kinds, self.flats):
                into = [targets[i] for i in idx]
                if not into or buf.numel() == 0:
                    continue
                kind = into[0].dtype
                if torch.promote_types(kind, buf.dtype) == kind:  # the usual case: a wire no wider
                    torch._foreach_add_(into, split(buf.to(kind), into))
                else:  # a wider wire: the sums in the wider dtype, then narrowed (what add_ does)
                    sums = torch.add(buf, torch.cat([t.view(-1) for t in into]))
                    torch._foreach_copy_(into, split(sums.to(kind), into))
            return
        flat = [t.view(-1) for t in targets]
        for i, a, b, k, o in self.segments:
            sliced(lambda t, d: t.add_(d), flat[i][a:b], self.pieces[k][o : o + b - a])

    def tensors(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The message as new tensors shaped and typed like ``like`` (what a checkpoint saves)."""
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
        if self.schedule == WHOLE:
            for idx, buf in zip(self.kinds, self.flats):
                views = [out[i].view(-1) for i in idx]
                for view, part in zip(views, buf.split([v.numel() for v in views])):
                    view.copy_(part)
            return out
        flat = [t.view(-1) for t in out]
        for i, a, b, k, o in self.segments:
            flat[i][a:b].copy_(self.pieces[k][o : o + b - a])
        return out


@dataclass(eq=False, repr=False, slots=True)
class Transport:
    """The groups DASO talks over, and the weight syncs between nodes.

    Args:
        params: the weights global syncs carry (the trainable parameters).
        grad_group: the node's group for gradients (None: one process per node).
        levels: the node layout: its ``intra`` group for broadcasts (None: one process per node,
            or one node), this rank's ``inter`` group (None: one node), where this process sits.
        wire: the dtype syncs travel in (None: the weights' own, whole).
        chunk_elems: elements per collective (slices of the flat buffer).
        piece_bytes: a cast sync's message is made in pieces of at most this many of the weights'
            bytes (a gradient bucket's), for the sync only.

    Example::

        t = Transport.build(replica, wire=torch.bfloat16, chunk_elems=10_000_000)
        t.start()  # at batch b, by local rank k; then t.receive(k, batches_to_wait=1) at b + 1, on every rank
    """

    params: list[torch.Tensor]
    grad_group: Optional[dist.ProcessGroup] = None
    levels: TwoLevel = field(default_factory=lambda: TwoLevel(None, None, 0, 1, 1))
    wire: Optional[torch.dtype] = None
    chunk_elems: int = 10_000_000
    piece_bytes: int = 25 * MB
    inflight: Any = field(default=None, init=False)  # this rank's sync in flight (something with wait())
    relative: bool = field(default=False, init=False)  # whether it carries differences from the anchor
    anchor: Optional[list[torch.Tensor]] = field(default=None, init=False)  # the last average its group agreed on
    meter: State = field(default_factory=State, init=False)  # counts the bytes sent (DASO gives its state)

    @property
    def intra(self) -> Optional[dist.ProcessGroup]:
        return self.levels.intra

    @property
    def inter(self) -> Optional[dist.ProcessGroup]:
        return self.levels.inter

    @property
    def local_rank(self) -> int:
        return self.levels.local_rank

    @property
    def local_size(self) -> int:
        return self.levels.local_size

    @property
    def nodes(self) -> int:
        return self.levels.nodes

    @classmethod
    def build(cls, replica: Replica, wire: Optional[torch.dtype], chunk_elems: int) -> "Transport":
        """A private copy of the node's group for gradients, and the two levels' groups (the node's
        for broadcasts, this rank's inter-node group) as the layout has them."""
        params: list[torch.Tensor] = [p for _, p in replica.trainable]
        piece = max(1, int(replica.bucket_cap_mb * MB))
        if replica.group is None:
            return cls(params, wire=wire, chunk_elems=chunk_elems, piece_bytes=piece)
        topo = replica.topology
        check_layout(topo, replica.group, "daso")
        grad = replica.private_group("daso/grad", topo.intra_node_group) if topo.local_world_size > 1 else None
        return cls(params, grad, TwoLevel.of(topo, replica.private_group, "daso"), wire, chunk_elems, piece)

    # ---- one global sync --------------------------------------------------
    def start(self) -> None:
        """Launch this rank's part of its inter-node group's average (non-blocking). Cast, it carries
        the difference from the anchor in a ``Wire`` made for this sync; a group's first sync (no
        anchor yet) the weights, uncast, in a flat buffer that becomes the anchor."""
        relative, world = self.wire is not None and self.anchor is not None, dist.get_world_size(self.inter)
        with torch.no_grad():
            if relative:
                assert self.wire is not None and self.anchor is not None
                piece = max(1, self.piece_bytes // max(1, self.params[0].element_size()))
                payload: Any = Wire(self.params, self.wire, piece)
                payload.load([p.detach() for p in self.params], self.anchor)
                flats = payload.pieces
            else:
                layout = Flats(self.params)
                layout.load()
                payload, flats = layout.views, [part.flat for part in layout.parts]
            parts = [part for f in flats for part in f.div_(world).split(self.chunk_elems)]
        works = [comm.start(dist.all_reduce, part, group=self.inter) for part in parts]
        sent = sum(comm.ring_bytes(part.numel() * part.element_size(), world) for part in parts)
        self.inflight, self.relative = Sync(works, payload), relative
        self.meter.bytes_sent += sent

    def finish(self) -> list[torch.Tensor]:
        """The group's average from the sync in flight; it becomes the group's new anchor."""
        payload, self.inflight = self.inflight.wait(), None
        if self.relative:  # anchor += the average difference, cast back slice by slice
            anchor = self.anchor or []
            with torch.no_grad():
                if isinstance(payload, Wire):
                    payload.add_to(anchor)
                else:  # restored from a checkpoint: one tensor per weight
                    for a, d in zip(anchor, payload):
                        sliced(lambda x, y: x.add_(y), a.view(-1), d.reshape(-1))
            payload = anchor
        if self.wire is not None:
            self.anchor = payload  # a full-precision sync's buffer is not copied: the anchor owns it
        return payload

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
        if self.inflight is not None:  # values in the weights' dtype, one tensor per weight
            payload = self.inflight.wait()
            if isinstance(payload, Wire):
                values = payload.tensors(self.params)
            else:
                values = [v.to(p.dtype, copy=True) for v, p in zip(payload, self.params)]
            self.inflight = comm.Finished(payload)
            inflight = {"values": values, "relative": self.relative}
        return {"inflight": inflight, "anchor": None if self.anchor is None else [a.clone() for a in self.anchor]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sync in flight and the anchor (without one, the next sync re-establishes it)."""
        self.drop()
        anchor, inflight = state.get("anchor"), state.get("inflight")
        self.anchor = None if anchor is None else [a.clone(memory_format=torch.contiguous_format) for a in anchor]
        self.inflight = None if inflight is None else comm.Finished([v.clone() for v in inflight["values"]])
        self.relative = bool(inflight and inflight["relative"])


class DASOState(State):
    """DASO's schedule and transport for one model.

    ``schedule`` holds the counters (``epoch``, ``batch`` in the epoch,
    ``batches``, ``global_skip``, ``local_skip``, ``batches_to_wait``,
    ``pending_sync``, ``syncs_sent``, ``syncs_received``, ``syncs_blocking``,
    ``plateau_bad``); ``bytes_sent`` is what this rank sent.
    """

    __slots__ = ("schedule", "transport", "batch_ended")

    def __init__(self, schedule: Schedule, transport: Transport) -> None:
        super().__init__()
        self.schedule, self.transport = schedule, transport
        transport.meter = self
        self.batch_ended = False  # a batch ended since the last forward or scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batch counters, skips, rotation, plateau tracking, and the sync in flight
        with its reference weights (no new communication)."""
        return {**self.schedule.state_dict(), **self.transport.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)
        self.transport.load_state_dict(state)


class DASO(Algorithm[DASOState]):
    """Node-local gradient averaging every step, stale inter-node weight averaging in rotation.

    Args:
        total_epochs: epochs of training (None: unknown, no cool-down).
        warmup_epochs: blocking epochs first (weights averaged after every batch).
        cooldown_epochs: blocking epochs last (needs ``total_epochs``).
        scheduler: must be None (the training loop steps its schedulers).
        stability_level: relative improvement of the loss that is not a plateau.
        max_global_skips: the most batches between two global syncs.
        sending_chunk_size: elements per collective of a global sync.
        wire_dtype: wire dtype of global syncs ("bf16", "fp16", "fp32" or a torch dtype);
            alias ``downcast_type``, HeAT's name.
        use_mpi_groups: no effect (HeAT's option; torch.distributed groups are used).
        skip_reduction_factor: divides the skips when the loss plateaus.
        local_skip_factor: ``max_global_skips // local_skip_factor`` is the local skip after a reset.
        verbose: log the schedule on rank 0 at every epoch end (logger ``unison.daso`` at INFO;
            printed to stdout when no logging is configured).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="daso:total_epochs=90")
        for epoch in range(90):
            loss = train_one_epoch(model)
            model.end_epoch(loss)
    """

    name = "daso"
    replicas_drift = True
    needs_optimizers = True
    # Its failure domain is a node: a member that fails takes its node's group with it. A global sync a
    # failure interrupts is dropped (the replicas drift between syncs; the next one pulls them together).
    recovery = Recovery()
    total_epochs: Optional[int] = None
    warmup_epochs: int = 4
    cooldown_epochs: int = 4
    scheduler: Any = None
    stability_level: float = 0.05
    max_global_skips: int = 8
    sending_chunk_size: int = 10_000_000
    wire_dtype: Union[str, torch.dtype] = "bf16"
    use_mpi_groups: bool = True
    skip_reduction_factor: int = 2
    local_skip_factor: int = 4
    verbose: bool = False

    def __post_init__(self) -> None:
        options.integer("total_epochs", self.total_epochs, optional=True)
        options.integer("warmup_epochs", self.warmup_epochs, minimum=0)
        options.integer("cooldown_epochs", self.cooldown_epochs, minimum=0)
        options.number("stability_level", self.stability_level, 0.0, open_low=False, high=1.0)
        options.integer("max_global_skips", self.max_global_skips)
        options.integer("sending_chunk_size", self.sending_chunk_size)
        options.choice("wire_dtype", self.wire_dtype, (*WIRE_DTYPES, *WIRE_DTYPES.values()))
        options.boolean("use_mpi_groups", self.use_mpi_groups)
        options.integer("skip_reduction_factor", self.skip_reduction_factor, minimum=2)
        options.integer("local_skip_factor", self.local_skip_factor)
        options.boolean("verbose", self.verbose)
        if self.scheduler is not None:
            raise ValueError(
                "scheduler must be None: unison's DASO does not step schedulers; call scheduler.step() "
                "in your training loop as usual (optimizer.step() still drives DASO)"
            )
        super().__post_init__()

    @property
    def wire(self) -> Optional[torch.dtype]:
        """The dtype ``wire_dtype`` names, global syncs travel in (None: fp32, the parameters' own)."""
        wire = to_wire_dtype(self.wire_dtype)
        return None if wire == torch.float32 else wire

    def setup(self, replica: Replica) -> DASOState:
        super().setup(replica)
        if self.verbose:
            show_schedule_log()
        transport = Transport.build(replica, self.wire, self.sending_chunk_size)
        schedule = Schedule(
            self.warmup_epochs,
            self.cooldown_epochs,
            self.total_epochs,
            self.max_global_skips,
            self.skip_reduction_factor,
            self.local_skip_factor,
            self.stability_level,
            transport.local_size,
            transport.nodes,
        )
        state = DASOState(schedule, transport)
        replica.on_scaler_update(lambda scaler: self._scaler_updated(state))
        return state

    def teardown(self, replica: Replica, state: DASOState) -> None:
        """Let a sync in flight finish (no new collective)."""
        state.transport.drop()
        super().teardown(replica, state)

    def release(self, replica: Replica, state: DASOState) -> None:
        state.transport.inflight = None  # no waiting: the peers may be gone

    def gradient_group(self, replica: Replica, state: DASOState) -> Optional[dist.ProcessGroup]:
        """The node: gradients are averaged inside it only (None with one process per node)."""
        return state.transport.grad_group

    def sync_gradients(self, replica: Replica, state: DASOState) -> bool:
        return state.schedule.sync_gradients()

    # ---- batches ------------------------------------------------------------
    def before_forward(self, replica: Replica, state: DASOState) -> None:
        state.batch_ended = False

    def after_step(self, replica: Replica, state: DASOState, optimizer: torch.optim.Optimizer) -> None:
        """The batch ends once every registered optimizer has stepped."""
        if replica.step_ended(optimizer):
            self._end_batch(state)

    def _scaler_updated(self, state: DASOState) -> None:
        """After ``scaler.update()``: end the batch if the scaler skipped its optimizer step
        (inf/NaN gradients), so this rank's batch count stays with the other nodes'."""
        if not state.batch_ended:
            self._end_batch(state)
        state.batch_ended = False

    def _end_batch(self, state: DASOState) -> None:
        """One batch ended on this rank: block on, merge or start a global sync as scheduled."""
        state.batch_ended = True
        plan, transport = state.schedule.end_batch(), state.transport
        if plan.blocking is not None:
            transport.blocking(plan.blocking)
        if plan.merge is not None:
            transport.receive(plan.merge.local_rank, plan.merge.batches_to_wait)
        if plan.send is not None and transport.local_rank == plan.send.local_rank:
            transport.start()

    # ---- epochs, final sync -------------------------------------------------
    def end_epoch(self, replica: Replica, state: DASOState, loss: Optional[float], averaged: bool) -> None:
        """``model.end_epoch(loss, averaged)``, HeAT's ``epoch_loss_logic``: end the epoch (every rank),
        average the loss (unless ``averaged``), resync if cycling, set the next skips."""
        value = None if loss is None else float(loss)
        mean = value if averaged else _mean_loss(state, value, replica.group)
        k = state.schedule.end_epoch(mean)
        if k is not None:  # a cycling epoch ends: drop the sync in flight, make every replica identical
            state.transport.drop()
            state.transport.blocking(k)
        if self.verbose and replica.rank == 0:
            s = state.schedule
            log.info(
                "daso: epoch %s loss %s: global_skip %s, local_skip %s, batches_to_wait %s",
                s.epoch,
                mean,
                s.global_skip,
                s.local_skip,
                s.batches_to_wait,
            )

    def average(self, replica: Replica, state: DASOState) -> None:
        """Every rank drops its sync in flight (after it completes); DataParallel then averages all weights."""
        state.transport.drop()
        state.transport.anchor = None
        state.schedule.pending_sync = None


def _mean_loss(state: DASOState, loss: Optional[float], group: Optional[dist.ProcessGroup]) -> Optional[float]:
    """The epoch's loss averaged over ``group``'s ranks that gave one (None if none did)."""
    if group is None:
        return loss
    t = torch.tensor([0.0 if loss is None else loss, 0.0 if loss is None else 1.0], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    state.bytes_sent += ring_bytes(t.numel() * t.element_size(), dist.get_world_size(group))
    return t[0].item() / t[1].item() if t[1].item() > 0 else None


def show_schedule_log() -> None:
    """``verbose=True`` asks to see the schedule: log it at INFO, and to stdout when the
    application configured no logging (as HeAT prints it)."""
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():
        log.addHandler(logging.StreamHandler(sys.stdout))
