"""Fault tolerance inside the job: ``DataParallel(..., fault_tolerant=True)`` and its ``model.ft``.

When a member dies, stops answering, joins or leaves, every wait on a
collective of the old membership raises (``MembershipChanged``, or gloo's own
error when a peer's connection closes). The wrapper then calls ``recover``:

1. regroup: the default process group is built again over the new members and
   the algorithm is started again on it (its state carried over);
2. settle: the members tell each other their committed step and what they were
   doing (one small all-gather). The lowest rank among those furthest ahead is
   the source: every member behind it, and every joiner, receives its weights,
   buffers, optimizer state, algorithm state, step and attached state;
3. redo or drop: if members were in a gradient round that every replica must
   share, it is done again on the new quorum from each one's saved local
   gradient (members without one contribute nothing and apply the result);
   a round that only pulls drifting replicas together is dropped.

So every committed step is applied exactly once on every member. See
docs/fault-tolerance.md for the protocol, its guarantees and its limits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
import zlib
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from .. import algorithms as algos
from .. import sharded
from ..algorithms import support
from ..core import Core
from ..engine.comm import all_gather_objects, broadcast_object, share_state
from ..engine.snapshot import seed_all, to_cpu
from ..runtime import forget_private_groups, health
from ..runtime.launch import wire_device
from . import member
from .member import Member, MembershipChanged

logger = logging.getLogger("unison.ft")


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing that happened to the job: ``kind`` is failure, regroup, reshard, redo, drop, lost,
    heal_send or heal_recv."""

    time: float
    kind: str
    detail: str


class Guarded(Protocol):
    """What fault tolerance needs of the wrapper it guards (DataParallel)."""

    module: nn.Module
    process_group: Optional[dist.ProcessGroup]

    @property
    def core(self) -> Core: ...

    def regrouped(self) -> None:
        """The default process group was built again: start the algorithm on it."""


def supported() -> list[str]:
    """The algorithms that run with ``fault_tolerant=True``: those that declare a ``Recovery``."""
    return support.supporting(lambda cls: cls.recovery is not None)


def check_group(process_group: Optional[dist.ProcessGroup]) -> None:
    """Refuse, at construction, a process group that is not the whole job: its membership changes,
    and only the group of every member can be built again over a new membership. (An algorithm
    that declares no ``Recovery`` is refused by ``unison.algorithms.support.check``.)"""
    if process_group is not None:
        outside = process_group is dist.GroupMember.NON_GROUP_MEMBER
        size = 0 if outside else dist.get_world_size(process_group)
        if size != dist.get_world_size():
            raise ValueError(
                "fault_tolerant=True was given a process_group that is not the job's whole group ("
                + ("this process is not in it" if outside else f"{size} of the job's {dist.get_world_size()} processes")
                + "); under fault tolerance the replicas are the job's members, whose membership changes: leave "
                "process_group unset, or pass the whole job's group (dist.group.WORLD)"
            )


def joining_member(
    fault_tolerant: bool, algorithm: algos.Algorithm[Any], process_group: Optional[dist.ProcessGroup], optimizer: Any
) -> Optional[Member]:
    """This worker's Member when ``fault_tolerant`` is asked for and can be given (None when it is
    not asked for); raises, before anything is built, when it cannot be."""
    if not fault_tolerant:
        return None
    worker = member.active()
    if worker is None:
        raise RuntimeError(
            "fault_tolerant=True needs the job started by `unison launch --fault-tolerant --nproc N script.py` "
            "(or served by `unison coordinator`), and unison.init() called before the model is wrapped"
        )
    check_group(process_group)
    support.check(algorithm, support.Context(fault_tolerant=True))
    if optimizer is None:
        raise ValueError("fault_tolerant=True needs optimizer=: its steps are the ones committed and healed")
    return worker


#: Set in the coordinator's store once the job has a state (its first settle is done); over FSDP2
#: once for each local rank (``ft/state/<local rank>``: the replicas of one shard settle together).
STATE_KEY = "ft/state"


