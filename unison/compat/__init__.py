"""The seeds' own APIs as thin layers over ``unison.DataParallel`` and its algorithms.

Moving a script written for one of these systems to unison is an import change:

====================================  ==============================================
before                                after
====================================  ==============================================
``import heat as ht``                 ``from unison.compat import heat as ht``
``import bagua.torch_api as bagua``   ``from unison.compat.bagua import torch_api as bagua``
``from bagua.torch_api.distributed``  ``from unison.compat.bagua.torch_api.distributed``
``torch.nn.DistributedDataParallelCPU``  ``unison.compat.torch.DistributedDataParallelCPU``
pytorch-pfn-extras' DDP               ``from unison import DataParallel as DistributedDataParallel``
====================================  ==============================================

No layer implements an algorithm of its own: each maps the seed's arguments
onto a unison algorithm and its options, and documents where behaviour
differs. The full table of every documented class, argument and method and
where it lives now is in ``docs/migration.md``.

The layers are imported on demand (``unison.compat.heat``, ``.bagua``,
``.torch``); this package imports none of them.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

# Aliased: importing the submodule ``unison.compat.torch`` binds the name ``torch`` here.
import torch as _torch
import torch.distributed as _dist

__all__ = ["bagua", "heat", "torch"]


def _ensure_init():
    """Start (or adopt) the process group the way ``unison.init()`` does; the seeds'
    scripts never start one themselves (HeAT's MPI is up at import, Bagua's
    ``init_process_group`` is mapped to this)."""
    import unison

    return unison.init()


def _distributed() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def _broadcast_(tensors: Sequence[_torch.Tensor], group: Optional[_dist.ProcessGroup] = None, src_group_rank: int = 0) -> None:
    """Broadcast ``tensors`` in place from group rank ``src_group_rank`` (blocking, one per tensor)."""
    if not _distributed():
        return
    src = src_group_rank if group is None or group is _dist.group.WORLD else _dist.get_global_rank(group, src_group_rank)
    with _torch.no_grad():
        for t in tensors:
            _dist.broadcast(t, src=src, group=group)


def _average_(tensors: Iterable[_torch.Tensor], group: Optional[_dist.ProcessGroup] = None) -> None:
    """Average ``tensors`` in place over ``group`` (blocking); integer tensors are floor-averaged."""
    if not _distributed():
        return
    size = _dist.get_world_size(group)
    with _torch.no_grad():
        for t in tensors:
            _dist.all_reduce(t, group=group)
            if t.is_floating_point() or t.is_complex():
                t.div_(size)
            else:
                t.copy_(_torch.div(t, size, rounding_mode="floor"))
