"""Checkpoints: save a training run and resume it exactly where it stopped.

``save`` is a collective: every rank calls it. What differs between ranks (RNG
states, algorithm state such as error-feedback residuals, and, for
model-averaging algorithms whose replicas drift apart, the weights and
optimizer states) is gathered to rank 0, which writes one file atomically
(a temporary file in the same directory, fsync, rename), so a crash at any
moment leaves either the previous checkpoint or the new one, never half of
one. ``load`` reads that file on every rank and gives each rank its own
entries, so training goes on along the same trajectory as if it had never
stopped. Saving over the same path each time is safe, which is what makes
"resume from the last checkpoint" simple::

    state = unison.load(path, model, optimizer, sampler, missing_ok=True)
    epoch, step = (state["epoch"], state["step"]) if state else (0, 0)

A model sharded by FSDP2 is not gathered: ``path`` is then a directory that
torch.distributed.checkpoint writes, each rank its own shards
(``sharded_checkpoint``), with the same calls, guarantees and errors.
"""

from __future__ import annotations

import contextlib
import glob
import os
import uuid
import warnings
import zlib
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from . import sharded_checkpoint
from .data import ShardSampler
from .data import group_rank_and_size as _rank_and_size
from .engine.comm import broadcast_object, gather_objects, tensor_bytes
from .engine.snapshot import read_agreed, rng_states, seed_all, set_rng_states, to_cpu
from .optim import DistributedOptimizer
from .parallel import ALGORITHM_KEY, DataParallel

FORMAT = "unison.checkpoint"
VERSION = 1

Optimizers = Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]


def save(
    path: Union[str, os.PathLike],
    model: nn.Module,
    optimizer: Optimizers = None,
    sampler: Optional[ShardSampler] = None,
    *,
    epoch: int = 0,
    step: int = 0,
    extra: Any = None,
) -> None:
    """Write a checkpoint of the run to ``path``: a collective, every rank must call it.

    Args:
        path: the file to write (its directory is created); rank 0 writes it.
            Writing over the previous checkpoint is safe: the file is replaced
            in one atomic rename, after the new one is complete on disk. A
            directory for a model sharded by FSDP2 (below).
        model: a ``unison.DataParallel`` or a plain module (replicated alike on
            every rank, as under torch DDP), or either sharded by FSDP2.
        optimizer: an optimizer or a list of them.
        sampler: a ``ShardSampler``, whose position in the epoch is saved so
            the resumed run sees the rest of the epoch in the same order.
        epoch, step: your loop's counters, returned by ``load``. Save at the
            end of an epoch with ``epoch=epoch + 1``.
        extra: anything else to keep (an LR scheduler's state dict, a best
            score), from rank 0; plain data: numbers, strings, lists, dicts, tensors.

    Stored: rank 0's weights and optimizer states (every rank's when the
    algorithm lets replicas drift, or the optimizer is a DistributedOptimizer),
    every rank's algorithm state and torch/Python/NumPy RNG states, the
    sampler's position, the world size and the algorithm. Every rank returns
    once the file is in place; if any rank fails to produce its part or rank 0
    fails to write, every rank raises instead of waiting forever.

    A model sharded by FSDP2 (a DataParallel over it, or the FSDP2 module):
    ``path`` is a directory, written by torch.distributed.checkpoint without
    gathering (each rank its shards of the weights and optimizer states, its
    replica's own when replicas drift; its algorithm and RNG states), beside
    ``path`` under a temporary name, then swapped into place. It resumes
    exactly on the same world size and device mesh.

    Example::

        >>> unison.save("ckpt/last.pt", model, optimizer, sampler, epoch=epoch, step=step)
    """
    path = os.fspath(path)
    optimizers = _optimizer_list(optimizer)
    _check_plain(extra, "extra")
    if sharded_checkpoint.is_sharded(model):
        sharded_checkpoint.save(path, model, optimizers, sampler, epoch=epoch, step=step, extra=extra)
        return
    rank, world = _rank_and_size(None)
    algorithm = model.algorithm if isinstance(model, DataParallel) else None
    per_rank = world > 1 and (
        (algorithm is not None and algorithm.replicas_drift)
        or any(isinstance(o, DistributedOptimizer) for o in optimizers)
    )

    try:
        if isinstance(model, DataParallel):
            model.flush()  # pending updates (nonblocking, diloco's overlap) land before the state is read
        mine: Any = _rank_entry(model, optimizers, with_weights=per_rank)
    except Exception as exc:  # tell rank 0 instead of leaving it waiting in the gather
        mine = _Failure(f"rank {rank}: {type(exc).__name__}: {exc}")
    entries = [mine] if world == 1 else gather_objects(mine)

    status: Optional[str] = None
    if rank == 0:
        failures = [e.message for e in entries if isinstance(e, _Failure)]
        if failures:
            status = "; ".join(failures)
        else:
            checkpoint = {
                "format": FORMAT,
                "version": VERSION,
                "id": uuid.uuid4().hex,
                "world_size": world,
                "algorithm": None if algorithm is None else algorithm.name,
                "algorithm_config": None if algorithm is None else algorithm.describe(),
                "epoch": int(epoch),
                "step": int(step),
                "extra": extra,
                "sampler": None if sampler is None else sampler.state_dict(),
                "model": entries[0].pop("model"),
                "optimizers": entries[0].pop("optimizers"),
                "ranks": entries,
            }
            try:
                _write_atomically(checkpoint, path)
            except Exception as exc:
                status = f"rank 0 could not write {path}: {type(exc).__name__}: {exc}"
    if world > 1:
        status = broadcast_object(status)  # doubles as the barrier: nobody runs ahead of the file
    if status is not None:
        raise RuntimeError(f"checkpoint {path} was not saved: {status}")