def rank_local(state: dict[str, Any], own: Optional[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """``state`` (a peer's) with its rank-local entries ``keys`` replaced: by ``own``'s, or zeros without it."""
    out = dict(state)
    for key in keys:
        if key in out:
            out[key] = own[key] if own is not None and key in own else _zeros(out[key])
    return out


def layout(obj: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The dtype and shape of every tensor in ``obj`` (dicts, lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [(str(obj.dtype), tuple(obj.shape))]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in layout(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in layout(v)]
    return []


def _zeros(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    return value


def is_failure(exc: BaseException, worker: Optional[Member] = None) -> bool:
    """Whether ``exc`` means a membership change (and not a bug, nor the job's end), told by its
    type, the membership epoch and the coordinator's record, never by its message:

    - ``MembershipChanged``: a wait saw a newer membership;
    - torch.distributed's DistBackendError, DistNetworkError, DistStoreError, a TimeoutError or a
      ConnectionError: the transport, the backend or the store failed (the error or one it was
      raised from: an algorithm's thread reports its failure so);
    - a collective's own RuntimeError (gloo's "Connection closed by peer", first raised inside
      torch.distributed or unison, ``health.raised_in_a_collective``): only when the
      coordinator publishes a newer membership within ``member.FAILURE_GRACE_S`` (it recorded a
      death, an eviction or a leave). Without one it is the caller's error, raised at once.

    Anything else (a bad shape, a user's exception, ``RankFailure``) is raised, never retried.
    """
    if isinstance(exc, health.RankFailure):
        return False
    if any(isinstance(e, (MembershipChanged, *health.FAILURE_TYPES)) for e in health.causes(exc)):
        return True
    return health.raised_in_a_collective(exc) and worker is not None and worker.membership_moved()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Who does what in a settle, from every member's ``(committed step, kind, shared rounds)``.

    Attributes:
        top: ``(step, shared rounds)`` of the members furthest ahead (joiners never are, unless
            only joiners are left).
        source: the lowest rank at ``top``: it sends the state's skeleton to every rank ``behind``.
        holders: the ranks at ``top`` that are no joiners, ``source`` first: they hold the same
            state (unless the replicas drift), and each sends a share of its tensors.
        behind: the ranks that receive the source's state (the joiners among them).
        contributors: the ranks inside the gradient round of step ``top + 1``: it is redone on them.
        overtaken: the ranks that were inside a gradient round the source had already finished
            (no redo): healed to ``top``, their pending optimizer step must do nothing.
        idle: the ranks at ``top`` that were between steps while others redo a round (their batch is lost).
    """

    top: tuple[int, int]
    source: int
    holders: list[int]
    behind: list[int]
    contributors: list[int]
    overtaken: list[int]
    idle: list[int]

    @classmethod
    def of(cls, statuses: list[tuple[int, str, int]]) -> "Plan":
        running = [(s, n) for s, k, n in statuses if k != "join"]
        top = max(running) if running else max((s, n) for s, _, n in statuses)
        source = next(r for r, (s, k, n) in enumerate(statuses) if (s, n) == top and (k != "join" or not running))
        behind = [r for r, (s, k, n) in enumerate(statuses) if r != source and ((s, n) < top or k == "join")]
        holders = [source] + [
            r for r, (s, k, n) in enumerate(statuses) if r != source and r not in behind and (s, n) == top
        ]
        contributors = [r for r, (s, k, _) in enumerate(statuses) if k == "grad" and s == top[0]]
        overtaken = [] if contributors else [r for r in behind if statuses[r][1] == "grad"]
        idle = [r for r, (s, k, _) in enumerate(statuses) if contributors and s == top[0] and k not in ("grad", "join")]
        return cls(top, source, holders, behind, contributors, overtaken, idle)


class FaultTolerance:
    """``model.ft``: the job's membership as this worker sees it, and the recovery; the wrapper's
    Core holds it as its fault policy (``unison.core.FaultPolicy``).

    Attributes:
        step: committed training steps, the same on every member (healed into joiners).
        events: what happened, as ``Event(time, kind, detail)``.

    Example::

        model = unison.DataParallel(net, optimizer=opt, fault_tolerant=True)
        model.ft.attach(scheduler=sched)          # healed into a joiner too
        while model.ft.step < total:
            x, y = next(batches)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    """

    active = True

    def __init__(self, model: Guarded, member: Member) -> None:
        self._model = weakref.ref(model)
        self._member = member
        self.step = 0
        self.events: list[Event] = []
        self._attached: dict[str, Any] = {}
        self._healed: dict[str, Any] = {}  # attached state healed in before the object was attached
        self._recovering = False
        self._swallow = False  # the pending backward was settled by a heal: its optimizer step does nothing
        self._pending: Optional[str] = None  # over FSDP2: a failure met, recovered from once the node agrees

    # ---- what users read -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """How many members train now."""
        return self._member.world_size

    @property
    def rank(self) -> int:
        """This worker's rank in the current membership (oldest member: 0)."""
        return self._member.rank

    @property
    def members(self) -> list[int]:
        """The members' worker ids, oldest first."""
        return list(self._member.members)

    @property
    def worker_id(self) -> int:
        """This worker's id in the job (it never changes; a replacement gets a new one)."""
        return self._member.id

    def attach(self, **objects: Any) -> None:
        """Heal these objects (anything with ``state_dict``/``load_state_dict``: an LR scheduler,
        a ``ShardSampler``, a counter of yours) into joiners together with the model.

        A joiner heals while its model is built, before it can attach anything: what it received
        under a name is loaded when it attaches an object under that name. An object with
        ``reshard(rank, world_size)`` (``ShardSampler``) is also told of every membership change.
        Attach the same names, in every worker, right after building the model.
        """
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"attach({name}=...) needs an object with state_dict() and load_state_dict()")
            self._attached[name] = obj
            if name in self._healed:
                obj.load_state_dict(self._healed.pop(name))
            if callable(getattr(obj, "reshard", None)):
                obj.reshard(self.rank, self.world_size)

    def leave(self) -> None:
        """Leave the job gracefully after this step: the others go on without this worker."""
        self._member.leave()

    def check(self) -> None:
        """Before a forward: raise RankFailure if the job cannot go on (coordinator gone, too few
        members) or if this worker was evicted while it was stopped. A membership change is
        otherwise taken up by the step's first wait: the batch in hand is this step's."""
        self._member.check_membership()

    def note(self, kind: str, detail: str) -> None:
        """Keep an event in ``events`` and log it (logger ``unison.ft``: failures as warnings)."""
        self.events.append(Event(time.time(), kind, detail))
        logger.log(logging.WARNING if kind in ("failure", "lost") else logging.INFO, "%s: %s", kind, detail)

    # ---- steps ----------------------------------------------------------------------------
    def committed(self) -> bool:
        """An optimizer step of the first optimizer ended; False if it was settled by a heal."""
        if self._swallow:
            self._swallow = False
            return False
        self.step += 1
        self._member.committed_step = self.step  # rank 0's heartbeat publishes it (ft/step)
        return True

    def at_boundary(self) -> None:
        """Between two steps: regroup now if a new membership waits for this worker (a lone
        member, or one whose algorithm has no collective for a while, would otherwise never
        notice a joiner); a departure alone is taken up by the next collective. Over FSDP2 the
        node's processes decide it together (``agree``)."""
        if self._recovering:
            return
        if self._node_group() is not None:
            self.agree()
        elif self._member.wanted_now():
            self._settled("idle", None, regroup=True)

    def agree(self) -> bool:
        """Over a model sharded by FSDP2 on the node's mesh: the node's processes decide together
        (one all-reduce over the node's group) whether to recover now, from a failure one of them
        met (``recover`` kept it pending) or a membership that wants them; True if they did.

        The node's processes share every forward (FSDP2 gathers the shards inside the node): one
        that regrouped alone would wait for a sibling that waits in the next forward's gather.
        So a failure is recovered from where they all are at once, the end of the step (or of
        ``average()``), by all of them. Elsewhere nothing is pending: False at once. The answer
        is read on the host (over NCCL, one wait for the device per step): each process must know
        before its next forward whether the node regroups now.
        """
        node = self._node_group()
        if node is None or self._recovering:
            return False
        pending, self._pending = self._pending, None
        flag = torch.tensor([2 if pending else int(self._member.wanted_now())], device=wire_device(node))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=node)
        if not int(flag.item()):
            return False
        self._settled(pending or "idle", None, regroup=True)
        return True

    @property
    def commits_by_node(self) -> bool:
        """Whether the node's processes decide together whether a round is applied (``commit``)."""
        return self._node_group() is not None

    def commit(self, ok: bool) -> None:
        """Before a round of the algorithm's own is applied (an average, an outer step), over a
        model sharded by FSDP2 on the node's mesh: one commit decision for the node. Its processes
        tell each other whether their round completed (``ok``; one all-reduce over the node's
        group), and one whose round completed raises ``MembershipChanged`` if another's did not.

        Each local rank's round runs over its own replicas: a failure can end one local rank's and
        spare another's (a process killed between them). Applied on one shard and dropped on the
        other, the node's shards would be synced at different steps; so the round is dropped (or
        launched again: ``Recovery.interrupted``) on every shard of the node, as the failed one is;
        where the round is shared state (an outer step) the settle that follows heals the replicas
        behind to the nodes that applied it, on every shard alike (torchft's ``should_commit``).
        Read on the host, like ``agree``: the process must know before it writes.
        """
        node = self._node_group()
        if node is None or self._recovering:
            return
        flag = torch.tensor([int(ok)], device=wire_device(node))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=node)
        if ok and not int(flag.item()):
            raise MembershipChanged(
                f"worker {self._member.id}: another process of this node lost its round: the node applies it on no shard"
            )

    def _node_group(self) -> Optional[dist.ProcessGroup]:
        """The node's group when the model is sharded by FSDP2 over it, else None."""
        model, node = self._model(), self._member.node_group
        return node.group if model is not None and model.core.fsdp2 and node is not None else None

    # ---- recovery -------------------------------------------------------------------------
    def start(self, begin: Callable[[], None]) -> None:
        """``begin()`` (the algorithm's start, which builds its groups), then the first agreement:
        a fresh worker takes the members' state (everyone, at the start of the job).

        A member that dies while the others build their groups is a failure like any other: the
        survivors regroup, start the algorithm again over the new members (``regrouped``) and
        settle, instead of raising out of ``DataParallel(...)`` once the rendezvous times out.
        """
        try:
            begin()
        except Exception as exc:
            if not is_failure(exc, self._member):
                raise
            self.note("failure", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            self._settled("join", None, regroup=True)
            return
        self._settled("join", None)

    def recover(self, exc: BaseException, kind: str, local: Optional[dict[int, torch.Tensor]] = None) -> bool:
        """Recover from ``exc`` raised in a round of ``kind`` ("grad" or "drop"); False if it is no failure.

        ``local``: this member's saved gradients of the interrupted gradient round.
        """
        if self._recovering or not is_failure(exc, self._member):
            return False
        self.note("failure", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        if self._node_group() is not None and kind != "grad":
            self._pending = kind  # the node recovers together, at the end of the step (agree)
            return True
        self._settled(kind, local, regroup=True)
        return True

    def _settled(self, kind: str, local: Optional[dict[int, torch.Tensor]], regroup: bool = False) -> None:
        self._recovering = True
        before = set(self._member.members)
        try:
            if kind != "grad":
                # A step recorded but not yet applied (nonblocking) is committed: into the weights now,
                # before the regroup drops the algorithm (inside a gradient round none is recorded).
                self._apply_recorded(self._guarded())
            while True:
                try:
                    if regroup:
                        doc = self._member.regroup()
                        forget_private_groups()  # the old membership's: destroyed with it (Member.groups)
                        self.note(
                            "regroup", f"epoch {self._member.epoch}: {len(doc['members'])} members ({doc['reason']})"
                        )
                        self._guarded().regrouped()
                        self._release_engines()
                        self._reshard()
                    self._settle(kind, local)
                    gone = sorted(before - set(self._member.members))
                    if gone and kind in ("grad", "drop"):
                        self.note(
                            "lost",
                            f"the work in flight of worker(s) {gone}: its batch (or local steps since its last sync)",
                        )
                    return
                except Exception as again:
                    if not is_failure(again, self._member):
                        raise
                    self.note("failure", str(again).splitlines()[0][:200])
                    regroup = True
        finally:
            self._recovering = False

    def _release_engines(self) -> None:
        """The engines the Core left behind at a membership change hold the old groups: hand them
        to the reaper (their works hold their own buffers), so that the groups can be destroyed."""
        core = self._guarded().core
        for engine in core.abandoned:
            self._member.bury(engine)
        core.abandoned.clear()

    def _reshard(self) -> None:
        """Tell attached objects that deal work by rank (a ShardSampler) of the new membership."""
        for name, obj in self._attached.items():
            if callable(getattr(obj, "reshard", None)):
                self.note("reshard", f"{name}: {obj.reshard(self.rank, self.world_size)}")

    def _guarded(self) -> Guarded:
        model = self._model()
        if model is None:
            raise RuntimeError("the fault-tolerant model is gone")
        return model

    def _settle(self, kind: str, local: Optional[dict[int, torch.Tensor]]) -> None:
        model = self._guarded()
        # Over FSDP2 a shard's replicas are this local rank's processes on every node: they settle.
        group = model.process_group if model.core.fsdp2 else dist.group.WORLD
        # Where each member is: committed steps, what it was doing, shared rounds (DiLoCo's outer
        # steps) completed. The source is the lowest rank furthest ahead; joiners never are.
        gathered = all_gather_objects((self.step, kind, model.core.shared_rounds, self._member.veteran), group)
        statuses = [g[:3] for g in gathered]
        running = [(s, n) for s, k, n in statuses if k != "join"]
        # Joiners only, none of them a process that settled before (a second model of the same
        # workers is no loss), in a job that has a state: nobody holds it any more.
        state_key = STATE_KEY if group is dist.group.WORLD else f"{STATE_KEY}/{self._member.local_rank}"
        if not running and not any(g[3] for g in gathered) and self._member.store.check([state_key]):
            why = (
                f"every worker that held the job's state is gone (the members {self._member.members} all "
                "joined fresh); starting over from initial weights would be silently wrong: restart from a "
                "unison.save checkpoint"
            )
            self._member.store.set("ft/abort", why)  # the coordinator ends the job: no more replacements
            raise health.RankFailure(f"worker {self._member.id}: {why}", [])
        plan = Plan.of(statuses)
        top, source, behind, contributors = plan.top, plan.source, plan.behind, plan.contributors
        rank = dist.get_rank(group)
        started = time.time()
        # Only the members behind receive; every member at the top holds the same state where the
        # replicas do not drift, so each sends a share of it (a drifting replica is its own: the
        # source's alone then).
        sources, sent = [source], None
        shared = len(plan.holders) > 1 and not model.core.algorithm.replicas_drift
        if behind and (rank == source or (shared and rank in plan.holders)):
            sent = self._payload()
        if behind and shared:
            # Those whose tensors have the source's shapes (rank-local state may differ in layout).
            mine = zlib.crc32(repr(layout(sent[0])).encode()) if sent is not None else None
            layouts = all_gather_objects(mine, group)
            sources = [r for r in plan.holders if layouts[r] == layouts[source]]
        fresh = kind == "join" and not self._member.veteran
        if rank in sources and sent is not None:
            share_state(sent[0], sources, behind, group, names=sent[1])
        elif rank in behind:
            # A fresh joiner has nothing of its own to lose: the module's tensors are written in
            # place. A member keeps its own state whole until the payload has come (its sources may
            # die half-way).
            into = _module_state(model) if fresh else None
            self._load(share_state(None, sources, behind, group, into=into), fresh=kind == "join")
            self.note("heal_recv", f"from rank(s) {sources} at step {top[0]} in {time.time() - started:.3f} s")
        if rank not in behind and behind:
            own = model.core.algorithm_entry()
            if own is not None and recovery(model).reload_after_heal:
                # Its own state again, so whatever a load changes in the next round's protocol
                # (low-precision decentralized resends its public copies in full) changes on every member.
                model.core.load_algorithm_entry(own, strict=False, what="model")
            if rank == source:
                self.note("heal_send", f"to rank(s) {behind} at step {top[0]}, in shards from rank(s) {sources}")
        if contributors:
            self._redo(model, local if rank in contributors else None, len(contributors), swallow=kind == "grad")
            self.note("redo", f"gradient round of step {top[0] + 1} on {len(contributors)} contributor(s)")
        elif rank in plan.overtaken:
            self._drop_pending(model)
            self.note("drop", f"its gradient round of step {top[0]}: the others had finished it, the heal applied it")
        elif kind == "drop" and recovery(model).relaunches:
            self.note("redo", f"the interrupted sync after step {self.step}, at the next step")
        elif kind == "drop":
            self.note("drop", f"an averaging round after step {self.step}")
        self._align_data(contributors[0] if contributors else source, group)
        if not self._member.veteran:  # from now on, a membership of fresh joiners only has lost the job's state
            self._member.store.set(state_key, "1")
            self._member.hold()
        if plan.idle:
            self.note("lost", f"the batch of step {top[0] + 1} of rank(s) {plan.idle}, which were between steps")

    def _align_data(self, leader: int, group: Optional[dist.ProcessGroup]) -> None:
        """Give every member of ``group`` the data position of its rank ``leader`` (one that was
        mid-step, if any): a member that noticed the change between two steps has not drawn that
        step's batch."""
        positions = None
        if dist.get_rank(group) == leader:
            positions = {n: to_cpu(o.state_dict()) for n, o in self._attached.items() if hasattr(o, "reshard")}
        for name, state in broadcast_object(positions, group, src=leader).items():
            if name in self._attached:
                self._attached[name].load_state_dict(state)
            else:
                self._healed[name] = state

    def _payload(self) -> tuple[dict[str, Any], dict[int, str]]:
        """What a member behind receives, and the names of its module's tensors (by id) so that a
        joiner can receive them into its own."""
        model = self._guarded()
        module = to_cpu(_module_state(model))
        payload = {
            "step": self.step,
            "module": module,
            "optimizers": [to_cpu(sharded.local_state(opt.state_dict())) for opt in model.core.optimizers],
            "algorithm": to_cpu(model.core.algorithm_entry()),
            "attached": {name: to_cpu(obj.state_dict()) for name, obj in self._attached.items()},
        }
        return payload, {id(t): name for name, t in module.items()}

    def _load(self, payload: dict[str, Any], fresh: bool) -> None:
        """Become the source: everything shared, and a fresh per-worker RNG seed. Rank-local
        algorithm state (error feedback) starts at zero in a ``fresh`` worker; a member keeps its own."""
        model = self._guarded()
        self.step = payload["step"]
        self._member.committed_step = self.step
        if model.core.fsdp2:  # into the local shards, which FSDP2 gathers at the next forward
            with torch.no_grad():
                for name, t in _module_state(model).items():
                    if t is not payload["module"][name]:
                        t.copy_(payload["module"][name])
        else:
            model.module.load_state_dict(payload["module"])
        for opt, state in zip(model.core.optimizers, payload["optimizers"]):
            opt.load_state_dict(sharded.as_dtensors(opt, state) if model.core.fsdp2 else state)
        entry = payload["algorithm"]
        if entry is not None:
            own = None if fresh else model.core.algorithm_entry()
            keys = recovery(model).rank_local
            entry = {**entry, "state": rank_local(entry["state"], own["state"] if own else None, keys)}
            model.core.load_algorithm_entry(entry, strict=False, what="model")
        for name, state in payload["attached"].items():
            if name in self._attached:
                self._attached[name].load_state_dict(state)
            else:
                self._healed[name] = state
        seed_all(zlib.crc32(f"{self.step}/{self._member.id}".encode()))

    def _drop_pending(self, model: Guarded) -> None:
        """This member was healed past the gradient round it was in: the backward it is inside
        ends with no gradient, and the optimizer step that follows changes nothing and is not
        counted (the heal already applied that step)."""
        for _, p in model.core.replica.trainable:
            p.grad = None
        self._swallow = True

    def _redo(self, model: Guarded, local: Optional[dict[int, torch.Tensor]], contributors: int, swallow: bool) -> None:
        """The interrupted gradient round again, on this quorum; a member without a saved
        gradient contributes nothing and applies the result itself."""
        reducer = model.core.reducer
        params = [p for _, p in model.core.replica.trainable]
        for i, p in enumerate(params):
            p.grad = None if local is None or i not in local else local[i].to(p.device, copy=True)
        if reducer is not None:
            reducer.set_divisor(contributors)
            try:
                reducer.shadow_pass(True)
            finally:
                reducer.set_divisor(None)
        if local is None:
            for opt in model.core.optimizers:
                opt.step()
            self._apply_recorded(model)  # before the gradients go
            for p in params:
                p.grad = None
            self._swallow = swallow

    def _apply_recorded(self, model: Guarded) -> None:
        """Apply the optimizer steps the algorithm recorded and has not applied yet
        (``Recovery.deferred_step``: nonblocking's); its reductions are complete under fault tolerance."""
        if model.core.algorithm.recovery is not None and recovery(model).deferred_step:
            model.core.flush()


def _module_state(model: Guarded) -> dict[str, torch.Tensor]:
    """The module's state dict; over FSDP2 its local shards (views sharing the parameters' storage)."""
    state = model.module.state_dict()
    return sharded.local_state(state) if model.core.fsdp2 else state


def recovery(model: Guarded) -> algos.Recovery:
    """The running algorithm's ``Recovery`` (checked at construction and at every switch)."""
    declared = model.core.algorithm.recovery
    if declared is None:  # unreachable: support.check refused it
        raise RuntimeError(f"algorithm {model.core.algorithm.name!r} declares no Recovery")
    return declared
