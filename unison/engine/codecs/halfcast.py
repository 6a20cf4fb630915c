"""A float32 buffer cast to a 2-byte dtype (fp16, bf16) and back in place: a cast needs no wire buffer.

The 2-byte values are written into the first half of the buffer's own bytes.
Value ``i`` of the narrow form lies at bytes ``[2i, 2i+2)``, of the wide form at
``[4i, 4i+4)``; so the range ``[a, 2a)`` is cast in one kernel whose input and
output do not overlap, and ranges go in doubling order (narrowing) or in
reverse (widening), each writing only over values already read. The first
``FIRST`` values go through a small temporary. ``log2(numel / FIRST)`` kernels
in all; the values are those of ``flat.to(dtype)``, bit for bit. That is the
blocked schedule, the CPU's; the whole one (every other device's, see
``schedule.py``) casts through a temporary of the narrow size in two kernels,
whatever the size, with the same values.

Example::

    wire = narrow_(bucket.flat, torch.float16)  # a float16 view of the bucket's first half
    dist.all_reduce(wire)
    widen_(wire, bucket.flat)                   # the float32 sums, back in the bucket
"""

from __future__ import annotations

from typing import Optional

import torch

from .schedule import WHOLE, schedule_for

__all__ = ["WIRE_DTYPES", "fits", "from_wire", "narrow_", "to_wire", "widen_", "wire_dtype"]

#: Cast codecs: the dtypes a tensor may travel in, by the value of a ``wire_dtype`` option
#: (DiLoCo's, DASO's).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(value: object) -> "torch.dtype | None":
    """The wire dtype named by ``value`` (a name of ``WIRE_DTYPES`` or one of its dtypes), else None."""
    if isinstance(value, torch.dtype):
        return value if value in WIRE_DTYPES.values() else None
    return WIRE_DTYPES.get(value) if isinstance(value, str) else None


#: Values cast through a temporary: the first range, of which the narrow form overlaps the wide one.
FIRST = 1 << 16


def fits(flat: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``flat`` can be narrowed to ``dtype`` in place (a contiguous 1-D buffer twice its size)."""
    item = torch.empty((), dtype=dtype).element_size()
    return flat.dim() == 1 and flat.is_contiguous() and flat.element_size() == 2 * item and flat.dtype != dtype


def _ranges(numel: int) -> list[tuple[int, int]]:
    """``[0, FIRST)``, then doubling ranges ``[a, 2a)`` up to ``numel``."""
    out = [(0, min(numel, FIRST))]
    while out[-1][1] < numel:
        a = out[-1][1]
        out.append((a, min(numel, 2 * a)))
    return out


def narrow_(flat: torch.Tensor, dtype: torch.dtype, schedule: Optional[str] = None) -> torch.Tensor:
    """Cast ``flat`` to ``dtype`` into the first half of its own bytes; returns that narrow view.

    ``flat`` holds garbage afterwards until ``widen_`` puts the (reduced) values back.
    ``schedule``: ``"blocked"`` or ``"whole"`` (default: ``schedule_for(flat.device)``).
    """
    n = flat.numel()
    out = flat.view(dtype)[:n]
    with torch.no_grad():
        if schedule_for(flat.device, schedule) == WHOLE:
            return out.copy_(flat.to(dtype))  # the narrow values apart first: they overlap the wide ones
        for a, b in _ranges(n):
            out[a:b].copy_(flat[a:b].to(dtype) if a == 0 else flat[a:b])
    return out


def widen_(narrow: torch.Tensor, flat: torch.Tensor, schedule: Optional[str] = None) -> torch.Tensor:
    """Cast the narrow view ``narrow_`` returned back into ``flat``, in place; returns ``flat``.
    ``schedule`` as ``narrow_``'s."""
    with torch.no_grad():
        if schedule_for(flat.device, schedule) == WHOLE:
            return flat.copy_(narrow.clone())
        for a, b in reversed(_ranges(flat.numel())):
            flat[a:b].copy_(narrow[a:b].to(flat.dtype) if a == 0 else narrow[a:b])
    return flat


def to_wire(flat: torch.Tensor, dtype: torch.dtype, schedule: Optional[str] = None) -> torch.Tensor:
    """``flat`` as ``dtype`` for the wire: itself if it is already, else cast in its own bytes
    where it fits (``narrow_``, in ``schedule``), else a copy. ``from_wire`` puts the reduced values back."""
    if flat.dtype == dtype:
        return flat
    return narrow_(flat, dtype, schedule) if fits(flat, dtype) else flat.to(dtype)


def from_wire(wire: torch.Tensor, flat: torch.Tensor, schedule: Optional[str] = None) -> torch.Tensor:
    """The reduced ``wire`` (``to_wire``'s) back into ``flat`` (``widen_`` in ``schedule``); returns ``flat``."""
    if wire is flat:
        return flat
    return widen_(wire, flat, schedule) if wire.data_ptr() == flat.data_ptr() else flat.copy_(wire)
