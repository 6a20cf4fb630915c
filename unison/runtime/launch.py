"""Process-group start-up and the machine topology.

``init()`` reads whatever launched this process (torchrun, Open MPI's mpirun,
MPICH/Hydra, SLURM's srun, or nothing at all), starts torch.distributed's
default process group and returns a :class:`Topology`: who this process is,
how the processes fall into nodes, and the groups that hierarchical algorithms
talk over (inside one node, and across nodes between processes of the same
local rank).

Set ``UNISON_NODES=N`` to make one machine pretend to be N nodes (for example 4
processes as 2 nodes x 2), so hierarchical algorithms can be tested anywhere.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from . import ending, health, membership

log = logging.getLogger("unison.runtime")

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "none"


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,9],cpu1"`` -> ``"gpu03"``."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist)
    if not match:
        raise ValueError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _slurm_tasks_per_node(value: Optional[str]) -> Optional[int]:
    """The task count of the first node in SLURM_TASKS_PER_NODE (``"4(x2),3"`` -> 4)."""
    if not value:
        return None
    match = re.match(r"(\d+)", value)
    return int(match.group(1)) if match else None


# MPI launchers: name, then the variables of rank, world size, local rank, local size.
_MPI_LAUNCHERS = (
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchInfo:
    """Read rank, world size, local rank and rendezvous address from ``env``.

    torchrun's variables win, then Open MPI's, MPICH/Hydra's and SLURM's; with
    none of them the process is a world of one.
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or "127.0.0.1"
    port = _int(env, "MASTER_PORT")

    mpi = next((m for m in _MPI_LAUNCHERS if m[1] in env), None)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank, local_world = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    elif mpi is not None:
        launcher, *names = mpi
        rank, world, local_rank, local_world = (_int(env, n) for n in names)
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID")
        local_world = _slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE"))
        if world is None and _int(env, "SLURM_NNODES") == 1:
            world = local_world
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" not in env and nodelist:
            addr = first_host(nodelist)
        job = _int(env, "SLURM_JOB_ID")
        if port is None and job is not None:
            # One port per job, so two jobs sharing a first node do not collide.
            port = 20000 + job % 20000
    else:
        return LaunchInfo(0, 1, 0, 1, addr, port or DEFAULT_PORT, "none")

    if rank is None or world is None:
        raise ValueError(f"{launcher} launch detected but its rank or world size is missing from the environment")
    if not 0 <= rank < world:
        raise ValueError(f"{launcher} gave rank {rank} outside world size {world}")
    if local_rank is None or local_world is None:
        local_rank, local_world = rank, world  # no node information: one node
    return LaunchInfo(rank, world, local_rank, local_world, addr, port or DEFAULT_PORT, launcher)


@dataclass
class Topology:
    """Where this process sits: its rank, its node, and the groups to talk over.

    ``intra_node_group`` holds the processes of this node; ``inter_node_group``
    the processes with this local rank on every node (one such group per local
    rank, ``inter_node_groups[local_rank]``). With no process group (a world of
    one) all groups are None.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"
    backend: Optional[str] = None
    world_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    intra_node_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    inter_node_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    inter_node_groups: list = field(default_factory=list, repr=False)
    #: Every rank's local world size, in rank order (empty when unknown: a world of one).
    local_sizes: tuple = field(default=(), repr=False)

    def let_go_of_groups(self) -> None:
        """The job ended (``unison.shutdown()``): drop the groups, keep who this process was."""
        self.world_group = self.intra_node_group = self.inter_node_group = None
        self.inter_node_groups = []

    @property
    def uniform(self) -> bool:
        """Whether every node runs the same number of processes (the node groups exist only then)."""
        return all(n == self.local_world_size for n in self.local_sizes)

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_ranks(self, node: Optional[int] = None) -> list[int]:
        """Global ranks of the processes on ``node`` (default: this one)."""
        node = self.node if node is None else node
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def peer_ranks(self, local_rank: Optional[int] = None) -> list[int]:
        """Global ranks holding ``local_rank`` (default: this one) on each node."""
        local_rank = self.local_rank if local_rank is None else local_rank
        return [n * self.local_world_size + local_rank for n in range(self.num_nodes)]


_topology: Optional[Topology] = None
_timeout: Optional[datetime.timedelta] = None

#: How long a collective waits for a silent peer when ``init()`` is given no timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def collective_timeout() -> Optional[datetime.timedelta]:
    """The timeout given to ``init()`` (None: torch's default), for groups unison creates later."""
    return _timeout


def serve_store(host: str = "127.0.0.1", timeout: Optional[datetime.timedelta] = None) -> dist.TCPStore:
    """A TCPStore served by this process on a port the OS picks as it binds (``store.port``).

    For a rendezvous on this machine: hand the store, or its port while the
    store lives, to whoever needs it. A port found free, closed and bound again
    later could be taken by anyone in between; this one is never let go.

    Args:
        host: the address to listen on.
        timeout: how long a client's ``get``/``wait`` may block (default ``DEFAULT_TIMEOUT``).
    """
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout or DEFAULT_TIMEOUT)


