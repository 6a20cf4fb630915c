"""Tensors grouped by dtype and device into flat buffers: the one flattener of the library.

A collective moves one contiguous tensor, and tensors of different dtypes or
devices cannot share one. So gradient buckets, coalesced broadcasts and
averages, the hierarchical algorithms' node buffers, DASO's syncs, async's
rounds and gossip's messages all group their tensors by kind (``by_kind``) and
lay each kind end to end in one buffer allocated once (``Flat``, or ``Flats``
for tensors of any kinds), with views shaped like the tensors.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def kind(t: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    """What decides whether two tensors may share a flat buffer: their dtype and device."""
    return t.dtype, t.device


def by_kind(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The positions of ``tensors`` grouped by ``kind``, kinds in the order they first appear.

    Example::

        >>> by_kind([torch.zeros(2), torch.zeros(2, dtype=torch.half), torch.zeros(3)])
        [[0, 2], [1]]
    """
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(kind(t), []).append(i)
    return list(groups.values())


def split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat`` shaped like ``like`` (a bucket's layout)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class Flat:
    """Tensors of one dtype and device laid end to end in one buffer, allocated once (zeros).

    Args:
        like: the tensors (their shapes, dtype and device).
        dtype: the buffer's dtype (default theirs: a wire dtype makes a cast copy).
        numel: the buffer's length (default theirs together; a longer one ends in zero padding).

    Example::

        f = Flat(params)
        f.load()                 # the parameters' values, copied into f.flat
        dist.all_reduce(f.flat)  # f.views are shaped like the parameters
    """

    def __init__(self, like: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None, numel: Optional[int] = None):
        self.like = list(like)
        self.numel = sum(t.numel() for t in self.like)  # without the padding
        first = self.like[0]
        length = self.numel if numel is None else numel
        self.flat = torch.zeros(length, dtype=dtype or first.dtype, device=first.device)
        self.views = split(self.flat, self.like)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors' values in the buffer (without the padding)."""
        return self.numel * self.flat.element_size()

    def load(self, values: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        """Copy ``values`` (default: the tensors themselves) into the buffer; returns it."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, [v.detach() for v in (self.like if values is None else values)])
        return self.flat


class Flats:
    """Tensors of any kinds, one ``Flat`` per dtype and device (``parts``, in the order kinds first
    appear, holding the tensors at positions ``kinds``); ``views`` are shaped like ``tensors``, in
    their order.

    Args:
        tensors: the tensors.
        dtype: every buffer's dtype (default each kind's own).
        multiple: each buffer's length is rounded up to a multiple of it (zero padding: equal
            shards for ``multiple`` processes).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None, multiple: int = 1):
        self.tensors = list(tensors)
        self.kinds = by_kind(self.tensors)
        self.parts: list[Flat] = []
        views: list[Optional[torch.Tensor]] = [None] * len(self.tensors)
        for idx in self.kinds:
            like = [self.tensors[i] for i in idx]
            numel = sum(t.numel() for t in like)
            self.parts.append(Flat(like, dtype, -(-numel // multiple) * multiple))
            for i, v in zip(idx, self.parts[-1].views):
                views[i] = v
        self.views: list[torch.Tensor] = views  # type: ignore[assignment]  # every position filled

    def load(self, values: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Copy ``values`` (laid out like ``tensors``; default: the tensors themselves) into the buffers."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, [v.detach() for v in (self.tensors if values is None else values)])
