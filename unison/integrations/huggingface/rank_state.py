"""What a Hugging Face checkpoint lacks to resume a unison run exactly: each rank's own part.

The Trainer and ``Accelerator.save_state`` write rank 0's weights and optimizer state, and every
rank's RNG states. A unison algorithm adds state of its own on every rank (DiLoCo's outer
momentum, SparseLoCo's error feedback, a schedule's step count), and an algorithm whose replicas
drift between syncs (model averaging) leaves each rank with weights and optimizer states of its
own. ``save`` writes them beside the checkpoint, one file per rank
(``unison-rank{R}-of-{W}.pt``, written whole then renamed), and ``load`` puts them back after the
Trainer or Accelerate has loaded its part.

Example::

    rank_state.save(checkpoint_dir, model, [optimizer])   # every rank, after the checkpoint's own files
    rank_state.load(checkpoint_dir, model, [optimizer])   # every rank, after the checkpoint's own loads
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch

from ...engine.snapshot import to_cpu
from ...parallel import ALGORITHM_KEY, DataParallel

FORMAT = "unison.huggingface.rank"
VERSION = 1


def path(directory: str, rank: int, world_size: int) -> str:
    """The file of rank ``rank`` among ``world_size`` in a checkpoint ``directory``."""
    return os.path.join(directory, f"unison-rank{rank}-of-{world_size}.pt")


def save(directory: str, model: DataParallel, optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """Write this rank's part of the run into ``directory``; return the file's path.

    Args:
        directory: the checkpoint's folder (created if missing).
        model: the running ``unison.DataParallel``.
        optimizers: the torch optimizers it steps (an Accelerate wrapper's ``.optimizer``).
    """
    model.flush()  # pending updates (nonblocking, an overlapped outer step) land first
    drift = model.algorithm.replicas_drift and model.world_size > 1
    entry: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "algorithm": model.algorithm.name,
        "describe": model.algorithm.describe(),
        "state": model.core.algorithm_entry(),
        "model": model.module.state_dict() if drift else None,
        "optimizers": [opt.state_dict() for opt in optimizers] if drift else None,
    }
    os.makedirs(directory, exist_ok=True)
    target = path(directory, model.rank, model.world_size)
    partial = target + ".partial"
    torch.save(to_cpu(entry), partial)
    os.replace(partial, target)
    return target


def load(directory: str, model: DataParallel, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Restore this rank's part from ``directory``; False (with a warning) if it holds none for this
    rank and world size (a checkpoint of torch DDP, or of another number of processes): the
    algorithm then starts afresh from the checkpoint's weights.

    Raises ValueError when the part was saved by another algorithm (its state would not fit).
    """
    source = path(directory, model.rank, model.world_size)
    if not os.path.isfile(source):
        warnings.warn(
            f"{directory} holds no unison state for rank {model.rank} of {model.world_size} (saved without unison, "
            "or by another number of processes): the algorithm starts afresh from the checkpoint's weights",
            stacklevel=3,
        )
        return False
    entry = torch.load(source, map_location="cpu", weights_only=True)
    if entry.get("format") != FORMAT or entry.get("version") != VERSION:
        raise ValueError(f"{source} is not a unison rank state of version {VERSION}")
    if entry["algorithm"] != model.algorithm.name:
        raise ValueError(
            f"{directory} was saved by a run of {entry['describe']}, and this one runs {model.algorithm.describe()}: "
            f"resume with algorithm={entry['algorithm']!r} (switch_to another afterwards if you wish), or start "
            "from the checkpoint's weights alone (from_pretrained) without resume_from_checkpoint"
        )
    weights = entry["model"] if entry["model"] is not None else model.module.state_dict()
    state = dict(weights)
    if entry["state"] is not None:
        state[ALGORITHM_KEY] = entry["state"]
    model.load_state_dict(state)
    if entry["optimizers"] is not None:
        if len(entry["optimizers"]) != len(optimizers):
            raise ValueError(
                f"{source} holds {len(entry['optimizers'])} optimizer state(s), and this run has {len(optimizers)}"
            )
        for opt, saved in zip(optimizers, entry["optimizers"]):
            opt.load_state_dict(saved)
    return True
