"""The core both wrappers hold: ``DataParallel`` (the module side) and
``DistributedOptimizer`` (the optimizer side) differ in what they wrap, not in
how they run an algorithm.

A ``Core`` builds the Replica, starts and stops the algorithm's Dispatcher,
builds and removes the gradient engine (``GradReducer``), hooks the optimizers'
steps, keeps the algorithm's state in a state dict, and counts the traffic of
algorithms that have left. It holds the fault-tolerance policy (``FaultPolicy``:
``NoFaultTolerance`` unless ``unison.fault.FaultTolerance`` is given) and is the
one place where a peer's failure in a wrapper's call becomes a ``RankFailure``
(``entry``). Membership, the bucket-size check, the tags of private groups and
the construction check's wording are here once too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from .algorithm_hooks import Hooks, StepClock, StepFn
from .algorithms import support
from .algorithms.contract import Algorithm
from .engine import sparse as sparse_grads
from .engine.buckets import MB
from .engine.comm import check_same_everywhere
from .engine.reducer import Callbacks, GradReducer, Layout, Redo, Sync
from .engine.weak import weak
from .events import Dispatcher
from .replica import Replica
from .runtime import health

#: The key under which a wrapper's ``state_dict()`` keeps the algorithm's state.
ALGORITHM_KEY = "_unison_algorithm"

# Numbers the wrappers in creation order (the same on every rank): their tags
# name their private process groups, found again after an algorithm switch.
_serials = itertools.count()

T = TypeVar("T")

logger = logging.getLogger("unison")


def new_tag(kind: str) -> str:
    """A tag for a new wrapper of ``kind``, unique and the same on every rank."""
    return f"{kind}-{next(_serials)}"


def membership(process_group: Optional[dist.ProcessGroup], who: str) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, world size, rank in it)``, or ``(None, 1, 0)`` without torch.distributed.

    Raises ValueError when this process is not in ``process_group``, or when one is
    given but torch.distributed is not initialized (``who`` names the wrapper).
    """
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError(f"this process is not a member of the process_group given to {who}")
        return group, dist.get_world_size(group), dist.get_rank(group)
    if process_group is not None:
        raise ValueError("process_group was given but torch.distributed is not initialized; call unison.init() first")
    return None, 1, 0


