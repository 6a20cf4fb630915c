"""Checkpoints of a model sharded by FSDP2, written by torch.distributed.checkpoint (DCP).

``unison.save`` and ``unison.load`` come here when the model's parameters are DTensors; ``path``
is then a directory in DCP's format (each rank writes its own shards, nothing is gathered) plus
``record.pt``, rank 0's record of the run: counters, ``extra``, the sampler's position, the
layout, the algorithm. What makes the resumed run follow the same trajectory:

- the module's weights and the optimizers' states, as the DTensors FSDP2 holds
  (``get_model_state_dict``, ``get_optimizer_state_dict``). When the algorithm lets the replicas
  drift apart (local_sgd, diloco), each replica's are stored under its own keys, ``replica.{r}.``:
  DCP keeps one copy of what several ranks save under one key, which is what stores the replicas'
  equal copies once under allreduce.
- each rank's algorithm state (diloco's global weights and outer momentum: tensors shaped like
  its local shards) and RNG states, under ``rank.{g}``, as bytes of ``torch.save``: DCP stores
  bytes whole, where a dict would be flattened into keys whose tensors load only into tensors of
  the saved shapes.

The directory is written beside ``path`` under a temporary name and swapped into place once
complete (one atomic exchange on Linux), so a crash leaves the previous checkpoint whole. It
resumes only on the layout it was saved from: the same ranks in the same device mesh.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import io
import os
import shutil
import sys
import uuid
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .data import ShardSampler
from .engine.comm import all_gather_objects, broadcast_object, gather_objects
from .engine.snapshot import read_agreed, rng_states, set_rng_states, to_cpu
from .parallel import ALGORITHM_KEY, DataParallel
from .runtime import torch_private
from .sharded import is_dtensor

FORMAT = "unison.sharded_checkpoint"
VERSION = 1
#: rank 0's record of the run, beside DCP's files in the checkpoint's directory
RECORD = "record.pt"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (a DataParallel or a module) holds DTensor parameters: its checkpoint is DCP's."""
    return any(is_dtensor(p) for p in model.parameters())


def save(
    path: str,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    sampler: Optional[ShardSampler],
    *,
    epoch: int,
    step: int,
    extra: Any,
) -> None:
    """Write the checkpoint directory ``path`` with DCP: a collective, every rank calls it.

    Args:
        path: the directory; a previous checkpoint there is replaced once the new one is complete.
            Anything else there is refused rather than deleted.
        model: a DataParallel over an FSDP2 module, or the FSDP2 module itself.
        optimizers: the optimizers over its parameters.
        sampler: saved with rank 0's position.
        epoch, step, extra: kept in the record, from rank 0.

    Every rank raises alike if any rank fails to produce or write its part.

    Example::

        >>> save("ckpt", model, [opt], sampler, epoch=1, step=0, extra=None)
    """
    rank = dist.get_rank()
    module, algorithm = _unwrapped(model)
    per_replica = algorithm is not None and algorithm.replicas_drift
    state: dict[str, Any] = {}
    record: dict[str, Any] = {}
    tmp: Optional[str] = None
    failure: Optional[str] = None
    try:
        if isinstance(model, DataParallel):
            model.flush()  # pending updates (diloco's overlap) land before the state is read
        state = _states(module, optimizers, _prefix(model, per_replica))
        state[f"rank.{rank}"] = _pack({"rng": rng_states(), "algorithm": _algorithm_state(model)})
        record = {
            "format": FORMAT,
            "version": VERSION,
            "id": uuid.uuid4().hex,
            "layout": _layout(module),
            "algorithm": None if algorithm is None else algorithm.name,
            "algorithm_config": None if algorithm is None else algorithm.describe(),
            "per_replica": per_replica,
            "optimizers": len(optimizers),
            "epoch": int(epoch),
            "step": int(step),
            "extra": extra,
            "sampler": None if sampler is None else sampler.state_dict(),
        }
        if rank == 0:
            tmp = _temporary_beside(path)
    except Exception as exc:
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    _agree(failure, f"checkpoint {path} was not saved")
    tmp = broadcast_object(tmp)
    assert tmp is not None

    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=tmp)
        failure = None
    except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException
        failure = _failure(rank, exc)
    failures = gather_objects(failure)
    status: Optional[str] = None
    if rank == 0:
        status = "; ".join(f for f in failures if f is not None) or None
        if status is None:
            try:
                _write_record(record, tmp)
                _swap_into_place(tmp, path)
            except Exception as exc:
                status = f"rank 0 could not put it in place: {type(exc).__name__}: {exc}"
        if status is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    status = broadcast_object(status)  # also the barrier: nobody runs ahead of the directory
    if status is not None:
        raise RuntimeError(f"checkpoint {path} was not saved: {status}")


