"""State as it travels: tensors copied to the CPU, every RNG seeded at once, RNG states kept.

A checkpoint writes state to a file; fault tolerance sends it to a joiner over
the wire. Both take the same CPU copy, and both reseed a process the same way.
Both kinds of checkpoint (one file, or a sharded model's directory) keep each
rank's RNG states with ``rng_states`` and restore them with ``set_rng_states``,
and read their file on every rank with ``read_agreed``.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, Optional

import torch

from ..runtime import torch_private
from .comm import all_gather_objects


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (in dicts, lists, tuples) detached and on the CPU, for a file.

    Module state dicts keep their ``_metadata`` (the versions ``load_state_dict`` reads).

    Example::

        >>> torch.save(to_cpu(model.state_dict()), path)
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        out = type(obj)((k, to_cpu(v)) for k, v in obj.items())
        torch_private.copy_state_metadata(obj, out)  # module state dicts' versions, which load_state_dict reads
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def seed_all(seed: int) -> None:
    """Seed torch's, Python's and (when imported) NumPy's RNGs with ``seed``.

    Example::

        >>> seed_all(1234)
    """
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed)


def rng_states() -> dict[str, Any]:
    """This process's torch, Python and (when imported) NumPy and CUDA RNG states, as plain data.

    What a checkpoint keeps per rank so a resumed run draws the same numbers.

    Example::

        >>> states = rng_states()
        >>> set_rng_states(states)    # the next draws repeat
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    """Restore the RNG states ``rng_states()`` returned (also after a round trip through a file).

    Example::

        >>> set_rng_states(torch.load(path)["rng"])
    """
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _tuples(obj: Any) -> Any:
    """Lists back to tuples (random.setstate wants its nested tuple)."""
    return tuple(_tuples(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


def read_agreed(path: str, read: Callable[[str], dict[str, Any]], rank: int, world: int) -> Optional[dict[str, Any]]:
    """The checkpoint ``read(path)`` gives, the same on every rank; None if no rank finds it.

    ``read`` raises FileNotFoundError where there is nothing at ``path`` and ValueError for what is
    not a checkpoint; the checkpoint carries an ``"id"``. Raises alike on every rank (never leaves
    one waiting) when a rank cannot read it, reads another, or finds none where others do.

    Example::

        >>> checkpoint = read_agreed(path, _read, rank, world)
    """
    checkpoint: Optional[dict[str, Any]] = None
    try:
        checkpoint = read(path)
        outcome = ("ok", checkpoint["id"])
    except FileNotFoundError:
        outcome = ("missing", f"no checkpoint at {path} (rank {rank})")
    except ValueError as exc:
        outcome = ("error", f"{exc} (rank {rank})")
    except Exception as exc:
        outcome = ("error", f"cannot read {path}: {type(exc).__name__}: {exc} (rank {rank})")
    outcomes = [outcome] if world == 1 else all_gather_objects(outcome, None)
    kinds = {kind for kind, _ in outcomes}
    if kinds == {"missing"}:
        return None
    if "error" in kinds:
        raise ValueError(next(text for kind, text in outcomes if kind == "error"))
    if "missing" in kinds:
        ranks = [r for r, (kind, _) in enumerate(outcomes) if kind == "missing"]
        raise FileNotFoundError(
            f"rank(s) {ranks} cannot see the checkpoint {path} that the others read: it must be on a filesystem "
            "every rank can read"
        )
    if len({text for _, text in outcomes}) > 1:
        raise ValueError(
            f"the ranks read different checkpoints at {path} (was it replaced while they read?); load again"
        )
    assert checkpoint is not None
    return checkpoint