def check_bucket_cap(bucket_cap_mb: Any) -> float:
    """``bucket_cap_mb`` if it is a positive number of MiB; ValueError otherwise."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    return bucket_cap_mb  # as given: 25 stays 25 in messages


def parameter_entries(
    named: Iterable[tuple[str, torch.Tensor]], requires_grad: Optional[Sequence[bool]] = None
) -> list[tuple[Any, ...]]:
    """What the ranks must agree on about parameters: name, shape, dtype, trainable (``requires_grad``
    where the tensors cannot say: FSDP2's local shards)."""
    named = list(named)
    flags = [p.requires_grad for _, p in named] if requires_grad is None else requires_grad
    return [("parameter", n, tuple(p.shape), str(p.dtype), f) for (n, p), f in zip(named, flags)]


def describe_entry(entry: tuple[Any, ...]) -> str:
    """How a construction-check entry reads in an error message."""
    if entry[0] == "setting":
        return f"setting {entry[1]}={entry[2]!r}"
    extra = "" if entry[0] == "buffer" or entry[4] else ", frozen"
    return f"{entry[0]} {entry[1]!r} (shape {list(entry[2])}, {entry[3].replace('torch.', '')}{extra})"


def check_ranks_agree(what: str, entries: list[tuple[Any, ...]], group: Optional[dist.ProcessGroup]) -> None:
    """Raise on every rank, naming the ranks and the first entry that differ, unless all agree."""
    check_same_everywhere(what, entries, group, describe_entry)


def sparse_positions(
    trainable: Sequence[tuple[str, torch.Tensor]], modules: Iterable[nn.Module], extra: Iterable[torch.Tensor] = ()
) -> list[int]:
    """Positions in ``trainable`` of the parameters that get sparse gradients, decided at
    construction as torch DDP decides (``unison.engine.sparse.expected``), plus ``extra``. The
    engine sums them itself, outside the buckets; an algorithm whose reduction must see every
    gradient declares ``sparse_gradients = False`` and is refused (``support.check``)."""
    ids = sparse_grads.expected(modules) | {id(p) for p in extra}
    return [i for i, (_, p) in enumerate(trainable) if id(p) in ids]


def sparse_parameter(
    trainable: Sequence[tuple[str, torch.Tensor]], modules: Iterable[nn.Module], extra: Iterable[torch.Tensor] = ()
) -> Optional[str]:
    """The name of the first parameter of ``trainable`` that gets sparse gradients, or None."""
    positions = sparse_positions(trainable, modules, extra)
    return trainable[positions[0]][0] if positions else None


class FaultPolicy(Protocol):
    """What a wrapper's Core asks of fault tolerance: ``NoFaultTolerance`` when it is off,
    ``unison.fault.FaultTolerance`` (``DataParallel(fault_tolerant=True)``) when it is on.

    ``kind`` names the round a failure interrupted: "grad" (a gradient round every replica
    must share: done again) or "drop" (an averaging round, a forward: dropped).
    """

    @property
    def active(self) -> bool:
        """Whether failures are recovered from (the engine then keeps each pass's local gradients)."""
        ...

    def start(self, begin: Callable[[], None]) -> None:
        """After construction: ``begin()`` starts the algorithm (it builds its groups), then the
        first agreement (a joiner takes the members' state)."""

    def check(self) -> None:
        """Before a forward: raise if the job cannot go on."""

    def recover(self, exc: BaseException, kind: str, local: Optional[dict[int, torch.Tensor]] = None) -> bool:
        """Recover from ``exc``, raised in a round of ``kind``; False if it is no failure to recover from."""
        ...

    def committed(self) -> bool:
        """A step of the first optimizer ended; False if a heal already applied it (skip its events)."""
        ...

    def at_boundary(self) -> None:
        """Between two training steps (a membership change noticed there is taken up now)."""

    def agree(self) -> bool:
        """Over a model sharded by FSDP2: the node's processes recover together from a failure one
        of them met; True if they did (False at once elsewhere)."""
        ...

    @property
    def commits_by_node(self) -> bool:
        """Whether the node's processes decide together whether a round is applied (``commit``)."""
        ...

    def commit(self, ok: bool) -> None:
        """Over a model sharded by FSDP2: before a round is applied, raise if another process of
        the node did not complete its round (``ok``: this one did); nothing elsewhere."""


class NoFaultTolerance:
    """Fault tolerance off: nothing is recovered from, every step is committed."""

    active = False

    def start(self, begin: Callable[[], None]) -> None:
        begin()

    def check(self) -> None:
        pass

    def recover(self, exc: BaseException, kind: str, local: Optional[dict[int, torch.Tensor]] = None) -> bool:
        return False

    def committed(self) -> bool:
        return True

    def at_boundary(self) -> None:
        pass

    def agree(self) -> bool:
        return False

    commits_by_node = False

    def commit(self, ok: bool) -> None:
        pass


class Core:
    """One algorithm running on one wrapper's parameters.

    Args:
        algorithm: the configured algorithm.
        named_parameters, named_buffers: what is trained and kept in agreement.
        group: the replicas' process group (None without torch.distributed).
        tag: the wrapper's tag (``new_tag``).
        modules: the modules whose forwards the algorithm may hook.
        broadcast_buffers: whether buffers follow rank 0's.
        bucket_cap_mb: the gradient bucket size, in MiB.
        requires_grad: per parameter, whether it is trained, where the tensors cannot say
            (FSDP2's local shards; ``Replica``).
        context: what the model and the wrapper ask of any algorithm (fault tolerance, FSDP2's
            local shards, sparse gradients): the one ``support.check`` reads at construction,
            kept for ``switch_to`` to check against.
        optimizers, around_steps: optimizers registered at once (``add_optimizer``), with the
            ``(before, after)`` callables of their steps.

    Example::

        core = Core(unison.algorithms.create("local_sgd"), net.named_parameters(), [], None, new_tag("test"))
        core.add_optimizer(opt, core.before_step, core.after_step)
        core.start()
    """

    def __init__(
        self,
        algorithm: Algorithm[Any],
        named_parameters: Sequence[tuple[str, nn.Parameter]],
        named_buffers: Sequence[tuple[str, torch.Tensor]],
        group: Optional[dist.ProcessGroup],
        tag: str,
        modules: Sequence[nn.Module] = (),
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25,
        requires_grad: Optional[Sequence[bool]] = None,
        context: Optional[support.Context] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        around_steps: Optional[tuple[StepFn, StepFn]] = None,
    ) -> None:
        self.algorithm = algorithm
        self.tag = tag
        self.optimizers: list[torch.optim.Optimizer] = []
        self.bucket_cap_mb = check_bucket_cap(bucket_cap_mb)
        self.clock = StepClock(self.optimizers)
        self.hooks = Hooks(self.clock, weak(self.replaced_step))
        self.reducer: Optional[GradReducer] = None
        self.dispatcher: Optional[Dispatcher] = None
        self.replica = Replica(
            named_parameters,
            named_buffers,
            self.optimizers,
            group,
            tag,
            self,
            modules,
            broadcast_buffers,
            requires_grad,
        )
        # What algorithms and engines that have left sent, and their synchronized backward passes.
        self.retired_bytes = 0
        self.retired_passes = 0
        self._optimizer_hooks: list[RemovableHandle] = []
        # Engines left behind by a membership change: their work may still write into their buffers.
        self.abandoned: list[GradReducer] = []
        self.fault: FaultPolicy = NoFaultTolerance()
        #: Keep the saved local gradients fault tolerance redoes a round from on the host (``ft_offload``).
        self.saved_on_host = False
        self.context = context or support.Context()
        for optimizer in optimizers:
            if around_steps is None:
                raise ValueError("optimizers need around_steps: what to call before and after each of their steps")
            self.add_optimizer(optimizer, *around_steps)

    # ---- the wrapper's calls ------------------------------------------------------------
    @contextmanager
    def entry(self, what: str) -> Iterator[None]:
        """Around one of the wrapper's calls (``what`` names it: "forward", "average()", ...): a
        collective that fails inside because of a peer raises ``RankFailure`` naming that peer
        (``unison.runtime.health``); any other error passes unchanged."""
        try:
            yield
        except Exception as exc:
            failure = health.explain(exc, what)
            if failure is exc:
                raise
            raise failure from exc

    def recovering(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again after each failure fault tolerance recovers from (``average()``).

        Over FSDP2 the node's processes then agree whether one of them met a failure (``agree``):
        if one did, all of them recover, and run ``fn()`` again."""
        while True:
            try:
                result = fn()
            except Exception as exc:
                if not self.fault.recover(exc, "drop"):
                    raise
                self.fault.agree()
                continue
            if not self.fault.agree():
                return result

    @property
    def fault_tolerant(self) -> bool:
        """Whether failures are recovered from (the fault policy is ``unison.fault.FaultTolerance``)."""
        return self.fault.active

    @property
    def commits_by_node(self) -> bool:
        """Whether the node's processes decide together whether a round is applied (the fault policy's)."""
        return self.fault.commits_by_node

    def commit(self, ok: bool) -> None:
        """Before a round of the algorithm's own is applied: the fault policy's ``commit``."""
        self.fault.commit(ok)

    # ---- the algorithm ------------------------------------------------------------
    @property
    def events(self) -> Dispatcher:
        """The running algorithm's dispatcher (RuntimeError once the wrapper is closed)."""
        if self.dispatcher is None:
            raise RuntimeError("this wrapper is closed: wrap the module (or optimizer) again to go on training")
        return self.dispatcher

    @property
    def fsdp2(self) -> bool:
        """The parameters are FSDP2's local shards."""
        return self.context.fsdp2

    def refuse_unsupported(self, algorithm: Algorithm[Any]) -> None:
        """Raise if ``algorithm`` cannot run here (``support.check`` in the context the wrapper was
        built in): before ``switch_to`` stops the running one. The model is the same on every rank,
        so every rank raises."""
        support.check(algorithm, self.context)

    def start(self) -> Dispatcher:
        """Set the algorithm up on the replica (its ``setup`` event). What it supports was checked
        before (at construction, or by ``switch_to``)."""
        self.dispatcher = Dispatcher(self.algorithm, self.replica)
        logger.debug("%s: algorithm %s on %d rank(s)", self.tag, self.algorithm.describe(), self.replica.world_size)
        return self.dispatcher

    def flush(self) -> None:
        """Finish the algorithm's pending communication and updates (nothing once the wrapper is closed)."""
        if self.dispatcher is not None:
            self.dispatcher.flush()

    def stop(self) -> None:
        """The algorithm leaves: it finishes its work, its hooks and the engine are removed."""
        dispatcher = self.dispatcher
        if dispatcher is None:
            return
        try:
            dispatcher.teardown()  # may still step optimizers (nonblocking's deferred step)
        finally:
            self.dispatcher = None
            self.hooks.remove()
            self.retired_bytes += dispatcher.bytes_sent
            self.remove_reducer()

    def release(self) -> None:
        """The wrapper is gone (closed or collected): no hook, no thread, no collective."""
        dispatcher, self.dispatcher = self.dispatcher, None
        if dispatcher is not None:
            dispatcher.release()
        self.remove_reducer()
        self.hooks.remove()
        self.hooks.restore_scalers()
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks.clear()

    def regroup(self, group: Optional[dist.ProcessGroup]) -> Optional[dict[str, Any]]:
        """The membership changed: leave the algorithm and its engine without a collective
        (their pending work is abandoned, kept alive in ``abandoned``) and talk over ``group``.

        Returns the algorithm's state entry when it could still be read, for ``start()``
        then ``load_algorithm_entry`` to carry it over.
        """
        entry = None
        dispatcher = self.dispatcher
        if dispatcher is not None:
            dispatcher.release()  # first: its syncs in flight are abandoned, not waited for
            try:
                entry = self.algorithm_entry()
            except Exception:  # its state waits on the old membership: start afresh
                entry = None
            self.retired_bytes += dispatcher.bytes_sent
        self.dispatcher = None
        self.hooks.remove()
        if self.reducer is not None:
            self.abandoned.append(self.reducer)
        self.remove_reducer()
        self.replica.regroup(group)
        return entry

    # ---- the gradient engine ----------------------------------------------------------
    def build_reducer(
        self,
        group: Optional[dist.ProcessGroup],
        sparse_params: Iterable[torch.Tensor] = (),
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        sync: Optional[Sync] = None,
        callbacks: Optional[Callbacks] = None,
    ) -> GradReducer:
        """The gradient engine over the trainable parameters. Under fault tolerance it keeps
        each pass's local gradients, to redo an interrupted round.

        Args:
            group: the group gradients are averaged over (None: one replica).
            sparse_params: parameters that get sparse gradients, besides those found in
                the modules (``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``).
            static_graph, gradient_as_bucket_view: torch DDP's meanings (``reducer.Layout``).
            sync, callbacks: when a pass synchronizes, and what the owner adds to it
                (``reducer.Sync``, ``reducer.Callbacks``).

        Raises ValueError naming the parameter when some get sparse gradients and the
        algorithm cannot reduce them (``sparse_gradients = False``), the same on every rank.
        """
        self.remove_reducer()
        sync, callbacks = sync or Sync(), callbacks or Callbacks()
        if self.fault.active:
            # A round's outcome must be known before its step is committed: completion is not deferred
            # (nonblocking still applies each layer's update at the next forward).
            sync = dataclasses.replace(sync, defers_completion=False)
        trainable = self.replica.trainable
        sparse = sparse_positions(trainable, self.replica.modules, sparse_params)
        layout = Layout(int(self.bucket_cap_mb * MB), sparse, static_graph, gradient_as_bucket_view)
        redo = Redo(self._recover_gradients if self.fault.active else None, self.saved_on_host)
        self.reducer = GradReducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            group,
            self.events,
            self.tag,
            layout,
            sync,
            callbacks,
            redo,
        )
        return self.reducer

    def _recover_gradients(self, exc: BaseException, reducer: GradReducer) -> bool:
        return self.fault.recover(exc, "grad", dict(reducer.local))

    def remove_reducer(self) -> None:
        """Remove the engine's hooks, keeping its traffic in the totals."""
        if self.reducer is not None:
            self.retired_bytes += self.reducer.bytes_total
            self.retired_passes += self.reducer.passes
            self.reducer.remove()
            self.reducer = None

    def set_bucket_size(self, bucket_cap_mb: float) -> None:
        """Re-plan the engine's buckets at ``bucket_cap_mb`` MiB, now and for later engines."""
        self.bucket_cap_mb = check_bucket_cap(bucket_cap_mb)
        if self.reducer is not None:
            self.reducer.set_bucket_cap(int(self.bucket_cap_mb * MB))

    # ---- optimizer steps ------------------------------------------------------------------
    def add_optimizer(self, optimizer: torch.optim.Optimizer, before: StepFn, after: StepFn) -> None:
        """Call ``before(optimizer)`` and ``after(optimizer)`` around each of its steps.

        The callables must not hold the wrapper (pass weak ones): a discarded
        wrapper is then released by its finalizer.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if any(opt is optimizer for opt in self.optimizers):
            raise ValueError("this optimizer is already registered with this wrapper")
        self._optimizer_hooks.append(optimizer.register_step_pre_hook(lambda opt, _args, _kwargs: before(opt)))
        self._optimizer_hooks.append(optimizer.register_step_post_hook(lambda opt, _args, _kwargs: after(opt)))
        self.optimizers.append(optimizer)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a registered optimizer's step: the algorithm's pre-step hooks."""
        self.hooks.run_before_step(optimizer)

    def before_forward(self) -> None:
        """Before the wrapper's forward: count it (the heartbeat carries the count), fault
        tolerance's check, then ``before_forward`` (a failure recovered from drops its round)."""
        health.advance()
        self.fault.check()
        try:
            self.events.before_forward()
        except Exception as exc:
            if not self.fault.recover(exc, "drop"):
                raise

    def after_step(self, optimizer: torch.optim.Optimizer, shadow: bool = False) -> None:
        """After a registered optimizer's step: count it, fire ``after_step``, then the
        algorithm's post-step hooks (not for a joined rank's shadow step).

        Under fault tolerance a step a heal already applied fires nothing, a failure is
        recovered from (its round dropped), and a membership change noticed after the last
        optimizer's step is taken up there. A step the algorithm replaced is committed where the
        user called it (``replaced_step``), not here (nonblocking's real steps run layer by layer).
        """
        replaced = self.hooks.replaced(optimizer)
        if not replaced and optimizer is self.optimizers[0] and not self.fault.committed():
            return  # a heal already applied this step
        try:
            self._after_step(optimizer, shadow)
        except Exception as exc:
            if not self.fault.recover(exc, "drop"):
                raise
        if not replaced and optimizer is self.optimizers[-1]:
            self.fault.at_boundary()

    def replaced_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user called a step the algorithm replaced (nonblocking records it, to apply at the
        next forward): that is the training step fault tolerance commits, and after the last
        optimizer's a membership change is taken up."""
        if optimizer is self.optimizers[0]:
            self.fault.committed()  # False: a heal applied it (its recorded step changes nothing)
        if optimizer is self.optimizers[-1]:
            self.fault.at_boundary()

    def _after_step(self, optimizer: torch.optim.Optimizer, shadow: bool) -> None:
        if not self.hooks.replaced(optimizer):
            self.clock.record(optimizer)  # a replaced step() counted itself when it was called
        try:
            self.events.after_step(optimizer)
        finally:
            if not shadow:
                self.hooks.run_after_step(optimizer)

    # ---- state and traffic --------------------------------------------------------------
    def algorithm_entry(self) -> Optional[dict[str, Any]]:
        """``{"name", "state"}`` of the running algorithm for a state dict, or None if it keeps none."""
        state = self.events.state_dict()
        return {"name": self.algorithm.name, "state": state} if state else None

    @property
    def shared_rounds(self) -> int:
        """Rounds of shared algorithm state completed (``State.shared_rounds``)."""
        state = self.events.state
        return state.shared_rounds if state is not None else 0

    def accepts(self, entry: dict[str, Any], strict: bool, what: str, advice: str = "") -> bool:
        """Whether ``entry`` (an ``algorithm_entry``) was saved by the running algorithm; one of
        another algorithm raises when ``strict`` (``what`` names the wrapper, ``advice`` says what
        to do: ``{saved}`` is the saved algorithm's name) and is ignored otherwise."""
        saved = entry["name"]
        if saved != self.algorithm.name and strict:
            raise ValueError(
                f"the state dict holds the state of algorithm {saved!r} but this {what} runs "
                f"{self.algorithm.name!r}{advice.format(saved=repr(saved))}"
            )
        return saved == self.algorithm.name

    def load_algorithm_entry(self, entry: dict[str, Any], strict: bool, what: str, advice: str = "") -> None:
        """Restore an ``algorithm_entry`` if ``accepts`` it."""
        if self.accepts(entry, strict, what, advice):
            self.events.load_state_dict(entry["state"])

    def count_bytes(self, nbytes: int) -> None:
        """Add ``nbytes`` sent outside the engines (FSDP2's all-reduce hook) to the totals."""
        self.retired_bytes += nbytes

    @property
    def bytes_total(self) -> int:
        """Everything this rank sent: gradient buckets and the algorithm's own traffic."""
        live = self.reducer.bytes_total if self.reducer is not None else 0
        return self.retired_bytes + live + (self.dispatcher.bytes_sent if self.dispatcher is not None else 0)

    @property
    def passes(self) -> int:
        """Synchronized backward passes, across every engine this wrapper has had."""
        return self.retired_passes + (self.reducer.passes if self.reducer is not None else 0)
