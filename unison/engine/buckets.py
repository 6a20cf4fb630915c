"""Parameters grouped into flat buckets, with gradients living in them as views.

A bucket is one contiguous tensor per group of same-dtype, same-device
parameters; each parameter's ``.grad`` is a view into it, so reducing a bucket
is a single collective with no copy in or out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .flat import Flat, kind, split  # noqa: F401  (split: re-exported, the bucket layout's views)

MB = 1024 * 1024


@dataclass
class Bucket:
    """A flat gradient buffer and the parameters whose gradients are views of it."""

    index: int
    indices: list[int]  # positions of the parameters in the owner's parameter list
    names: list[str]
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype


def plan(params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Split ``order`` (parameter positions) into buckets of about ``cap_bytes``.

    Parameters of different dtype or device never share a bucket. Buckets are
    listed in the order they fill, which is the order their gradients are
    expected to arrive; the first bucket of each kind is capped at
    ``first_cap_bytes`` so the first collective starts early in backward.
    """
    open_buckets: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    result: list[list[int]] = []
    for i in order:
        p = params[i]
        key = kind(p)
        current = open_buckets.setdefault(key, [])
        current.append(i)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        cap = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if sizes[key] >= cap:
            result.append(current)
            closed_count[key] = closed_count.get(key, 0) + 1
            open_buckets[key] = []
            sizes[key] = 0
    result.extend(b for b in open_buckets.values() if b)
    return result


def build(
    params: Sequence[torch.nn.Parameter], names: Sequence[str], groups: list[list[int]], adopt: bool = True
) -> list[Bucket]:
    """Allocate a flat buffer per group and make each parameter's grad a view of it.

    Existing gradients are copied in; parameters without one keep ``grad=None``
    until their first gradient arrives. With ``adopt=False`` gradients keep their
    own tensors (``gradient_as_bucket_view=False``): nothing is copied or re-pointed.
    """
    buckets = []
    for b, indices in enumerate(groups):
        members = [params[i] for i in indices]
        layout = Flat(members)
        bucket = Bucket(b, list(indices), [names[i] for i in indices], members, layout.flat, layout.views)
        for p, view in zip(bucket.params, bucket.views):
            if adopt and p.grad is not None:
                view.copy_(p.grad)
                p.grad = view
        buckets.append(bucket)
    return buckets
