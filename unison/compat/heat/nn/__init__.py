"""``ht.nn``: HeAT's data-parallel networks; any other name is torch.nn's.

HeAT falls back to the PyTorch layer of the same name when it has none of its
own, so ``ht.nn.Linear`` is ``torch.nn.Linear`` and ``ht.nn.functional`` is
``torch.nn.functional``.
"""

import torch.nn as _torch_nn

from . import data_parallel
from .data_parallel import DataParallel, DataParallelMultiGPU

__all__ = ["DataParallel", "DataParallelMultiGPU", "data_parallel"]


def __getattr__(name: str):
    try:
        return getattr(_torch_nn, name)
    except AttributeError:
        raise AttributeError(f"neither unison.compat.heat.nn nor torch.nn has {name!r}") from None