def load(
    path: str,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    sampler: Optional[ShardSampler],
    *,
    strict: bool,
    missing_ok: bool,
) -> Optional[dict[str, Any]]:
    """Restore the checkpoint directory ``path`` written by ``save``: a collective, every rank calls it.

    Each rank reads back its own shards, algorithm and RNG states (its replica's weights and
    optimizer states when they were saved per replica and the running algorithm lets them
    drift; replica 0's otherwise), and the sampler's position.

    Returns ``{"epoch", "step", "extra", "world_size", "algorithm"}`` as saved, or None when
    ``missing_ok`` and no rank finds ``path``.

    Raises, on every rank alike: FileNotFoundError naming the path; ValueError for a path that
    is not such a checkpoint, one saved on another layout (world size, device mesh), by another
    algorithm (``strict=False`` loads everything but its state) or with another number of
    optimizers; RuntimeError if a rank fails to restore its part.

    Example::

        >>> state = load("ckpt", model, [opt], sampler, strict=True, missing_ok=True)
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    record = read_agreed(path, _read_record, rank, world)
    if record is None:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no checkpoint at {path}")

    module, algorithm = _unwrapped(model)
    saved, here = record["layout"], _layout(module)
    if saved != here:
        raise ValueError(
            f"checkpoint {path} was saved by {_described(saved)} but is loaded by {_described(here)}: a sharded "
            "checkpoint resumes exactly only on the layout it was saved from (each rank reads back its own "
            "shards, algorithm and RNG states); load it with that world size and device mesh"
        )
    name = None if algorithm is None else algorithm.name
    if record["algorithm"] != name and strict:
        raise ValueError(
            f"checkpoint {path} was saved by a model running algorithm {record['algorithm']!r} but this one runs "
            f"{name!r}: build DataParallel with algorithm={record['algorithm']!r} to resume exactly (then switch_to "
            "another if you wish), or load with strict=False to restore everything but the algorithm's state"
        )
    if record["optimizers"] != len(optimizers):
        raise ValueError(
            f"checkpoint {path} holds {record['optimizers']} optimizer state(s) but {len(optimizers)} optimizer(s) "
            "were given"
        )

    if not record["per_replica"]:
        prefix = ""
    elif algorithm is not None and algorithm.replicas_drift:
        prefix = _prefix(model, True)
    else:
        prefix = "replica.0."  # replicas kept equal from now on all start from the first one's weights
    state: dict[str, Any] = {}
    failure: Optional[str] = None
    try:
        if isinstance(model, DataParallel):
            model.flush()  # nothing pending lands on the restored weights
        state = _states(module, optimizers, prefix)  # DCP reads into these tensors, FSDP2's own
        state[f"rank.{rank}"] = b""
    except Exception as exc:
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    _agree(failure, f"checkpoint {path} was not loaded")

    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=path)
        failure = None
    except (Exception, dcp.CheckpointException) as exc:  # DCP's is a BaseException
        failure = _failure(rank, exc)
    _agree(failure, f"checkpoint {path} was not loaded")

    try:
        _restore(model, module, optimizers, state, prefix, _unpack(state[f"rank.{rank}"]), record, strict)
        if sampler is not None and record["sampler"] is not None:
            sampler.load_state_dict(record["sampler"])
        failure = None
    except Exception as exc:
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    _agree(failure, f"checkpoint {path} was not loaded")
    return {**{key: record[key] for key in ("epoch", "step", "extra", "algorithm")}, "world_size": world}


def _unwrapped(model: nn.Module) -> tuple[nn.Module, Any]:
    """The FSDP2 module and the running algorithm (None for a bare module)."""
    if isinstance(model, DataParallel):
        return model.module, model.algorithm
    return model, None


def _prefix(model: nn.Module, per_replica: bool) -> str:
    """Where this rank's weights and optimizer states go: its replica's keys, or the shared ones."""
    return f"replica.{model.rank}." if per_replica and isinstance(model, DataParallel) else ""


def _states(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], prefix: str) -> dict[str, Any]:
    """The module's and optimizers' state dicts as DTensors (sharing FSDP2's storage), for DCP."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {f"{prefix}model": get_model_state_dict(module)}
    with torch_private.step_hooks_held(optimizers):
        for i, opt in enumerate(optimizers):
            state[f"{prefix}optimizer.{i}"] = get_optimizer_state_dict(module, opt)
    return state


def _restore(
    model: nn.Module,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    state: dict[str, Any],
    prefix: str,
    mine: dict[str, Any],
    record: dict[str, Any],
    strict: bool,
) -> None:
    """Put what DCP read back into the module, the optimizers, the algorithm and the RNGs."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    weights = state[f"{prefix}model"]
    if isinstance(model, DataParallel):
        entry = {"name": model.algorithm.name, "state": mine["algorithm"]}
        ours = record["algorithm"] == model.algorithm.name and mine["algorithm"]
        model.load_state_dict({**weights, ALGORITHM_KEY: entry} if ours else weights, strict=strict)
    else:
        module.load_state_dict(weights, strict=strict)
    with torch_private.step_hooks_held(optimizers):
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(module, opt, state[f"{prefix}optimizer.{i}"])
    set_rng_states(mine["rng"])


def _algorithm_state(model: nn.Module) -> Optional[dict[str, Any]]:
    """The running algorithm's state dict ({} when it keeps none); None for a bare module."""
    if not isinstance(model, DataParallel):
        return None
    state = model.algorithm_state
    return {} if state is None else state.state_dict()


def _layout(module: nn.Module) -> dict[str, Any]:
    """The world size and the device mesh the shards lie on (its ranks and dimension names).

    A model sharded over ``unison.node_mesh()`` lies on its own node's mesh, whose ranks differ from
    node to node (rank 0's record would not match the other nodes' ranks: they alone refused the
    load) and, under fault tolerance, are those of the membership that built the node's group (the
    mesh keeps them when the world is rebuilt: after a failure, rank 0's node could record ranks
    [2, 3] that no fresh job has). So it is described by every node's ranks in the current
    membership, nodes holding consecutive ranks: the same on every rank, and what a fresh job of as
    many nodes of as many processes has.
    """
    from .runtime.launch import is_node_mesh, topology

    mesh = next(p for p in module.parameters() if is_dtensor(p)).device_mesh  # type: ignore[attr-defined]
    if is_node_mesh(mesh):
        topo = topology()
        nodes = [topo.node_ranks(n) for n in range(topo.num_nodes)]
        return {"world_size": dist.get_world_size(), "mesh": nodes, "names": ("node", *mesh.mesh_dim_names)}
    mesh = torch_private.root_mesh(mesh)
    return {"world_size": dist.get_world_size(), "mesh": mesh.mesh.tolist(), "names": mesh.mesh_dim_names}


def _described(layout: dict[str, Any]) -> str:
    shape = torch.tensor(layout["mesh"]).shape
    return f"{layout['world_size']} ranks on a device mesh of shape {tuple(shape)} {layout['names']} (ranks {layout['mesh']})"


def _pack(obj: Any) -> bytes:
    """``obj`` (tensors moved to the CPU) as bytes of torch.save."""
    buffer = io.BytesIO()
    torch.save(to_cpu(obj), buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _failure(rank: int, exc: BaseException) -> str:
    """What failed, in one line: DCP raises on every rank one CheckpointException holding each failed
    rank's exception (and its traceback in its text), so it is named by the first of them."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, exc = min(failures.items(), key=lambda item: item[0])
    return f"rank {rank}: {type(exc).__name__}: {exc}"


def _agree(failure: Optional[str], what: str) -> None:
    """Raise RuntimeError on every rank if any rank failed (``failure``: its message, None if not)."""
    failures = list(dict.fromkeys(f for f in all_gather_objects(failure, None) if f is not None))
    if failures:
        raise RuntimeError(f"{what}: {'; '.join(failures)}")


def _read_record(path: str) -> dict[str, Any]:
    """The record in the checkpoint directory ``path``; ValueError if it is not one."""
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    if not os.path.isdir(path):
        raise ValueError(
            f"{path} is a file, a checkpoint of an unsharded model (unison.save writes a directory for a model "
            "sharded by FSDP2): it loads into the unsharded model only"
        )
    try:
        record = torch.load(os.path.join(path, RECORD), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a checkpoint written by unison.save (it holds no {RECORD})") from None
    except Exception as exc:
        raise ValueError(f"{path}/{RECORD} cannot be read: {type(exc).__name__}: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a checkpoint written by unison.save for a sharded model")
    if record.get("version") != VERSION:
        raise ValueError(
            f"{path} is a sharded unison checkpoint of version {record.get('version')!r}; this unison reads "
            f"version {VERSION}"
        )
    return record


def _temporary_beside(path: str) -> str:
    """A fresh name for the new directory beside ``path``, once ``path`` is known to be safe to replace
    (absent, empty, or a checkpoint of ours) and what killed writers left there is removed."""
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if os.path.lexists(path) and not _replaceable(path):
        raise ValueError(
            f"{path} exists and is not a checkpoint written by unison.save for a sharded model: it is left "
            "alone; remove it or save elsewhere"
        )
    for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(base)}.{'[0-9a-f]' * 8}.tmp")):
        shutil.rmtree(stale, ignore_errors=True)
    return os.path.join(directory, f".{base}.{uuid.uuid4().hex[:8]}.tmp")


def _replaceable(path: str) -> bool:
    return os.path.isdir(path) and (not os.listdir(path) or os.path.isfile(os.path.join(path, RECORD)))


def _write_record(record: dict[str, Any], directory: str) -> None:
    """torch.save ``record`` into ``directory`` and make it and the directory durable."""
    with open(os.path.join(directory, RECORD), "wb") as f:
        torch.save(record, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_directory(directory)


def _swap_into_place(tmp: str, path: str) -> None:
    """Make the complete directory ``tmp`` the checkpoint at ``path``, then remove the previous one.

    On Linux the two are exchanged in one step (renameat2 RENAME_EXCHANGE); elsewhere the previous
    one is renamed aside first, so a crash between the two renames leaves it beside ``path``.
    """
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # the previous checkpoint, now under the temporary name
    else:
        aside = tmp[: -len(".tmp")] + ".old"
        os.rename(path, aside)
        os.rename(tmp, path)
        _remove(aside)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def _remove(path: str) -> None:
    """Remove a directory with its files, or a link to one (leaving what it points to)."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28)
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), b)


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
