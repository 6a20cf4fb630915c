"""Bagua's ``bagua.torch_api``: ``from unison.compat.bagua import torch_api as bagua``.

``bagua.init_process_group()`` starts the process group as ``unison.init()``
does (torchrun, mpirun, srun); ``get_rank``, ``get_world_size``,
``get_local_rank`` and ``get_local_size`` read ``unison.topology()``.
``bagua_init``, ``ModelSwitchWrapper`` and the rest live in ``.distributed``.
"""

from __future__ import annotations

import unison

from ..bagua_define import DistributedAlgorithm
from . import distributed
from .distributed import DistributedModule, ModelSwitchWrapper, allreduce_parameters, bagua_init, broadcast_parameters

__all__ = [
    "DistributedAlgorithm",
    "DistributedModule",
    "ModelSwitchWrapper",
    "allreduce_parameters",
    "bagua_init",
    "broadcast_parameters",
    "distributed",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
]


def init_process_group() -> None:
    """Start the process group from the launcher's environment (``unison.init()``); idempotent.

    Example::

        >>> bagua.init_process_group()
    """
    unison.init()


def get_rank() -> int:
    """This process's rank."""
    return unison.topology().rank


def get_world_size() -> int:
    """The number of processes."""
    return unison.topology().world_size


def get_local_rank() -> int:
    """This process's rank inside its node."""
    return unison.topology().local_rank


def get_local_size() -> int:
    """The number of processes on this node."""
    return unison.topology().local_world_size