def client_env(store: dist.TCPStore) -> dict[str, str]:
    """The environment under which processes this one starts rendezvous through ``store``.

    The processes are clients of the store as torchrun's workers are of its
    agent's (``TORCHELASTIC_USE_AGENT_STORE``): ``unison.init`` and torch's
    ``env://`` both read it, and no rank hosts a store of its own. Add the
    ranks' own variables (``RANK``, ``WORLD_SIZE``, ...).
    """
    return {
        "MASTER_ADDR": store.host,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def _apply_simulated_nodes(
    rank: int, world: int, local_rank: int, local_world: int, nodes: Optional[int]
) -> tuple[int, int]:
    if not nodes:
        return local_rank, local_world
    if nodes < 1 or world % nodes:
        raise ValueError(
            f"UNISON_NODES={nodes} does not divide the world of {world} processes; "
            f"choose a node count that divides {world}"
        )
    local_world = world // nodes
    return rank % local_world, local_world


def _subgroups(topo: Topology, enumeration: list[list[int]]) -> tuple[Any, list[Any]]:
    """``dist.new_subgroups_by_enumeration``, each group built through ``membership.new_group``: under
    fault tolerance with the short rendezvous timeout and destroyed with its membership, so a peer
    that died before the build makes it fail in seconds (a failure, then a regroup), never waits
    out torch's default timeout (30 minutes)."""
    mine, every = None, []
    for ranks in enumeration:

        def build(timeout: Optional[datetime.timedelta], ranks: list[int] = ranks) -> Any:
            return dist.new_group(ranks=ranks, timeout=timeout)

        group = membership.new_group(build, _timeout)
        every.append(group)
        if topo.rank in ranks:
            mine = group
    return mine, every


def _build_groups(topo: Topology) -> None:
    """Create the intra- and inter-node groups; every rank must call this."""
    lws, nodes = topo.local_world_size, topo.num_nodes
    intra, _ = _subgroups(topo, [topo.node_ranks(n) for n in range(nodes)])
    inter, all_inter = _subgroups(topo, [topo.peer_ranks(lr) for lr in range(lws)])
    topo.intra_node_group = intra
    topo.inter_node_group = inter
    topo.inter_node_groups = all_inter


def _local_sizes(local_world: int) -> tuple[int, ...]:
    """Every rank's local world size (one all_gather over the world): nodes may differ."""
    mine = torch.tensor([local_world], dtype=torch.int64, device=wire_device())
    sizes = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, mine)
    return tuple(int(s.item()) for s in sizes)


