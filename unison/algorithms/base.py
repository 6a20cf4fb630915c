"""The Algorithm interface: configuration, plus reactions to the events of a training step.

An algorithm object holds only its validated options (declared once with
``unison.algorithms.options``); ``setup(replica)`` builds the per-model state,
and every event receives the ``Replica`` and that state. The events, and the
order in which ``unison.events.Dispatcher`` fires them, are listed in
docs/architecture.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from ..engine import comm
from . import options as opts


class State:
    """Base of an algorithm's per-model state: what ``setup`` returns.

    Subclasses declare their slots in one place (``__slots__`` or a dataclass)
    and list in ``saved`` the attributes that ``state_dict`` keeps.
    """

    saved: ClassVar[tuple[str, ...]] = ()
    #: Bytes the algorithm sent itself (weights, pseudo-gradients), apart from gradient buckets.
    bytes_sent: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - set(self.saved))
        if unknown:
            raise ValueError(f"{type(self).__name__} does not keep {unknown}; it keeps {list(self.saved)}")
        for name, value in state.items():
            setattr(self, name, value)


class Algorithm:
    """Base class: subclasses set ``name``, declare options and override the events they need.

    Args:
        **options: the algorithm's options (see each algorithm's docstring);
            an unknown one, or a value out of range, raises ValueError saying
            what is allowed.

    Example::

        class Halve(Algorithm):
            name = "halve"
            factor = options.Number(0.5)

            def grad_scale(self, replica, state, world_size):
                return self.factor / world_size
    """

    name: ClassVar[str] = "base"
    #: Every option with its default (filled in for each subclass from its declarations).
    defaults: ClassVar[dict[str, Any]] = {}
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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options_declared = opts.declared(cls)
        cls.defaults = {name: o.default for name, o in cls.options_declared.items()}

    def __init__(self, **options: Any) -> None:
        self._values, self._written = opts.resolve(self.name, type(self).options_declared, options)
        self.validate()

    @property
    def options(self) -> dict[str, Any]:
        """The options, each under the name it was given by (its canonical name when not given)."""
        return {self._written.get(name, name): value for name, value in self._values.items()}

    def validate(self) -> None:
        """Checks that involve several options; raise ValueError saying what is allowed."""

    def describe(self) -> str:
        """A stable text naming the algorithm and its options, compared across ranks."""
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in sorted(self._values.items()))})"

    def __repr__(self) -> str:
        return self.describe()

    # ---- set-up -------------------------------------------------------------
    def setup(self, replica) -> Optional[State]:
        """Construction (and after a switch): build the per-model state."""
        if self.needs_optimizers and not replica.optimizers:
            raise ValueError(
                f"{self.name!r} acts after each optimizer step, so it needs the optimizer(s): "
                f"DataParallel(module, optimizer=opt, algorithm={self.name!r})"
            )
        return None

    def teardown(self, replica, state) -> None:
        """The model stops using this algorithm: release threads (hooks are removed by the wrapper)."""
        thread = getattr(state, "thread", None)
        if thread is not None:
            thread.close()
            state.thread = None

    def release(self, replica, state) -> None:
        """The wrapper was garbage-collected without ``close()``: stop threads without any
        collective (other ranks may not be releasing now)."""
        self.teardown(replica, state)

    # ---- forward -------------------------------------------------------------
    def before_forward(self, replica, state) -> None:
        """Before every forward of the wrapped module."""

    def after_forward(self, replica, state, output) -> None:
        """After every forward of the wrapped module, with its output."""

    # ---- the gradient engine's questions --------------------------------------
    def gradient_group(self, replica, state) -> Optional[dist.ProcessGroup]:
        """The process group gradients are averaged over (DASO: the node)."""
        return replica.group

    def sync_gradients(self, replica, state) -> bool:
        """Whether the backward pass about to run averages gradients (asked once per pass)."""
        return True

    def grad_scale(self, replica, state, world_size: int) -> float:
        """Factor applied to local gradients as they are copied into buckets."""
        return 1.0 / world_size

    def reduce_bucket(self, replica, state, bucket, group: Optional[dist.ProcessGroup]):
        """Start reducing ``bucket.flat`` in place; return something with ``wait()``.

        The default is one asynchronous allreduce (the gradients were scaled by
        ``grad_scale``, so the sum is the average).
        """
        return comm.start(dist.all_reduce, bucket.flat, group=group)

    def bucket_wire_bytes(self, replica, state, bucket, world_size: int) -> int:
        """Bytes this rank sends for one bucket (a ring allreduce)."""
        return comm.ring_bytes(bucket.nbytes, world_size)

    def after_backward(self, replica, state) -> None:
        """After a synchronized backward, once every bucket is reduced."""

    # ---- step, epoch, end ---------------------------------------------------------
    def after_step(self, replica, state, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` of a registered optimizer (``replica.step_ended`` says
        whether it completed a training step)."""

    def end_epoch(self, replica, state, loss: Optional[float]) -> None:
        """At the end of an epoch, with the epoch's loss if the user gives one."""

    def flush(self, replica, state) -> None:
        """Finish this rank's pending work (local: no new collective), before a switch or a checkpoint."""

    def average(self, replica, state) -> None:
        """Make every replica identical now (a collective: every rank calls it).

        Algorithms whose replicas drift apart between syncs override it to
        finish or drop syncs in flight; the wrapper then averages the weights.
        """


def open_thread(replica, name: str, group=None):
    """A private process group and a CommThread for reductions of several dependent
    collectives (``(group, thread)``); ``Algorithm.teardown`` closes a ``state.thread``."""
    return replica.private_group(name, group), comm.CommThread(f"unison-{name}")
