"""``ht.optim``: HeAT's data-parallel optimizers; any other name is torch.optim's.

HeAT falls back to the PyTorch optimizer of the same name when it has none of
its own, so ``ht.optim.SGD`` is ``torch.optim.SGD`` and ``ht.optim.lr_scheduler``
is ``torch.optim.lr_scheduler``.
"""

import torch.optim as _torch_optim

from . import dp_optimizer
from .dp_optimizer import DASO, DataParallelOptimizer

__all__ = ["DASO", "DataParallelOptimizer", "dp_optimizer"]


def __getattr__(name: str):
    try:
        return getattr(_torch_optim, name)
    except AttributeError:
        raise AttributeError(f"neither unison.compat.heat.optim nor torch.optim has {name!r}") from None