def _attempt_store(timeout: Optional[datetime.timedelta]) -> Optional[dist.Store]:
    """Under torchrun's shared rendezvous store, a store private to this restart attempt.

    torchrun keeps one store across restarts; a group started on it again reads
    the dead workers' keys and its gloo rendezvous waits forever
    (pytorch/pytorch#135712). Prefixing the keys with the attempt number gives
    each attempt a clean slate. None when not under torchrun's agent store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or DEFAULT_TIMEOUT,
        use_libuv=True,
    )
    return dist.PrefixStore(f"unison/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", client)


def _backend(backend: Optional[str], local_rank: int) -> str:
    """The backend ``init`` builds groups with: ``backend``, or NCCL where CUDA is there and gloo
    otherwise. NCCL puts this process on GPU ``local_rank`` (modulo the GPUs it sees)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not isinstance(backend, str) or not backend:
        raise ValueError(
            f"backend must be a torch.distributed backend's name such as 'gloo' or 'nccl', got {backend!r}"
        )
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError(
                "backend='nccl' needs CUDA, and torch sees no GPU here: use backend='gloo' (or leave it out)"
            )
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return backend


def wire_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives and point-to-point messages must live: the current GPU under
    NCCL, the CPU otherwise. A heal stages each piece there (one piece at a time), so its state may
    be on any device, whatever the backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(
    backend: Optional[str] = None, timeout: Optional[float | datetime.timedelta] = None, nodes: Optional[int] = None
) -> Topology:
    """Start (or adopt) torch.distributed's default process group.

    Args:
        backend: "gloo", "nccl" or any torch backend; default nccl when CUDA is
            available, gloo otherwise. Under ``unison launch --fault-tolerant`` every
            membership's groups are built with it. "nccl" without CUDA raises ValueError.
        timeout: seconds (or a timedelta) a collective may wait for a silent
            peer before failing with an error naming it; default 10 minutes
            (``DEFAULT_TIMEOUT``; torch's own is 30). Only for groups unison creates.
        nodes: pretend the processes form this many nodes (also ``UNISON_NODES``).

    Idempotent: a second call returns the same Topology. If torch.distributed
    was already initialized by the user, that group is used as it is.
    """
    global _topology, _timeout
    if _topology is not None:
        return _topology
    if nodes is None and os.environ.get("UNISON_NODES"):
        nodes = int(os.environ["UNISON_NODES"])
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None and timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if timeout is None and not (dist.is_available() and dist.is_initialized()):
        timeout = DEFAULT_TIMEOUT
    _timeout = timeout

    if membership.launched() and not dist.is_initialized():  # under `unison launch --fault-tolerant`
        backend = _backend(backend, int(os.environ.get("LOCAL_RANK", "0")))
        _topology = topo = Topology(launcher="unison-ft", backend=backend)
        try:
            membership.connect(_follow_membership, backend=backend)  # fills it in, again at every regroup
        except BaseException:
            _topology = None
            raise
        return topo
    info = detect_launch()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank, local_world = info.local_rank, info.local_world_size
        if world != info.world_size:  # launched some other way: assume one node
            local_rank, local_world = rank, world
        launcher = info.launcher
    elif info.world_size == 1:
        _topology = Topology(launcher=info.launcher, local_rank=0, local_world_size=1)
        return _topology
    else:
        rank, world = info.rank, info.world_size
        local_rank, local_world = info.local_rank, info.local_world_size
        launcher = info.launcher
        backend = _backend(backend, local_rank)
        os.environ.setdefault("MASTER_ADDR", info.master_addr)
        os.environ.setdefault("MASTER_PORT", str(info.master_port))
        store = _attempt_store(timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)

    local_rank, local_world = _apply_simulated_nodes(rank, world, local_rank, local_world, nodes)
    local_sizes = _local_sizes(local_world) if world > 1 else ()
    if all(n == local_world for n in local_sizes) and world % local_world:
        raise ValueError(f"local world size {local_world} does not divide the world size {world}")
    topo = Topology(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        launcher=launcher,
        backend=dist.get_backend(),
        world_group=dist.group.WORLD,
    )
    if world > 1:
        topo.local_sizes = local_sizes
        if topo.uniform:
            _build_groups(topo)
        health.start(rank, world)
    log.debug(
        "rank %d of %d (launched by %s), local rank %d of %d on node %d of %d, backend %s",
        rank,
        world,
        launcher,
        local_rank,
        local_world,
        topo.node,
        topo.num_nodes,
        topo.backend,
    )
    _topology = topo
    ending.hold(topo.let_go_of_groups)
    return topo


