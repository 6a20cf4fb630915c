"""HeAT's ``heat.optim.dp_optimizer``: ``DataParallelOptimizer`` and ``DASO`` over unison.

``DataParallelOptimizer`` wraps a torch optimizer for ``ht.nn.DataParallel``;
``DASO`` is the configuration and the training-loop face of unison's "daso"
algorithm, which ``ht.nn.DataParallelMultiGPU(module, daso)`` runs. See
``docs/migration.md`` for HeAT's checklist side by side with unison's.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any, Optional, Union

import torch

import unison
from unison.algorithms.averaging.daso import DASOState, Schedule

from ..core.communication import MPICommunication, as_communicator, is_mpi_comm

__all__ = ["DASO", "DataParallelOptimizer"]


class DataParallelOptimizer:
    """A torch optimizer for ``ht.nn.DataParallel``, whose step may be deferred.

    Args:
        torch_optimizer: the torch optimizer to wrap.
        blocking: whether ``step()`` updates the parameters at once (True) or
            at the next forward (False, HeAT's non-blocking updates).
            ``ht.nn.DataParallel`` overwrites it with its own
            ``blocking_parameter_updates``, as in HeAT.

    With a non-blocking ``DataParallel`` the update is applied layer by layer
    just before each layer's next forward (unison's "nonblocking" algorithm);
    ``update_next`` is True from ``step()`` until that forward. ``zero_grad()``
    is deferred with it. Unlike HeAT, several optimizers, or an optimizer over
    only some of the model's parameters, stay non-blocking.

    Example::

        >>> optimizer = ht.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        >>> model = ht.nn.DataParallel(net, ht.MPI_WORLD, optimizer)
        >>> loss_fn(model(x), y).backward()
        >>> optimizer.step()        # applied at the next forward
    """

    def __init__(self, torch_optimizer: torch.optim.Optimizer, blocking: bool = False) -> None:
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f"torch_optimizer must be a torch.optim.Optimizer, not {type(torch_optimizer).__name__}")
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking parameter must be a boolean, currently {type(blocking)}")
        self.torch_optimizer = torch_optimizer
        self.blocking_parameter_updates = blocking
        self.update_next = False

    @property
    def params_ref(self) -> list:
        """The parameters of the wrapped optimizer's first group (HeAT's reference)."""
        return self.torch_optimizer.param_groups[0]["params"]

    def step(self) -> None:
        """Update the parameters: now when blocking, at the next forward when not."""
        self.torch_optimizer.step()  # deferred by the non-blocking DataParallel when it runs
        self.update_next = not self.blocking_parameter_updates

    def zero_grad(self) -> None:
        """Zero the gradients (HeAT zeroes them rather than setting them to None)."""
        self.torch_optimizer.zero_grad(set_to_none=False)


# ---- DASO -------------------------------------------------------------------

_DOWNCAST_TYPES = (torch.bfloat16, torch.half, torch.float)


def _check_int(name: str, value: Any, minimum: int, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, currently {type(value)}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, currently {value}")


class DASO:
    """Distributed Asynchronous and Selective Optimization (HeAT's ``ht.optim.DASO``).

    Gradients are averaged inside each node every batch; across nodes the
    weights are averaged now and then by one inter-node group at a time, sent
    in ``downcast_type`` and merged a few batches later while training goes on
    (unison's "daso" algorithm, which ``ht.nn.DataParallelMultiGPU(module,
    daso)`` runs). Phases as in HeAT: blocking syncs after every batch in the
    ``warmup_epochs`` first and ``cooldown_epochs`` last epochs; in between the
    skips follow the loss given to ``epoch_loss_logic`` at each epoch's end.

    Args:
        local_optimizer: the torch optimizer of the local model.
        total_epochs: the number of epochs (for the cool-down).
        comm: the communicator: None or ``ht.MPI_WORLD`` (the world), a torch
            ProcessGroup, or an mpi4py communicator; DASO runs on the world.
        warmup_epochs: blocking epochs at the start (>= 0).
        cooldown_epochs: blocking epochs at the end (>= 0).
        scheduler: an LR scheduler stepped by ``step()`` after the optimizer,
            once per batch. A scheduler object that is not a torch
            ``LRScheduler`` is taken in HeAT's sense, a scheduler whose
            ``step()`` also steps the optimizer: then only it is stepped.
            ``ReduceLROnPlateau`` needs the loss: step it yourself per epoch.
        stability_level: the relative loss change below which an epoch does
            not count as improving (the plateau test that shrinks the skips).
        max_global_skips: the most batches between two global syncs.
        sending_chunk_size: the most elements in one chunk of a global sync.
        downcast_type: the wire dtype of global syncs: torch.bfloat16,
            torch.half or torch.float.
        use_mpi_groups: HeAT's choice between MPI_Group_incl and MPI_Comm_split
            to build the inter-node communicators, which give the same groups;
            unison builds torch.distributed groups, so it has no effect.
        skip_reduction_factor: how much the skips shrink when the loss is stable.
        local_skip_factor: global skips per local skip after a reset.
        verbose: print the schedule on rank 0 at each epoch's end (``print0``).

    Attributes ``epoch``, ``global_skip``, ``local_skip``, ``batches_to_wait``
    and ``current_batch`` (this epoch's batches) read the running schedule,
    ``model.algorithm_state.schedule``; ``algorithm`` is the unison "daso"
    algorithm the model runs.
    ``last_batch`` is not needed: the epoch ends with ``epoch_loss_logic``,
    which also makes the final blocking sync HeAT makes at the last batch.
    When set, it is checked against the batches stepped in the epoch (a
    mismatch warns: the ranks' loaders may be uneven).

    Example::

        >>> optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> daso = ht.optim.DASO(local_optimizer=optimizer, total_epochs=epochs)
        >>> model = ht.nn.DataParallelMultiGPU(net, daso)
        >>> for epoch in range(epochs):
        ...     for x, y in loader:
        ...         daso.zero_grad()
        ...         loss = loss_fn(model(x), y)
        ...         loss.backward()
        ...         daso.step()
        ...     daso.epoch_loss_logic(loss)
    """

    def __init__(
        self,
        local_optimizer: torch.optim.Optimizer,
        total_epochs: int,
        comm: Any = None,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        scheduler: Any = None,
        stability_level: float = 0.05,
        max_global_skips: int = 8,
        sending_chunk_size: int = 10_000_000,
        downcast_type: torch.dtype = torch.bfloat16,
        use_mpi_groups: bool = True,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        verbose: bool = False,
    ) -> None:
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError(f"Local optimizer must be a torch optimizer object, currently {type(local_optimizer)}")
        known = (MPICommunication, torch.distributed.ProcessGroup)
        if comm is not None and not isinstance(comm, known) and not is_mpi_comm(comm):
            raise TypeError(
                f"Comm object must be ht.MPI_WORLD, a torch ProcessGroup or an mpi4py communicator, currently {type(comm)}"
            )
        _check_int("total_epochs", total_epochs, 0, strict=True)
        _check_int("warmup_epochs", warmup_epochs, 0)
        _check_int("cooldown_epochs", cooldown_epochs, 0)
        _check_int("max_global_skips", max_global_skips, 0)
        _check_int("sending_chunk_size", sending_chunk_size, 0, strict=True)
        _check_int("skip_reduction_factor", skip_reduction_factor, 0, strict=True)
        _check_int("local_skip_factor", local_skip_factor, 0, strict=True)
        level: object = stability_level  # checked at run time: a script may pass anything
        if isinstance(level, bool) or not isinstance(level, numbers.Real):
            raise TypeError(f"stability_level must be a float, currently {type(stability_level)}")
        for name, flag in (("verbose", verbose), ("use_mpi_groups", use_mpi_groups)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, currently {type(flag)}")
        if not isinstance(downcast_type, torch.dtype):
            raise TypeError(f"downcast_type must be a torch.dtype, currently {downcast_type}")
        if downcast_type not in _DOWNCAST_TYPES:
            raise ValueError(
                f"downcast_type must be one of [torch.bfloat16, torch.half, torch.float], currently {downcast_type}"
            )
        _check_scheduler(scheduler)

        self.local_optimizer = local_optimizer
        self.total_epochs = total_epochs
        self.comm = as_communicator(comm)
        self.warmup_epochs = warmup_epochs
        self.cooldown_epochs = cooldown_epochs
        self.scheduler = scheduler
        self.max_gs = max_global_skips
        self.split_val = sending_chunk_size
        self.cast_dtype = downcast_type
        self.use_mpi_groups = use_mpi_groups
        self.skip_reduction_factor = skip_reduction_factor
        self.local_skip_factor = local_skip_factor
        self.stability_level = float(stability_level)
        self.verbose = verbose
        self.amp = False
        self.scaler: Optional[torch.amp.GradScaler] = None
        self.module: Optional[unison.DataParallel] = None
        self.last_batch: Optional[int] = None
        self._options = {
            "total_epochs": total_epochs,
            "warmup_epochs": warmup_epochs,
            "cooldown_epochs": cooldown_epochs,
            "stability_level": stability_level,
            "max_global_skips": max_global_skips,
            "sending_chunk_size": sending_chunk_size,
            "downcast_type": downcast_type,
            "use_mpi_groups": use_mpi_groups,
            "skip_reduction_factor": skip_reduction_factor,
            "local_skip_factor": local_skip_factor,
        }
        self.algorithm = self._new_algorithm()

    def _new_algorithm(self) -> unison.algorithms.Algorithm:
        """A fresh "daso" algorithm with this object's options; a value HeAT takes and unison refuses is named."""
        try:
            return unison.algorithms.create("daso", **self._options)
        except ValueError as exc:
            raise NotImplementedError(
                f"HeAT's DASO accepts these settings but unison's 'daso' algorithm does not yet: {exc}"
            ) from exc

    # ---- the running schedule ------------------------------------------
    def _schedule(self) -> Optional[Schedule]:
        """The schedule of the model DASO drives, ``model.algorithm_state.schedule`` (None before one)."""
        if self.module is None:
            return None
        state = self.module.algorithm_state
        if not isinstance(state, DASOState):
            raise RuntimeError(
                "the model this DASO drives runs DASO no more (closed, or switched to another algorithm)"
            )
        return state.schedule

    @property
    def epoch(self) -> int:
        """Epochs ended so far (by ``epoch_loss_logic``)."""
        schedule = self._schedule()
        return 0 if schedule is None else schedule.epoch

    @property
    def current_batch(self) -> int:
        """Batches ended in this epoch (optimizer steps, and steps a GradScaler skipped)."""
        schedule = self._schedule()
        return 0 if schedule is None else schedule.batch

    @property
    def global_skip(self) -> int:
        """Batches between two global syncs this epoch (0: blocking sync after every batch)."""
        schedule = self._schedule()
        return 0 if schedule is None else schedule.global_skip

    @property
    def local_skip(self) -> int:
        """Batches between two node-local gradient averages this epoch (0 or 1: every batch)."""
        schedule = self._schedule()
        return 0 if schedule is None else schedule.local_skip

    @property
    def batches_to_wait(self) -> int:
        """Batches between sending a global sync and merging it (0 in blocking epochs)."""
        schedule = self._schedule()
        return 0 if schedule is None else schedule.batches_to_wait

    @property
    def params_ref(self) -> list:
        """The parameters of the local optimizer's first group (HeAT's reference)."""
        return self.local_optimizer.param_groups[0]["params"]

    @property
    def loc_gpus(self) -> int:
        """Processes per node (HeAT counts the node's GPUs, one process each)."""
        return unison.topology().local_world_size

    # ---- set-up ----------------------------------------------------------
    def set_model(self, model: unison.DataParallel) -> None:
        """Bind the model DASO drives; ``ht.nn.DataParallelMultiGPU(module, daso)`` calls it.

        Args:
            model: a ``DataParallelMultiGPU`` (any ``unison.DataParallel``)
                running this DASO's algorithm. A plain module cannot be driven
                (its forward would not reach the gradient engine): wrap it
                with ``ht.nn.DataParallelMultiGPU(module, daso)``.
        """
        if not isinstance(model, unison.DataParallel):
            raise TypeError(
                f"DASO drives a unison model, not a plain {type(model).__name__}: build "
                "ht.nn.DataParallelMultiGPU(module, daso), which calls set_model itself"
            )
        if getattr(model.algorithm, "name", None) != "daso":
            raise ValueError(
                f"this model runs {model.algorithm.name!r}, not DASO; build it with ht.nn.DataParallelMultiGPU(module, daso)"
            )
        self.module = model
        if self.scaler is not None:
            model.add_scaler(self.scaler)

    def add_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """Use a ``torch.amp.GradScaler``: ``step()`` then runs ``scaler.step`` and ``scaler.update``.

        A step the scaler skips (inf/NaN gradients) still ends the batch on
        that rank, so the nodes' schedules stay together.

        Args:
            scaler: the gradient scaler of automatic mixed precision.
        """
        self.scaler = scaler
        self.amp = True
        if self.module is not None:
            self.module.add_scaler(scaler)

    def print0(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 of ``comm`` when ``verbose`` is set.

        HeAT's documented helper: a script calls it to print its own lines, and
        ``verbose=True`` asks for the schedule on stdout, so it stays a print
        (a log record would vanish where logging is not configured). unison's
        own ``daso`` logs its schedule to the ``unison.daso`` logger instead.
        """
        if self.verbose and self.comm.rank == 0:
            print(*args, **kwargs)

    # ---- the training loop -----------------------------------------------
    def _require_model(self, what: str) -> unison.DataParallel:
        if self.module is None:
            raise RuntimeError(f"DASO.{what}: no model yet; build ht.nn.DataParallelMultiGPU(module, daso) first")
        return self.module

    def step(self) -> None:
        """One batch's step: the local optimizer (through the GradScaler when one was
        added), then the LR scheduler when given. The global syncs the schedule
        calls for happen inside the optimizer's step."""
        self._require_model("step()")
        if self.scheduler is not None and not isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            self.scheduler.step()  # HeAT's sense: this scheduler steps the optimizer itself
        else:
            if self.amp:
                assert self.scaler is not None  # add_scaler sets both
                self.scaler.step(self.local_optimizer)
                self.scaler.update()
            else:
                self.local_optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()

    def zero_grad(self) -> None:
        """Zero the local optimizer's gradients (HeAT zeroes them rather than setting them to None)."""
        self.local_optimizer.zero_grad(set_to_none=False)

    def epoch_loss_logic(self, loss: Union[torch.Tensor, int, float], loss_globally_averaged: bool = False) -> None:
        """End the epoch: every rank calls it with its training loss.

        The loss is averaged over the ranks (unless ``loss_globally_averaged``),
        a sync still in flight is completed by a blocking one, and the skips of
        the next epoch are set from its phase and the loss plateau.

        Args:
            loss: this rank's loss of the epoch.
            loss_globally_averaged: the loss is already the average over all ranks.
        """
        model = self._require_model("epoch_loss_logic()")
        self._check_last_batch()
        model.end_epoch(float(loss), averaged=loss_globally_averaged)
        gs, ls, btw = self.global_skip, self.local_skip, self.batches_to_wait
        phase = "cycling" if gs else ("warm-up" if self.epoch < self.warmup_epochs else "cool-down")
        self.print0(
            f"DASO after epoch {self.epoch} ({phase} next): global skips {gs}, local skips {ls}, batches to wait {btw}"
        )

    def _check_last_batch(self) -> None:
        lb, n = self.last_batch, self.current_batch
        if lb is not None and n not in (lb, lb + 1):
            warnings.warn(
                f"DASO.last_batch is {lb} but this rank stepped {n} batches in the epoch: the ranks' loaders may be "
                "uneven (every rank must take the same number of steps). unison's DASO needs no last_batch; the "
                "epoch ends at epoch_loss_logic()",
                stacklevel=3,
            )

    def reset(self) -> None:
        """Back to the base state: epoch 0, the warm-up schedule, no sync in flight, zero gradients.

        A collective when a model is bound (every rank calls it): the replicas
        are averaged as DASO starts over.
        """
        self.algorithm = self._new_algorithm()
        if self.module is not None:
            self.module.switch_to(self.algorithm)
            if self.scaler is not None:
                self.module.add_scaler(self.scaler)
        self.zero_grad()


def _check_scheduler(scheduler: Any) -> None:
    if scheduler is None:
        return
    if isinstance(scheduler, type):
        raise TypeError(
            "scheduler must be a scheduler object (torch.optim.lr_scheduler.StepLR(optimizer, ...)), not a class"
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError(
            "ReduceLROnPlateau needs the epoch's loss: call scheduler.step(loss) yourself after "
            "daso.epoch_loss_logic(loss), as HeAT's DASO example does, and do not give it to DASO"
        )
    if not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must be a torch learning rate scheduler, currently {type(scheduler).__name__}")
