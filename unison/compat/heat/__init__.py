"""HeAT's data-parallel API over unison: ``from unison.compat import heat as ht``.

The rest of a HeAT script stays as it was::

    ht.MPI_WORLD.rank, ht.MPI_WORLD.size
    ht.nn.DataParallel(net, ht.MPI_WORLD, ht.optim.DataParallelOptimizer(opt))
    daso = ht.optim.DASO(local_optimizer=opt, total_epochs=90)
    model = ht.nn.DataParallelMultiGPU(net, daso)

``ht.nn.<Layer>`` and ``ht.optim.<Optimizer>`` fall back to torch's, as in HeAT.
The process group comes from ``unison.init()`` (torchrun, mpirun or srun),
called on first use; ``ht.MPI`` is mpi4py's ``MPI`` when mpi4py is installed.
HeAT's arrays, data loaders and other non-parallel modules are not part of
this layer. See ``docs/migration.md``.
"""

from . import core, nn, optim
from .core.communication import MPI_WORLD, MPICommunication

__all__ = ["MPI_WORLD", "MPICommunication", "core", "nn", "optim"]


def __getattr__(name: str):
    if name == "MPI":
        try:
            from mpi4py import MPI
        except ImportError:
            raise AttributeError(
                "ht.MPI is mpi4py's MPI module, and mpi4py is not installed (pip install mpi4py)"
            ) from None
        return MPI
    raise AttributeError(
        f"module 'unison.compat.heat' has no attribute {name!r} (this layer covers HeAT's data-parallel API only)"
    )
