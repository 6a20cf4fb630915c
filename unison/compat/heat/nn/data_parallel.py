"""HeAT's ``heat.nn.data_parallel``: ``DataParallel`` and ``DataParallelMultiGPU`` over unison.

Both are ``unison.DataParallel`` subclasses, so everything unison adds (``no_sync``,
``join``, ``average``, ``switch_to``, checkpoints, failure reports) works on them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

import unison

from ..core.communication import as_communicator
from ..optim.dp_optimizer import DASO, DataParallelOptimizer

__all__ = ["DataParallel", "DataParallelMultiGPU"]

Optimizers = Union[
    DataParallelOptimizer, torch.optim.Optimizer, Sequence[Union[DataParallelOptimizer, torch.optim.Optimizer]]
]


def _as_dp_optimizers(optimizer: Any) -> list[DataParallelOptimizer]:
    if optimizer is None:
        raise TypeError(
            "HeAT's DataParallel(module, comm, optimizer) needs its optimizer(s): a ht.optim.DataParallelOptimizer or a list of them"
        )
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise TypeError("DataParallel got an empty list of optimizers")
    out = []
    for o in items:
        if isinstance(o, DataParallelOptimizer):
            out.append(o)
        elif isinstance(o, torch.optim.Optimizer):
            out.append(DataParallelOptimizer(o))
        else:
            raise TypeError(
                f"optimizer must be a ht.optim.DataParallelOptimizer (or a torch optimizer), not {type(o).__name__}"
            )
    return out


class DataParallel(unison.DataParallel):
    """HeAT's data-parallel network: the same model on every process, gradients averaged.

    Args:
        module: the local model.
        comm: the communicator: None or ``ht.MPI_WORLD`` (the world), a torch
            ProcessGroup, or an mpi4py communicator (mapped to the same ranks).
        optimizer: a ``ht.optim.DataParallelOptimizer`` or a list or tuple of
            them (plain torch optimizers are wrapped).
        blocking_parameter_updates: False (HeAT's default): non-blocking
            updates, unison's "nonblocking" algorithm. The end of backward does
            not wait for the gradients' allreduces and ``optimizer.step()``
            only records the step; each layer's update is applied just before
            that layer's next forward, once its gradients have arrived, so the
            communication overlaps the next forward. True: blocking updates,
            unison's "allreduce" (gradients averaged during backward). Both
            follow the same trajectory. Setting the attribute later switches
            (a collective: every rank sets it).

    HeAT forces blocking updates with several optimizers or with an optimizer
    that does not hold exactly the model's parameters; here both stay
    non-blocking. ``eval()`` applies pending updates (HeAT's end-of-epoch
    finalization), as do ``state_dict()`` and ``flush()``. Rank 0's parameters
    and buffers are broadcast at construction.

    Example::

        >>> from unison.compat import heat as ht
        >>> optimizer = ht.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
        >>> model = ht.nn.DataParallel(net, ht.MPI_WORLD, optimizer)
        >>> for x, y in loader:
        ...     optimizer.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     optimizer.step()            # applied during the next forward
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Any = None,
        optimizer: Optional[Optimizers] = None,
        blocking_parameter_updates: bool = False,
    ) -> None:
        if not isinstance(blocking_parameter_updates, bool):
            raise TypeError(
                f"blocking_parameter_updates must be a bool, not {type(blocking_parameter_updates).__name__}"
            )
        comm = as_communicator(comm)
        dp_optimizers = _as_dp_optimizers(optimizer)
        unison.init()
        super().__init__(
            module,
            optimizer=[o.torch_optimizer for o in dp_optimizers],
            algorithm="allreduce" if blocking_parameter_updates else "nonblocking",
            process_group=comm.group,
        )
        self.comm = comm
        self._heat_optimizers = dp_optimizers
        for o in dp_optimizers:
            o.blocking_parameter_updates = blocking_parameter_updates

    @property
    def blocking_parameter_updates(self) -> bool:
        """Whether parameter updates are blocking ("allreduce") or applied at the next forward ("nonblocking")."""
        return self.algorithm.name != "nonblocking"

    @blocking_parameter_updates.setter
    def blocking_parameter_updates(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"blocking_parameter_updates must be a bool, not {type(value).__name__}")
        if value != self.blocking_parameter_updates:
            self.switch_to("allreduce" if value else "nonblocking")
        for o in self._heat_optimizers:
            o.blocking_parameter_updates = value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; with non-blocking updates each layer's pending update is applied just before it runs."""
        output = super().forward(*inputs, **kwargs)
        for o in self._heat_optimizers:
            o.update_next = False
        return output


class DataParallelMultiGPU(unison.DataParallel):
    """HeAT's node-local data parallelism, the model DASO drives.

    Args:
        module: the local model.
        optimizer: a ``ht.optim.DASO``: gradients are averaged inside each node
            and the weights across nodes as DASO schedules (unison's "daso"
            algorithm). A plain torch optimizer (an extension: HeAT accepts
            only DASO) gives node-local data parallelism alone: gradients
            averaged inside each node, no global synchronization at all.
        comm: the global communicator; DASO runs on the world, so it must hold
            every process (None or ``ht.MPI_WORLD``).

    The process group is started by ``unison.init()`` (from torchrun, mpirun or
    srun), not by the script: HeAT's checklist step 1 (a node-local torch
    process group) is not needed, and a node-local group started by hand
    would hide the other nodes.

    Example::

        >>> daso = ht.optim.DASO(local_optimizer=optimizer, total_epochs=epochs)
        >>> model = ht.nn.DataParallelMultiGPU(net, daso)
    """

    def __init__(self, module: nn.Module, optimizer: Union[DASO, torch.optim.Optimizer], comm: Any = None) -> None:
        comm = as_communicator(comm)
        topo = unison.init()
        if not comm.is_world:
            raise ValueError(
                "DataParallelMultiGPU's comm must hold every process (the world): DASO runs on the whole world"
            )
        if isinstance(optimizer, DASO):
            if not optimizer.comm.is_world:
                raise ValueError(
                    "DASO's comm must hold every process (the world): unison's DASO runs on the whole world"
                )
            if optimizer.module is not None:
                raise ValueError("this DASO already drives a model; build one DASO per model")
            super().__init__(module, optimizer=optimizer.local_optimizer, algorithm=optimizer.algorithm)
            self.comm = comm
            optimizer.set_model(self)
        elif isinstance(optimizer, torch.optim.Optimizer) or (isinstance(optimizer, (list, tuple)) and optimizer):
            super().__init__(module, optimizer=optimizer, process_group=topo.intra_node_group)
            self.comm = comm
        else:
            raise TypeError(f"optimizer must be a ht.optim.DASO (or a torch optimizer), not {type(optimizer).__name__}")
