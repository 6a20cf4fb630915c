"""FSDP2 modules under DataParallel: the checks and local views that DTensor parameters need.

A model sharded with ``fully_shard`` over one dimension of a device mesh (the ranks of a node)
is wrapped with ``device_mesh`` set to another dimension of the same mesh (the nodes). Each
rank's algorithm then works on its local shards, views that share storage with FSDP2's sharded
parameters (what is written into them is what the next forward gathers), and talks only with
the ranks that hold the same shards on the other nodes; ``allreduce`` averages FSDP2's
reduce-scattered gradients across them, as torch's HSDP does (``ReplicaAllReduce``; ``fp16`` and
``bf16`` the same in half precision on the wire). What is not
built yet over FSDP2 is refused here, at construction, with the reason. See docs/nodes.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, cast

import torch
import torch.distributed as dist
from torch import nn

from .engine.codecs import halfcast
from .engine.comm import ring_bytes
from .runtime import torch_private

_HOW = (
    "shard the model with fully_shard(block, mesh=mesh['shard']) for its blocks and the root, and pass "
    "DataParallel(model, device_mesh=mesh['replicate'], ...) with mesh = init_device_mesh(device, "
    "(nodes, per_node), mesh_dim_names=('replicate', 'shard'))"
)


def is_dtensor(t: torch.Tensor) -> bool:
    """A distributed tensor (FSDP2's or tensor parallelism's); False where torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard if it is a DTensor (a view sharing its storage), else ``t``.

    Taken under ``no_grad``: with gradients enabled ``to_local`` is an autograd function
    whose output cannot be written in place.
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined]


def local_state(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples) with every DTensor replaced by its local shard: a module's or
    an optimizer's state over FSDP2 as plain tensors, that a heal sends point to point."""
    return torch_private.tree_map(lambda t: local(t) if isinstance(t, torch.Tensor) else t, obj)


def as_dtensors(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (an optimizer's ``local_state``) with each tensor of a DTensor parameter's state
    that has its local shard's shape made a DTensor like the parameter again, for
    ``optimizer.load_state_dict`` (its step counters stay plain, as torch keeps them)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params))
    out = dict(state, state={})
    for i, entry in state["state"].items():
        p = by_id.get(i)
        if p is None or not is_dtensor(p):
            out["state"][i] = entry
            continue
        shape = local(p).shape
        out["state"][i] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == shape
            else v
            for k, v in entry.items()
        }
    return out


def check(module: nn.Module, device_mesh: Any) -> bool:
    """Whether ``module`` is sharded by FSDP2; raise if it is in a way unison cannot run.

    Accepted: every parameter a DTensor sharded (``Shard`` placements) over a 1-D mesh that is
    another dimension of the same root mesh as ``device_mesh`` (1-D), or over
    ``unison.node_mesh()`` with no ``device_mesh``, and ``module`` an ``FSDPModule``
    (``fully_shard`` applied to the root). Refused with what to do instead: plain and DTensor
    parameters mixed, no ``device_mesh`` for another mesh, other placements (tensor
    parallelism), another mesh.
    """
    named = list(module.named_parameters())
    sharded = [n for n, p in named if is_dtensor(p)]
    if not sharded:
        return False
    plain = [n for n, p in named if not is_dtensor(p)]
    if plain:
        raise ValueError(
            f"parameter {sharded[0]!r} is a DTensor but {plain[0]!r} is a plain tensor: unison runs over a "
            f"module whose parameters are all sharded by FSDP2 or none is; apply fully_shard to the root "
            f"module too (fully_shard(model, mesh=mesh['shard'])), which shards the parameters left"
        )
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    if device_mesh is None and not on_node_mesh(module):
        raise ValueError(
            f"parameter {sharded[0]!r} is a DTensor (the module is sharded), so DataParallel needs the mesh "
            f"dimension it runs across: {_HOW}; or shard over unison.node_mesh() and leave device_mesh out"
        )
    root = None if device_mesh is None else torch_private.root_mesh(device_mesh)
    for name, p in named:
        mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
        if mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in placements):
            raise NotImplementedError(
                f"parameter {name!r} is a DTensor placed {tuple(placements)} on a {mesh.ndim}-D mesh: unison "
                f"runs over FSDP2's sharding (fully_shard over a 1-D mesh) only, not tensor parallelism or "
                f"torch's own HSDP (fully_shard with a 2-D mesh); {_HOW}"
            )
        if device_mesh is None:
            continue  # every parameter on the node's mesh (on_node_mesh)
        if torch_private.root_mesh(mesh) is not root or mesh.mesh_dim_names == device_mesh.mesh_dim_names:
            raise ValueError(
                f"parameter {name!r} is sharded over mesh {mesh}, which is not another dimension of the mesh "
                f"device_mesh={device_mesh} was taken from: {_HOW}"
            )
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"the module's parameters are DTensors but the module is not an FSDPModule: {_HOW} "
            "(fully_shard on the root module)"
        )
    return True


