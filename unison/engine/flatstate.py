"""Per-parameter algorithm state kept flat per bucket, saved by parameter name.

Error-feedback residuals and compressed momenta live in flat tensors laid out
like a gradient bucket, so they are updated with one operation per bucket.
They are saved per parameter name, so a checkpoint restores exactly even when
the buckets are planned differently (after the first step's re-plan, or with
another bucket size).
"""

from __future__ import annotations

import torch

from .buckets import Bucket
from .flat import split


class FlatState:
    """One tensor per parameter, stored flat per bucket (zeros until first set)."""

    def __init__(self) -> None:
        # bucket's parameter names -> (flat tensor, per-parameter views of it)
        self._flats: dict[tuple[str, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._loose: dict[str, torch.Tensor] = {}

    def get(self, bucket: Bucket) -> torch.Tensor:
        """The flat state tensor of ``bucket``, created on first use."""
        key = tuple(bucket.names)
        entry = self._flats.get(key)
        if entry is None:
            self._retire(set(key))
            flat = torch.zeros_like(bucket.flat)
            views = split(flat, bucket.views)
            for name, view in zip(key, views):
                if name in self._loose:
                    view.copy_(self._loose.pop(name).reshape(view.shape))
            entry = self._flats[key] = (flat, views)
        return entry[0]

    def _retire(self, names: set[str]) -> None:
        """Turn the state of buckets sharing any of ``names`` back into per-parameter tensors."""
        for key in [k for k in self._flats if names.intersection(k)]:
            _, views = self._flats.pop(key)
            self._loose.update((name, view.clone()) for name, view in zip(key, views))

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {name: t.clone() for name, t in self._loose.items()}
        for key, (_, views) in self._flats.items():
            out.update((name, view.clone()) for name, view in zip(key, views))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._flats.clear()
        self._loose = {name: t.clone() for name, t in state.items()}
