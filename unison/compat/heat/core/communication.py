"""HeAT's communicators (``ht.MPI_WORLD``, ``MPICommunication``) as torch.distributed groups.

HeAT talks over MPI; unison over torch.distributed (gloo or NCCL). A HeAT
script's ``comm`` arguments are mapped onto process groups:

* ``None`` or ``ht.MPI_WORLD``: the world (``unison.init()`` is called on first
  use, as HeAT's MPI is up as soon as it is imported);
* a ``torch.distributed`` ProcessGroup: used as it is;
* an mpi4py communicator (only when mpi4py is installed): the torch group of
  the same processes, found by translating its ranks into ``MPI.COMM_WORLD``
  ranks, which must be the torch ranks (as under ``mpirun``, where
  ``unison.init()`` reads Open MPI's or MPICH's rank variables).

``comm.rank`` and ``comm.size`` are this process's rank in the group and the
group's size, as in HeAT. MPI's own methods (``comm.Allreduce``, ``comm.Split``,
...) are those of the mpi4py communicator when one was given, so a script's
own MPI calls keep working; on the world without mpi4py they raise an error
saying to use ``torch.distributed`` on ``comm.group`` instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

import unison

_UNSET = object()


def is_mpi_comm(obj: Any) -> bool:
    """Whether ``obj`` is an mpi4py communicator (without importing mpi4py when it is absent)."""
    module = type(obj).__module__ or ""
    return module.startswith("mpi4py") and hasattr(obj, "Get_rank") and hasattr(obj, "Get_size")


class MPICommunication:
    """A HeAT communicator over a torch.distributed process group.

    Args:
        handle: what the communicator stands for: None (the world), a
            ``torch.distributed`` ProcessGroup, or an mpi4py communicator
            (mapped to the torch group of the same processes).

    Attributes:
        rank: this process's rank in the group.
        size: the number of processes in the group.
        group: the torch ProcessGroup (None for the world: unison then uses the
            default group).
        handle: what was given (the mpi4py communicator, when one was).

    Example::

        >>> from unison.compat import heat as ht
        >>> ht.MPI_WORLD.rank, ht.MPI_WORLD.size
        (0, 2)
    """

    def __init__(self, handle: Any = None) -> None:
        if handle is not None and not isinstance(handle, dist.ProcessGroup) and not is_mpi_comm(handle):
            raise TypeError(
                "a HeAT communicator is None (the world), a torch.distributed ProcessGroup or an mpi4py "
                f"communicator, not {type(handle).__name__}"
            )
        self.handle = handle
        self._group: Any = _UNSET

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The torch process group (None: the world). Resolved on first use."""
        if self._group is _UNSET:
            unison.init()  # HeAT's MPI is up as soon as it is imported: so is the process group here
            if self.handle is None:
                self._group = None
            elif isinstance(self.handle, dist.ProcessGroup):
                self._group = None if self.handle is dist.group.WORLD else self.handle
            else:
                self._group = _group_of_mpi_comm(self.handle)
        return self._group

    @property
    def is_world(self) -> bool:
        """Whether this communicator holds every process."""
        group = self.group
        return group is None or not dist.is_initialized() or dist.get_world_size(group) == dist.get_world_size()

    @property
    def rank(self) -> int:
        group = self.group
        return dist.get_rank(group) if dist.is_initialized() else 0

    @property
    def size(self) -> int:
        group = self.group
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def Get_rank(self) -> int:  # noqa: N802 (MPI's spelling)
        """This process's rank in the group (mpi4py's name)."""
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        """The group's size (mpi4py's name)."""
        return self.size

    def is_distributed(self) -> bool:
        """Whether more than one process takes part (HeAT's name)."""
        return self.size > 1

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally: MPI methods of the mpi4py handle.
        if name.startswith("_"):
            raise AttributeError(name)
        handle = self.__dict__.get("handle")
        if handle is not None and is_mpi_comm(handle):
            return getattr(handle, name)
        raise AttributeError(
            f"MPICommunication has no {name!r}: unison talks over torch.distributed, not MPI. Use "
            "torch.distributed on comm.group (None: the world), or give HeAT's layer an mpi4py communicator "
            "to keep its MPI methods"
        )

    def __repr__(self) -> str:
        what = "world" if self.handle is None else type(self.handle).__name__
        return f"MPICommunication({what})"


def as_communicator(comm: Any) -> MPICommunication:
    """``comm`` as an MPICommunication (None: ``MPI_WORLD``)."""
    if comm is None:
        return MPI_WORLD
    if isinstance(comm, MPICommunication):
        return comm
    if isinstance(comm, dist.ProcessGroup) or is_mpi_comm(comm):
        return MPICommunication(comm)
    raise TypeError(
        "comm must be None, ht.MPI_WORLD, an MPICommunication, a torch.distributed ProcessGroup or an mpi4py "
        f"communicator, not {type(comm).__name__} (HeAT's signature is DataParallel(module, comm, optimizer))"
    )


def _group_of_mpi_comm(comm: Any) -> Optional[dist.ProcessGroup]:
    """The torch group holding the processes of mpi4py communicator ``comm`` (None: the world).

    A collective over MPI_COMM_WORLD and the torch world: every process learns
    every communicator's members, and the distinct member sets become torch
    groups (they must not overlap). Inside a group, ranks follow the world order.
    """
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if not dist.is_initialized():
        if world.Get_size() > 1:
            raise RuntimeError(
                "torch.distributed is not initialized but MPI runs several processes; launch with mpirun so unison.init() sees them"
            )
        return None
    if world.Get_rank() != dist.get_rank() or world.Get_size() != dist.get_world_size():
        raise ValueError(
            f"MPI rank {world.Get_rank()} of {world.Get_size()} is torch rank {dist.get_rank()} of "
            f"{dist.get_world_size()}: launch with mpirun so that unison.init() takes MPI's ranks"
        )
    if comm == MPI.COMM_NULL:
        members: tuple = ()
    else:
        members = tuple(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world.Get_group()))
    if sorted(members) == list(range(world.Get_size())):
        return None
    sets: list[tuple] = []
    for m in world.allgather(tuple(sorted(members))):
        if m and m not in sets:
            sets.append(m)
    seen: set = set()
    for m in sets:
        if seen & set(m):
            raise ValueError(f"the mpi4py communicators given on different ranks overlap ({sets}); torch groups cannot")
        seen |= set(m)
    group, _ = dist.new_subgroups_by_enumeration([list(m) for m in sets])
    if not members:
        raise ValueError("this process is not a member of the mpi4py communicator given (MPI.COMM_NULL)")
    return group


#: The world, as HeAT's ``ht.MPI_WORLD``.
MPI_WORLD = MPICommunication()