def _follow_membership(m: membership.Membership) -> None:
    """Under fault tolerance: point the topology at membership ``m`` (its rank, world and default
    group) and, on nodes of several processes, build its node groups.

    A member is a process; the coordinator admits and removes a node's processes together, in
    consecutive ranks ordered by local rank, so the node of rank r is r // local_world_size, as
    with torchrun. The node groups are built again at every regroup, as every group of a membership
    (``membership.new_group``: aborted and destroyed with it).
    """
    topo = _topology
    if topo is None:
        return
    topo.rank, topo.world_size, topo.world_group = m.rank, m.world_size, dist.group.WORLD
    topo.local_rank, topo.local_world_size = m.local_rank, m.local_world_size
    topo.local_sizes = (m.local_world_size,) * m.world_size
    if m.rank % m.local_world_size != m.local_rank or m.world_size % m.local_world_size:
        raise RuntimeError(
            f"worker {m.id}: membership {m.members} does not hold whole nodes of {m.local_world_size} "
            "processes in local-rank order (the coordinator admits a node's processes together)"
        )
    topo.intra_node_group = topo.inter_node_group = None
    topo.inter_node_groups = []
    if m.local_world_size > 1 and (topo.num_nodes > 1 or m.node_group is not None):
        _build_groups(topo)  # one node: its inter-node groups are one process each (FSDP2's replicas)


def topology() -> Topology:
    """The Topology from ``init()``; a world of one if ``init()`` was never called."""
    return _topology if _topology is not None else Topology()


_node_meshes: dict[str, Any] = {}


def node_mesh(device_type: Optional[str] = None) -> Any:
    """A 1-D DeviceMesh over this node's processes, its dimension named "shard": the mesh to shard
    a model over with FSDP2 (``fully_shard(model, mesh=unison.node_mesh())``) before wrapping it
    with ``DataParallel``, which then runs its algorithm across the nodes (the processes of the
    same local rank) without a ``device_mesh``.

    Under ``unison launch --fault-tolerant`` its group lives as long as the node (its processes
    fail and come back together), across every membership; otherwise it is the topology's
    ``intra_node_group``. Every process of the node calls it, after ``unison.init()``.

    Args:
        device_type: "cuda" or "cpu"; default "cuda" under NCCL, else "cpu".

    Example::

        unison.init()
        fully_shard(model, mesh=unison.node_mesh())
        model = unison.DataParallel(model, optimizer=opt, algorithm="diloco", fault_tolerant=True)
    """
    from torch.distributed.device_mesh import DeviceMesh

    topo = _topology
    if topo is None or topo.world_group is None:
        raise RuntimeError("unison.node_mesh() needs a job of several processes started by unison.init() first")
    if device_type is None:
        device_type = "cuda" if topo.backend == "nccl" else "cpu"
    if device_type not in _node_meshes:
        worker = membership.current()
        group = worker.node_process_group() if worker is not None else topo.intra_node_group
        if group is None:
            raise RuntimeError(
                f"unison.node_mesh(): the nodes of this job differ in size ({topo.local_sizes}); "
                "FSDP2 inside nodes needs nodes of the same number of processes"
            )
        _node_meshes[device_type] = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
        if worker is not None and topo.inter_node_group is None and topo.local_world_size > 1:
            _build_groups(topo)  # a job of one node: every process is here (the replica groups of FSDP2)
    return _node_meshes[device_type]


def is_node_mesh(mesh: Any) -> bool:
    """Whether ``mesh`` is one ``node_mesh()`` handed out."""
    return any(mesh is m for m in _node_meshes.values())


def replica_group() -> Optional[dist.ProcessGroup]:
    """The processes of this local rank on every node (``inter_node_group``): the replicas of the
    shards of a model sharded over ``node_mesh()``; the whole job's group on nodes of one process."""
    topo = topology()
    return topo.inter_node_group if topo.local_world_size > 1 else topo.world_group


def forget_topology() -> None:
    """Forget the Topology and the node's meshes (``unison.shutdown()`` calls it)."""
    global _topology
    _topology = None
    _node_meshes.clear()


ending.forgets.append(forget_topology)
