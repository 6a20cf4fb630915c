"""State as it travels: tensors copied to the CPU, and every RNG seeded at once.

A checkpoint writes state to a file; fault tolerance sends it to a joiner over
the wire. Both take the same CPU copy, and both reseed a process the same way.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch


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
        if hasattr(obj, "_metadata"):  # module state dicts' versions, which load_state_dict reads
            out._metadata = obj._metadata  # type: ignore[attr-defined]
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