def load(
    path: Union[str, os.PathLike],
    model: nn.Module,
    optimizer: Optimizers = None,
    sampler: Optional[ShardSampler] = None,
    *,
    strict: bool = True,
    missing_ok: bool = False,
) -> Optional[dict[str, Any]]:
    """Restore a checkpoint written by ``save``: a collective, every rank must call it.

    Every rank reads ``path`` (so it must be on a filesystem all ranks see)
    and restores its own weights, optimizer and algorithm states and RNG
    states, and the sampler's position. If the world size changed, every
    rank takes rank 0's entries and reseeds its RNGs from them (with a
    warning): training goes on, but not along the old trajectory.

    Returns ``{"epoch", "step", "extra", "world_size", "algorithm"}`` as
    saved, or None when ``missing_ok`` and no rank finds the file.

    Raises (on every rank alike, so none is left waiting): FileNotFoundError
    naming the path; ValueError for a file that is not a unison checkpoint, a
    checkpoint of another algorithm (``strict=False`` loads everything else),
    a different number of optimizers, or ranks that read different files.

    A model sharded by FSDP2 loads the directory ``save`` wrote for it with
    torch.distributed.checkpoint, each rank its own shards and states; saved
    on another world size or device mesh, it is refused (ValueError saying
    both layouts), since each rank must find its own shards and states.

    Example::

        >>> state = unison.load("ckpt/last.pt", model, optimizer, sampler, missing_ok=True)
    """
    path = os.fspath(path)
    optimizers = _optimizer_list(optimizer)
    if sharded_checkpoint.is_sharded(model):
        return sharded_checkpoint.load(path, model, optimizers, sampler, strict=strict, missing_ok=missing_ok)
    rank, world = _rank_and_size(None)
    checkpoint = read_agreed(path, _read, rank, world)
    if checkpoint is None:
        if missing_ok:
            return None
        raise FileNotFoundError(f"no checkpoint at {path}")

    algorithm = model.algorithm if isinstance(model, DataParallel) else None
    name = None if algorithm is None else algorithm.name
    restore_algorithm = True
    if checkpoint["algorithm"] != name:
        if strict:
            raise ValueError(
                f"checkpoint {path} was saved by a model running algorithm {checkpoint['algorithm']!r} but this one runs "
                f"{name!r}: build DataParallel with algorithm={checkpoint['algorithm']!r} to resume exactly (then switch_to "
                "another if you wish), or load with strict=False to restore everything but the algorithm's state"
            )
        restore_algorithm = False
    if len(checkpoint["optimizers"]) != len(optimizers):
        raise ValueError(
            f"checkpoint {path} holds {len(checkpoint['optimizers'])} optimizer state(s) but {len(optimizers)} optimizer(s) were given"
        )

    entry, same_world = entry_for_rank(checkpoint["ranks"], rank, world)
    if not same_world:
        warnings.warn(
            f"checkpoint {path} was saved by {checkpoint['world_size']} ranks and is loaded by {world}: every rank takes rank 0's "
            "state and reseeds its RNGs, so training resumes but not along the saved trajectory",
            stacklevel=2,
        )
    weights = entry.get("model", checkpoint["model"])
    algorithm_state = entry["algorithm"] if restore_algorithm else None
    if isinstance(model, DataParallel) and algorithm_state:
        model.load_state_dict({**weights, ALGORITHM_KEY: {"name": name, "state": algorithm_state}}, strict=strict)
    else:
        (model.module if isinstance(model, DataParallel) else model).load_state_dict(weights, strict=strict)
    for opt, state in zip(optimizers, entry.get("optimizers", checkpoint["optimizers"])):
        opt.load_state_dict(state)
    if sampler is not None and checkpoint["sampler"] is not None:
        sampler.load_state_dict(checkpoint["sampler"])
    if same_world:
        set_rng_states(entry["rng"])
    else:
        _reseed(checkpoint["ranks"][0]["rng"], rank)
    return {key: checkpoint[key] for key in ("epoch", "step", "extra", "world_size", "algorithm")}


