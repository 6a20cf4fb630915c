"""The Algorithm interface: configuration, plus reactions to the events of a training step.

An algorithm object holds only its options: an ``Algorithm`` subclass is a
keyword-only dataclass whose fields are its options, checked in
``__post_init__`` (with ``unison.algorithms.options``). ``setup(replica)``
builds the per-model state, and every event receives the ``Replica`` and that
state. The events, and the order in which ``unison.events.Dispatcher`` fires
them, are listed in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, Optional, TypeVar

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.buckets import Bucket
from ..replica import Replica
from . import options as checks
from .state import State, ThreadedState

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # torch installs typing_extensions
    from typing_extensions import dataclass_transform

__all__ = ["Algorithm", "Recovery", "State", "ThreadedState", "open_thread"]


@dataclasses.dataclass(frozen=True)
class FSDP2:
    """What running over a module sharded by FSDP2 (``fully_shard``, then ``DataParallel``) needs of
    an algorithm: declared on its class as ``fsdp2``. An algorithm that declares none is refused
    over FSDP2, at construction and at ``switch_to`` (``unison.algorithms.support.check``).

    Attributes:
        gradients: it averages gradients: the wrapper averages FSDP2's reduce-scattered shards
            across the replicas (in the class's ``wire_dtype`` where it has one); without it the
            algorithm averages the local shards of the model itself (model averaging).
        fault_tolerant: it also runs under ``fault_tolerant=True`` over FSDP2, unstreamed.
    """

    gradients: bool = False
    fault_tolerant: bool = False


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What fault tolerance (``DataParallel(fault_tolerant=True)``, ``unison.fault``) needs of an
    algorithm: declared on its class as ``recovery``. An algorithm that declares none is refused
    under fault tolerance at construction.

    A joiner, and every member behind the most advanced one, receives the model, the optimizers
    and the algorithm's state (``state_dict``) from that member: everything is shared but the
    entries named ``rank_local``. A gradient round a failure interrupted is always done again on
    the new membership from each member's saved local gradient (an algorithm whose reduction
    changes state of its own, demo's momentum or powersgd's residuals, undoes it in ``release``,
    which every membership change calls before the state is read, or from the saved gradients:
    ``Replica.saved_gradients``); ``interrupted`` says what becomes of a sync of the algorithm's
    own (an average, an outer step).

    Attributes:
        rank_local: the entries of the state's ``state_dict`` that belong to one worker (error
            feedback): a healed member keeps its own, a joiner starts them at zero.
        interrupted: ``"drop"``: an interrupted sync only pulled drifting replicas together, the
            next one does it (local SGD, gossip); ``"relaunch"``: its result is state every replica
            shares (DiLoCo's outer step), so it is launched again on the new membership at the
            next step.
        reload_after_heal: after a heal every member loads its own state again, so that what a
            load changes in the next round (low-precision decentralized resends its copies in
            full) changes on every member alike.
        deferred_step: ``optimizer.step()`` only records the update, which the algorithm applies
            later in ``flush`` or before (nonblocking: layer by layer at the next forward). The
            step is committed where it is recorded; under fault tolerance the gradient round
            completes at the end of backward (its outcome is known before the step is committed),
            and what is recorded is applied (``flush``, local) before a membership change is
            settled and after a redone round, so a heal sends every committed step.

    Example::

        class MyAverage(Algorithm[MyState]):
            name = "my_average"
            recovery = Recovery(rank_local=("feedback",), interrupted="drop")
    """

    rank_local: tuple[str, ...] = ()
    interrupted: str = "drop"
    reload_after_heal: bool = False
    deferred_step: bool = False

    def __post_init__(self) -> None:
        if self.interrupted not in ("drop", "relaunch"):
            raise ValueError(f"Recovery(interrupted={self.interrupted!r}): choose 'drop' or 'relaunch'")

    @property
    def relaunches(self) -> bool:
        """Whether an interrupted sync is launched again (its result is shared state)."""
        return self.interrupted == "relaunch"


S = TypeVar("S", bound=Optional[State])
A = TypeVar("A", bound="Algorithm[Any]")


@dataclass_transform(kw_only_default=True, eq_default=False, field_specifiers=(dataclasses.field,))
class Algorithm(Generic[S]):
    """Base class: subclasses set ``name``, declare their options as fields and override the events they need.

    Every subclass is made a keyword-only dataclass (no decorator to write):
    its annotated class attributes are its options, with their defaults, so
    ``PowerSGD(rank=4)`` is checked by mypy; ``__post_init__`` refuses a bad
    value with a ValueError saying what is allowed (its own options first,
    then ``super().__post_init__()``, then checks across options). An inherited
    option a subclass fixes is declared ``field(default=..., init=False)``.

    ``S`` is the type of the state ``setup`` builds (None for an algorithm that keeps none);
    every event receives the ``Replica`` and that state.

    Example::

        class Halve(Algorithm[None]):
            name = "halve"
            factor: float = 0.5

            def __post_init__(self) -> None:
                options.number("factor", self.factor)
                super().__post_init__()

            def grad_scale(self, replica: Replica, state: None, world_size: int) -> float:
                return self.factor / world_size
    """

    name: ClassVar[str] = "base"
    #: Every option with its default, in declaration order (the class's own first, then inherited ones).
    defaults: ClassVar[dict[str, Any]] = {}
    #: Every option's dataclass field, in the order of ``defaults``.
    options_declared: ClassVar[dict[str, dataclasses.Field[Any]]] = {}

    #: Whether the wrapper runs the gradient buckets during backward.
    reduces_gradients: ClassVar[bool] = True
    #: Whether replicas train on local gradients between syncs (model averaging):
    #: then ``DataParallel.average()`` also averages the optimizers' states.
    replicas_drift: ClassVar[bool] = False
    #: Whether the end of backward leaves reductions in flight, for the
    #: algorithm to complete later through ``replica.complete(buckets)``.
    defers_completion: ClassVar[bool] = False
    #: Whether the algorithm acts after optimizer steps, so it needs the optimizers.
    needs_optimizers: ClassVar[bool] = False
    #: Whether it takes parameters with sparse gradients (``nn.Embedding(sparse=True)``): the
    #: engine sums those itself with a sparse allreduce, outside the buckets; an algorithm whose
    #: reduction must see every gradient (a compressor with error feedback) says False and is
    #: refused at construction for such a model.
    sparse_gradients: ClassVar[bool] = True
    #: Whether gradient averaging, once ``sync_gradients`` says False, stays off (a warm-up has
    #: ended): the engine then lets its buckets go (1 P), to make them again should it resume.
    #: An algorithm that alternates (DASO's skipped batches) keeps them, rather than make them anew
    #: at every synchronized batch.
    stops_gradient_sync: ClassVar[bool] = False
    #: What fault tolerance needs of it (``Recovery``); None: refused under ``fault_tolerant=True``.
    recovery: ClassVar[Optional[Recovery]] = None
    #: What FSDP2 needs of it (``FSDP2``); None: refused over a module sharded by FSDP2.
    fsdp2: ClassVar[Optional[FSDP2]] = None

    #: Options declared the earlier way (``period = options.Int(16)``), with their checks.
    legacy_options: ClassVar[dict[str, checks.Option]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _fields_from_legacy_options(cls)
        # identity equality and the repr of describe(), as before options were fields
        dataclasses.dataclass(kw_only=True, eq=False, repr=False)(cls)
        cls.options_declared = _declared(cls)
        cls.defaults = {name: f.default for name, f in cls.options_declared.items()}

    def __post_init__(self) -> None:
        """Check the options: a subclass checks its own, then calls ``super().__post_init__()``,
        then checks what involves several options; raise ValueError saying what is allowed."""
        self._given_as: dict[str, str] = {}  # option -> the alias it was given by (set by from_options)
        for name, option in self.legacy_options.items():
            option.check(name, getattr(self, name))
        validate = getattr(self, "validate", None)  # the earlier hook for checks across options
        if callable(validate):
            validate()

    @classmethod
    def from_options(cls: type[A], given: Mapping[str, Any], aliases: Mapping[str, Sequence[str]] = {}) -> A:
        """An instance from options given by name or by one of their ``aliases`` (``create``'s way in).

        Raises ValueError naming an unknown option (with the allowed ones), one
        given twice under two names, or a value not allowed (named as given).
        """
        aliases = {**{n: o.aliases for n, o in cls.legacy_options.items() if o.aliases}, **aliases}
        values, given_as = checks.resolve(cls.name, list(cls.options_declared), aliases, given)
        try:
            algorithm = cls(**values)
        except checks.OptionError as error:
            raise checks.as_given(error, given_as, aliases) from None
        algorithm._given_as = given_as
        return algorithm

    @property
    def option_values(self) -> dict[str, Any]:
        """Every option's value as given, under its own name."""
        return {name: getattr(self, name) for name in self.options_declared}

    @property
    def options(self) -> dict[str, Any]:
        """The options, each under the name it was given by (its own name when not given)."""
        given_as: dict[str, str] = getattr(self, "_given_as", {})  # {}: a __post_init__ without super()
        return {given_as.get(name, name): value for name, value in self.option_values.items()}

    def describe(self) -> str:
        """A stable text naming the algorithm and its options, compared across ranks and saved in checkpoints."""
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in sorted(self.option_values.items()))})"

    def __repr__(self) -> str:
        return self.describe()

    # ---- set-up -------------------------------------------------------------
    def setup(self, replica: Replica) -> S:
        """Construction (and after a switch): build the per-model state."""
        self.check_optimizers(replica)
        return None  # type: ignore[return-value]  # an algorithm with a state overrides setup

    def check_optimizers(self, replica: Replica) -> None:
        """Refuse a model given no optimizer when the algorithm acts after optimizer steps."""
        if self.needs_optimizers and not replica.optimizers:
            raise ValueError(
                f"{self.name!r} acts after each optimizer step, so it needs the optimizer(s): "
                f"DataParallel(module, optimizer=opt, algorithm={self.name!r})"
            )

    def teardown(self, replica: Replica, state: S) -> None:
        """The model stops using this algorithm: release threads (hooks are removed by the wrapper)."""
        if state is not None:
            state.close()

    def release(self, replica: Replica, state: S) -> None:
        """The wrapper was garbage-collected without ``close()``: stop threads without any
        collective (other ranks may not be releasing now)."""
        self.teardown(replica, state)

    # ---- forward -------------------------------------------------------------
    def before_forward(self, replica: Replica, state: S) -> None:
        """Before every forward of the wrapped module."""

    def after_forward(self, replica: Replica, state: S, output: Any) -> None:
        """After every forward of the wrapped module, with its output."""

    # ---- the gradient engine's questions --------------------------------------
    def gradient_group(self, replica: Replica, state: S) -> Optional[dist.ProcessGroup]:
        """The process group gradients are averaged over (DASO: the node)."""
        return replica.group

    def sync_gradients(self, replica: Replica, state: S) -> bool:
        """Whether the backward pass about to run averages gradients (asked once per pass)."""
        return True

    def grad_scale(self, replica: Replica, state: S, world_size: int) -> float:
        """Factor applied to local gradients as they are copied into buckets."""
        return 1.0 / world_size

    def reduce_bucket(
        self, replica: Replica, state: S, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[comm.Waitable]:
        """Start reducing ``bucket.flat`` in place; return something with ``wait()`` (None: nothing to wait for).

        The default is one asynchronous allreduce (the gradients were scaled by
        ``grad_scale``, so the sum is the average).
        """
        return comm.start(dist.all_reduce, bucket.flat, group=group)

    def bucket_wire_bytes(self, replica: Replica, state: S, bucket: Bucket, world_size: int) -> int:
        """Bytes this rank sends for one bucket (a ring allreduce)."""
        return comm.ring_bytes(bucket.nbytes, world_size)

    def after_backward(self, replica: Replica, state: S) -> None:
        """After a synchronized backward, once every bucket is reduced."""

    # ---- step, epoch, end ---------------------------------------------------------
    def after_step(self, replica: Replica, state: S, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` of a registered optimizer (``replica.step_ended`` says
        whether it completed a training step)."""

    def end_epoch(self, replica: Replica, state: S, loss: Optional[float], averaged: bool) -> None:
        """At the end of an epoch, with the epoch's loss if the user gives one (``averaged``:
        it is already the mean over the ranks)."""

    def flush(self, replica: Replica, state: S) -> None:
        """Finish this rank's pending work (local: no new collective), before a switch or a checkpoint."""

    def average(self, replica: Replica, state: S) -> None:
        """Make every replica identical now (a collective: every rank calls it).

        Algorithms whose replicas drift apart between syncs override it to
        finish or drop syncs in flight; the wrapper then averages the weights.
        """


def open_thread(
    replica: Replica, name: str, group: Optional[dist.ProcessGroup] = None
) -> tuple[Optional[dist.ProcessGroup], comm.CommThread]:
    """A private process group and a CommThread for reductions of several dependent
    collectives (``(group, thread)``, for a ``ThreadedState``)."""
    return replica.private_group(name, group), comm.CommThread(f"unison-{name}")


def _declared(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The options of an algorithm class (its ``__init__``'s fields): each class's own in
    declaration order, the class's first, then its bases'."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    order = [name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {}) if name in fields]
    return {name: fields[name] for name in dict.fromkeys(order)}


def _fields_from_legacy_options(cls: type) -> None:
    """Turn options declared the earlier way (``period = options.Int(16)``) into dataclass fields
    whose checks ``__post_init__`` runs, with a DeprecationWarning naming the typed form."""
    own = {name: value for name, value in vars(cls).items() if isinstance(value, checks.Option)}
    if not own:
        return
    warnings.warn(
        f"{cls.__name__} declares its options as unison.algorithms.options.{type(next(iter(own.values()))).__name__}"
        f"(...) attributes, the earlier way: declare them as typed fields ({next(iter(own))}: int = ...) and check "
        "them in __post_init__ (docs/architecture.md#options)",
        DeprecationWarning,
        stacklevel=3,
    )
    annotations = dict(vars(cls).get("__annotations__", {}))
    for name, option in own.items():
        annotations[name] = "Any"
        setattr(cls, name, option.default)
    cls.__annotations__ = annotations
    cls.legacy_options = {**getattr(cls, "legacy_options", {}), **own}  # type: ignore[attr-defined]
