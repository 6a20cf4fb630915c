"""The Algorithm interface: the events of a training step an algorithm may react to.

An algorithm is a small configuration object, validated when it is created,
that reacts only to the events it needs. DataParallel owns the hooks and the
buckets and fires the events; the algorithm owns what is sent and when.

| event          | method            | fired                                        |
| -------------- | ----------------- | -------------------------------------------- |
| construction   | ``setup``         | once, when DataParallel is built or switched |
| before forward | ``before_forward``| at the start of every forward                |
| after forward  | ``after_forward`` | after every forward, with its output         |
| bucket ready   | ``reduce_bucket`` | when a gradient bucket is complete, in order |
| backward end   | ``after_backward``| after the buckets' reductions are complete   |
| optimizer step | ``after_step``    | after ``optimizer.step()`` of a registered optimizer |
| end of epoch   | ``end_epoch``     | when the user calls ``model.end_epoch(loss)`` |
| switch / save  | ``flush``         | before switching algorithms or checkpointing |
| final average  | ``average``       | ``model.average()`` and before a switch      |
| switch away    | ``teardown``      | when DataParallel stops using the algorithm  |

An algorithm's ``state_dict()`` (residuals, warm-start factors, momenta,
counters) is saved inside DataParallel's state dict and restored exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from .. import comm


class Algorithm:
    """Base class; subclasses set ``name`` and ``defaults`` and override events.

    ``defaults`` maps each option to its default value; an option not in it is
    refused at construction with a ValueError that lists the allowed ones.
    """

    name: ClassVar[str] = "base"
    defaults: ClassVar[dict[str, Any]] = {}
    #: Whether DataParallel runs the gradient buckets during backward.
    reduces_gradients: ClassVar[bool] = True
    #: Whether replicas train on local gradients between syncs (model averaging):
    #: then ``DataParallel.average()`` also averages the optimizers' states.
    replicas_drift: ClassVar[bool] = False
    #: Whether the end of backward leaves reductions in flight, for the
    #: algorithm to complete later with ``model._reducer.complete(buckets)``.
    defers_completion: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"algorithm {self.name!r} has no option {', '.join(map(repr, unknown))}; allowed options: {allowed}")
        self.options = {**self.defaults, **options}
        self.validate()

    def validate(self) -> None:
        """Check ``self.options``; raise ValueError saying what is allowed."""

    def describe(self) -> str:
        """A stable text naming the algorithm and its options, compared across ranks."""
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        return f"{self.name}({opts})"

    def __repr__(self) -> str:
        return self.describe()

    # ---- events -------------------------------------------------------
    def setup(self, model) -> None:
        """Construction: build per-model state."""

    def after_forward(self, model, output) -> None:
        """After every forward of the wrapped module, with its output."""

    def sync_gradients(self, model) -> bool:
        """Whether the backward pass about to run averages gradients (asked once per pass).

        Model-averaging algorithms answer False after their warm-up: their
        replicas then train on local gradients.
        """
        return True

    def gradient_group(self, model):
        """The process group gradients are averaged over (DASO: the node)."""
        return model.process_group

    def grad_scale(self, world_size: int) -> float:
        """Factor applied to local gradients as they are copied into buckets."""
        return 1.0 / world_size

    def reduce_bucket(self, bucket, group: Optional[dist.ProcessGroup]):
        """Start reducing ``bucket.flat`` in place; return something with ``wait()``.

        The default is one asynchronous allreduce (the gradients were scaled by
        ``grad_scale``, so the sum is the average): what "allreduce" does, and
        what model-averaging algorithms use during their synchronous warm-up.
        """
        return comm.start(dist.all_reduce, bucket.flat, group=group)

    def bucket_wire_bytes(self, bucket, world_size: int) -> int:
        """Bytes this rank sends for one bucket (a ring allreduce)."""
        return comm.ring_bytes(bucket.nbytes, world_size)

    def before_forward(self, model) -> None:
        """Before every forward of the wrapped module."""

    def after_backward(self, model) -> None:
        """After a synchronized backward, once every bucket is reduced."""

    def after_step(self, model, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.step()`` of an optimizer registered with the model."""

    def end_epoch(self, model, loss: Optional[float]) -> None:
        """At the end of an epoch, with the epoch's loss if the user gives one."""

    def flush(self, model) -> None:
        """Finish this rank's pending work (local: no new collective), before a switch or a checkpoint."""

    def average(self, model) -> None:
        """Make every replica identical now (a collective: every rank calls it).

        Called by ``DataParallel.average()`` and before a switch; algorithms
        whose replicas drift apart between syncs override it.
        """

    def open_thread(self, model, group=None) -> None:
        """Give this algorithm a private process group (``self.group``, a copy of
        ``group``, default the model's) and a CommThread (``self.thread``) for
        reductions of several dependent collectives; ``teardown`` closes it."""
        self.group = comm.private_group(group if group is not None else model.process_group, f"{model.serial}/{self.name}")
        self.thread = comm.CommThread(f"unison-{self.name}")

    def teardown(self, model) -> None:
        """The model stops using this algorithm: release its thread, if it opened one."""
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.close()
            self.thread = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"algorithm {self.name!r} keeps no state but was given {sorted(state)}")


class StepCounter:
    """Counts training steps: one ends when every optimizer given to DataParallel
    has stepped since the last (``after_step`` fires once per optimizer)."""

    def __init__(self) -> None:
        self.steps = 0
        self.pending: set[int] = set()

    def step_ended(self, model, optimizer) -> bool:
        """Record ``optimizer``'s step; True when it completes a training step."""
        self.pending.add(id(optimizer))
        if len(self.pending) < len(model.optimizers):
            return False
        self.pending.clear()
        self.steps += 1
        return True


def require_optimizers(model, name: str) -> None:
    """Refuse to run algorithm ``name`` on a model built without its optimizer(s)."""
    if not model.optimizers:
        raise ValueError(
            f"{name!r} acts after each optimizer step, so it needs the optimizer(s): "
            f"DataParallel(module, optimizer=opt, algorithm={name!r})"
        )


def check_int(options: dict, name: str, minimum: int = 1) -> None:
    """Refuse an option that is not an integer of at least ``minimum`` (bools are not integers here)."""
    value = options[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