class _Failure:
    """What a rank sends instead of its state when producing it failed."""

    def __init__(self, message: str) -> None:
        self.message = message


def _optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer or a list of them, got {type(opt).__name__}")
    return optimizers


def entry_for_rank(entries: Sequence[dict[str, Any]], rank: int, world_size: int) -> tuple[dict[str, Any], bool]:
    """This rank's entry among a checkpoint's per-rank ``entries``, and whether the world size is the saved one.

    When another number of ranks saved them, every rank takes rank 0's entry:
    the run resumes, but not along the saved trajectory. ``unison.load`` and
    the Lightning strategy both decide it here.

    Args:
        entries: the entries the saving ranks wrote, in rank order.
        rank: this process's rank.
        world_size: the number of ranks loading.

    Example::

        >>> entry, same_world = entry_for_rank(checkpoint["ranks"], rank, world_size)
    """
    if len(entries) == world_size:
        return entries[rank], True
    return entries[0], False


def _rank_entry(model: nn.Module, optimizers: list[torch.optim.Optimizer], with_weights: bool) -> dict[str, Any]:
    """This rank's part of the checkpoint (tensors moved to the CPU)."""
    module = model.module if isinstance(model, DataParallel) else model
    entry: dict[str, Any] = {"rng": rng_states(), "algorithm": _algorithm_state(model)}
    if with_weights or _rank_and_size(None)[0] == 0:
        entry["model"] = module.state_dict()
        entry["optimizers"] = [opt.state_dict() for opt in optimizers]
    return to_cpu(entry)


def _algorithm_state(model: nn.Module) -> Optional[dict[str, Any]]:
    """The running algorithm's state dict ({} when it keeps none); None for a plain module.

    A DistributedOptimizer's algorithm state travels in its own ``state_dict()``.
    """
    if not isinstance(model, DataParallel):
        return None
    state = model.algorithm_state
    return {} if state is None else state.state_dict()


_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor)


def _check_plain(obj: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` would not read back, naming where it is."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; keys must be str or int")
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(
            f"{where} is a {type(obj).__name__}; a checkpoint's extra holds plain data only (numbers, strings, lists, dicts, tensors)"
        )


def _write_atomically(obj: Any, path: str) -> None:
    """torch.save to a temporary file beside ``path``, fsync, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(os.path.basename(path))}.*.tmp")):
        with contextlib.suppress(OSError):  # left by a writer that was killed mid-write
            os.unlink(stale)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read(path: str) -> dict[str, Any]:
    """The checkpoint at ``path``; ValueError if the file is not one."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    if os.path.isdir(path):
        raise ValueError(
            f"{path} is a directory: unison.save writes one for a model sharded by FSDP2, which loads into "
            "that sharded model only"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} is not a unison checkpoint (torch.load failed: {exc})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a unison checkpoint (written by unison.save); "
            "a plain state dict loads with model.load_state_dict(torch.load(path))"
        )
    if checkpoint.get("version") != VERSION:
        raise ValueError(
            f"{path} is a unison checkpoint of version {checkpoint.get('version')!r}; this unison reads version {VERSION}"
        )
    return checkpoint


def _reseed(rank0_state: dict[str, Any], rank: int) -> None:
    """Seed every RNG from rank 0's saved torch state and this rank: deterministic, different per rank."""
    seed_all((zlib.crc32(tensor_bytes(rank0_state["torch"])) * 1_000_003 + rank) % 2**32)
