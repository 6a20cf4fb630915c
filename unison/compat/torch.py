"""PyTorch's old ``torch.nn.parallel.DistributedDataParallelCPU`` over unison.

    net = unison.compat.torch.DistributedDataParallelCPU(model)   # was torch.nn.DistributedDataParallelCPU(model)

The seed broadcast rank 0's parameters at construction and, once per
forward/backward, averaged all gradients in one coalesced allreduce per dtype
after backward. Here that is ``unison.DataParallel`` with ``delay_reduce=True``
(the reduction waits for the end of backward) in buckets of ``bucket_cap_mb``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

import unison
from unison.engine.comm import default_broadcast

__all__ = ["DistributedDataParallelCPU"]


class DistributedDataParallelCPU(unison.DataParallel):
    """Data parallelism at the module level for CPU processes (gloo, or mpi when torch has it).

    Rank 0's parameters are broadcast at construction (``sync_parameters``),
    and the gradients of every forward's backward are averaged once, after
    the backward pass, in coalesced buckets. Buffers are not kept in sync (as
    in the seed); unison broadcasts them once at construction.

    Args:
        module: the module to parallelize.

    Beyond the seed, a process group is started from the launcher's
    environment if none is (``unison.init()``), and everything
    ``unison.DataParallel`` offers is there (``no_sync``, ``join``,
    ``state_dict`` without a prefix, checkpoints, failure reports).

    Example::

        >>> net = DistributedDataParallelCPU(model)
        >>> loss_fn(net(x), y).backward()     # gradients averaged after backward
        >>> optimizer.step()
    """

    def __init__(self, module: nn.Module) -> None:
        unison.init()  # the seed's scripts started no process group of their own
        super().__init__(module, algorithm="allreduce", broadcast_buffers=False, delay_reduce=True)

    def sync_parameters(self) -> None:
        """Give every rank rank 0's parameters (a collective: every rank calls it)."""
        if dist.is_available() and dist.is_initialized():
            default_broadcast(list(self.module.parameters()), None)
