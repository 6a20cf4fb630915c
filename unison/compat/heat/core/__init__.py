"""``heat.core``: the communicators (``heat.core.communication``)."""

from . import communication
from .communication import MPI_WORLD, MPICommunication

__all__ = ["MPI_WORLD", "MPICommunication", "communication"]
