"""The Algorithm interface: configuration, plus reactions to the events of a training step.

An algorithm object holds only its validated options (declared once with
``unison.algorithms.options``); ``setup(replica)`` builds the per-model state,
and every event receives the ``Replica`` and that state. The events, and the
order in which ``unison.events.Dispatcher`` fires them, are listed in
docs/architecture.md.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Optional, TypeVar

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.buckets import Bucket
from ..replica import Replica
from .configured import Configured
from .state import State, ThreadedState

__all__ = ["Algorithm", "State", "ThreadedState", "open_thread"]


S = TypeVar("S", bound=Optional[State])


class Algorithm(Configured, Generic[S]):
    """Base class: subclasses set ``name``, declare options and override the events they need.

    ``S`` is the type of the state ``setup`` builds (None for an algorithm that keeps none);
    every event receives the ``Replica`` and that state.

    Args:
        **options: the algorithm's options (see each algorithm's docstring);
            an unknown one, or a value out of range, raises ValueError saying
            what is allowed.

    Example::

        class Halve(Algorithm[None]):
            name = "halve"
            factor = options.Number(0.5)

            def grad_scale(self, replica: Replica, state: None, world_size: int) -> float:
                return self.factor / world_size
    """

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

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.validate()

    def validate(self) -> None:
        """Checks that involve several options; raise ValueError saying what is allowed."""

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