def on_node_mesh(module: nn.Module) -> bool:
    """Whether every parameter of ``module`` is a DTensor on ``unison.node_mesh()``: its replicas are
    then the processes of the same local rank on every node (``runtime.launch.replica_group``)."""
    from .runtime.launch import is_node_mesh

    params = list(module.parameters())
    return bool(params) and all(is_dtensor(p) and is_node_mesh(p.device_mesh) for p in params)  # type: ignore[attr-defined]


def local_parameters(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[bool]]:
    """``(name, local shard)`` of every parameter and whether each is trained.

    A local shard does not require grad itself (FSDP2's gradients are DTensors of the
    parameters), so whether it is trained is the DTensor's ``requires_grad``. Taken at
    construction: FSDP2 keeps the same local tensors across forwards, backwards and
    optimizer steps (``check_views`` says when it rebound one).
    """
    named = list(module.named_parameters())
    # Typed as parameters: what the Replica trains (algorithms read and write them as tensors).
    return [(n, cast(nn.Parameter, local(p))) for n, p in named], [p.requires_grad for _, p in named]


def check_views(module: nn.Module, views: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise if FSDP2 rebound a parameter's local shard since ``views`` were taken
    (``module.to()``, ``load_state_dict(assign=True)``): the algorithm would train stale copies."""
    for (name, p), (_, view) in zip(module.named_parameters(), views):
        if local(p).data_ptr() != view.data_ptr():
            raise RuntimeError(
                f"FSDP2 replaced the local shard of parameter {name!r} after DataParallel was built (by .to(), "
                "load_state_dict(assign=True), or a new fully_shard): wrap the module again"
            )


def refuse_options(nonfinite: Optional[str] = None, debug: bool = False, custom: Optional[str] = None) -> None:
    """Raise NotImplementedError naming the first of DataParallel's own options given that is not
    built yet over FSDP2 (what an algorithm supports is ``unison.algorithms.support``'s)."""
    for given, option in (
        (nonfinite is not None, f"nonfinite={nonfinite!r}"),
        (debug, "debug=True"),
        (custom is not None, f"{custom}"),
    ):
        if given:
            raise NotImplementedError(f"DataParallel's {option} is not built yet over a module sharded by FSDP2")


def refuse_call(what: str, instead: str = "") -> None:
    """Raise NotImplementedError: ``what`` (a call) is not built yet over FSDP2."""
    raise NotImplementedError(f"{what} is not built yet over a module sharded by FSDP2{instead}")


class ReplicaAllReduce:
    """Gradient averaging over FSDP2 as torch's HSDP: each FSDPModule's reduce-scatter output (the
    mean over the node's ranks of this rank's shard) divided by the replicas' number and summed
    over their ``group``, in FSDP2's all-reduce hook; ``remove()`` takes the hooks off. With a
    ``wire_dtype`` (fp16, bf16) the divided shard is cast in its own bytes, summed, and cast back.

    ``count`` is told the bytes each all-reduce sends from this rank (a ring's ``2 (R - 1) / R``
    of the shard's), so that ``comm_stats`` counts them as it counts the gradient buckets'.

    Example::

        hooks = ReplicaAllReduce(model, replica.private_group("allreduce"), core.count_bytes)
    """

    def __init__(
        self,
        module: nn.Module,
        group: Optional[dist.ProcessGroup],
        count: Callable[[int], None] = lambda n: None,
        wire_dtype: Optional[torch.dtype] = None,
    ) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        size = dist.get_world_size(group)

        def hook(reduced: torch.Tensor) -> None:
            reduced.div_(size)  # first: a half-precision sum cannot overflow where the average would not
            wire = halfcast.to_wire(reduced, wire_dtype or reduced.dtype)  # in the shard's own bytes
            dist.all_reduce(wire, group=group)
            halfcast.from_wire(wire, reduced)
            count(ring_bytes(wire.numel() * wire.element_size(), size))

        for m in self.modules:
            m.set_all_reduce_hook(hook)

    def remove(self) -> None:
        for m in self.modules:
            m.set_all_reduce_hook(None)  # type: ignore[arg-type]  # FSDP2 keeps None as "no hook"


def gradient_sync(module: nn.Module, on: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync(on)`` on ``module`` and every FSDPModule in it: off,
    backward keeps the unsharded gradients and sends nothing (``no_sync()``)."""
    cast(Any, module).set_requires_gradient_sync(on)


#: The gradient-averaging algorithms ``ReplicaAllReduce`` runs, and the dtype of their wire (None: the gradients').
def averages_gradients(algorithm: Any) -> bool:
    """Whether ``algorithm`` averages FSDP2's gradients across the replicas (its class declares
    ``FSDP2(gradients=True)``: allreduce, fp16 and bf16, by ``ReplicaAllReduce``); the
    model-averaging algorithms leave them local to the node."""
    return algorithm.fsdp2 is not None and algorithm.fsdp2.gradients


def gradient_wire(algorithm: Any) -> Optional[torch.dtype]:
    """The dtype FSDP2's gradients cross the replicas in: the algorithm's ``wire_dtype`` where it
    is a dtype (fp16, bf16), else None (their own)."""
    wire = getattr(algorithm, "wire_dtype", None)
    return wire if isinstance(wire, torch.dtype) else None
