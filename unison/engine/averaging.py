"""Averaging parameters (or any tensors) across ranks: blocking or started now
and collected later, optionally cast down for the wire.

The model-averaging algorithms (local SGD, DASO, decentralized, async,
DiLoCo) average weights or weight differences rather than gradients; they all
do it through these two helpers. Tensors are coalesced into flat chunks (one
collective per chunk); a wire dtype (bf16, fp16) halves the bytes, and values
are divided by the world size before the sum so fp16 cannot overflow.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .buckets import MB
from .codecs import MinMax8
from .comm import all_gather_objects, chunks, flatten, ring_bytes, staged, start, wait
from .flat import split

#: Default size of one coalesced collective.
CHUNK_BYTES = 25 * MB


class AsyncAverage:
    """The average of ``tensors`` over ``group``, launched at construction.

    The values are copied when it starts (later changes to ``tensors`` do not
    race with the communication); ``wait()`` returns the averages as new
    tensors shaped and typed like the inputs. ``wire_bytes`` is what this
    rank sends (a ring allreduce sends 2 (n-1)/n of each buffer).

    With ``fill``, ``tensors`` only give the shapes, dtypes and devices:
    ``fill(i, out)`` writes the ``i``-th value straight into its place in the
    wire buffer (``out``, shaped like ``tensors[i]``), so that nothing but the
    wire is held while it travels (DiLoCo's pseudo-gradients, made there).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        wire_dtype: Optional[torch.dtype] = None,
        chunk_bytes: int = CHUNK_BYTES,
        fill: Optional[Callable[[int, torch.Tensor], None]] = None,
    ):
        world = dist.get_world_size(group)
        index = {id(t): i for i, t in enumerate(tensors)}
        self._parts = []
        self.wire_bytes = 0
        with torch.no_grad():
            for chunk in chunks(list(tensors), chunk_bytes):
                if fill is None:
                    flat = flatten(chunk)
                else:
                    flat = torch.empty(sum(t.numel() for t in chunk), dtype=chunk[0].dtype, device=chunk[0].device)
                    for t, view in zip(chunk, split(flat, chunk)):
                        fill(index[id(t)], view)
                cast = isinstance(wire_dtype, torch.dtype) and flat.is_floating_point()
                wire = flat.to(wire_dtype) if cast else flat
                del flat  # cast: only the wire copy travels
                wire.div_(world)
                work = start(dist.all_reduce, wire, group=group)
                self._parts.append((chunk, wire, work))
                self.wire_bytes += ring_bytes(wire.numel() * wire.element_size(), world)
        self._order = [id(t) for t in tensors]

    def is_completed(self) -> bool:
        return all(work.is_completed() for _, _, work in self._parts)

    def wait(self) -> list[torch.Tensor]:
        """The averaged values, in the order of the tensors given."""
        by_id = {}
        for chunk, wire, work in self._parts:
            wait(work)
            for t, value in zip(chunk, split(wire, chunk)):
                by_id[id(t)] = value.to(t.dtype)
        return [by_id[i] for i in self._order]


class AsyncQuantizedAverage:
    """The average of ``tensors`` over ``group`` sent as 8-bit min-max codes, launched at construction.

    Each rank quantizes its values (``codecs.MinMax8``) and all-gathers the codes;
    ``wait()`` decodes every rank's and averages them. With ``feedback`` (a flat
    float32 tensor of the same number of values, zeros at first) the error of
    this rank's quantization is carried to the next call (error feedback), so
    nothing is lost over time. ``wire_bytes`` is what this rank sends: its
    codes to each other rank, about a quarter of fp32.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: Optional[dist.ProcessGroup],
        feedback: Optional[torch.Tensor] = None,
        chunk_size: int = 1024,
    ):
        self._tensors, world = list(tensors), dist.get_world_size(group)
        with torch.no_grad():
            flat = flatten(self._tensors).float()
            self._codec = MinMax8(flat.numel(), chunk_size=chunk_size, device=flat.device)
            mine = self._codec.encode_from(flat, self._codec.empty(), feedback)
        self._gathered = [torch.empty_like(mine) for _ in range(world)]
        self._work = start(dist.all_gather, self._gathered, mine, group=group)
        self.wire_bytes = (world - 1) * self._codec.nbytes

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> list[torch.Tensor]:
        """The averaged values, in the order of the tensors given."""
        wait(self._work)
        total = torch.zeros(self._codec.numel, device=self._gathered[0].device)
        part = torch.empty_like(total)
        for packed in self._gathered:
            total.add_(self._codec.decode_into(packed, part))
        total.div_(len(self._gathered))
        return [v.to(t.dtype) for t, v in zip(self._tensors, split(total, self._tensors))]


def average_async(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    wire_dtype: Union[torch.dtype, str, None] = None,
    feedback: Optional[torch.Tensor] = None,
) -> Union["AsyncAverage", "AsyncQuantizedAverage"]:
    """An average in flight: ``AsyncQuantizedAverage`` when ``wire_dtype`` is ``"int8"`` (8-bit
    codes with ``feedback``), else ``AsyncAverage`` in that dtype (None: the tensors' own)."""
    if isinstance(wire_dtype, str):
        if wire_dtype != "int8":
            raise ValueError(f"wire_dtype must be a torch dtype, 'int8' or None, got {wire_dtype!r}")
        return AsyncQuantizedAverage(tensors, group, feedback)
    return AsyncAverage(tensors, group, wire_dtype)


def average_(
    tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], wire_dtype: Optional[torch.dtype] = None
) -> int:
    """Replace ``tensors`` by their average over ``group`` (blocking); returns the bytes sent.

    One staging chunk at a time (``comm.staged``): it costs at most ``comm.STAGING_BYTES`` of
    copies, whatever the tensors' size, and a tensor is written only once its chunk's average
    has arrived whole.
    """
    world, sent = dist.get_world_size(group), 0
    with torch.no_grad():
        for chunk in staged(list(tensors)):
            flat = flatten(chunk)
            wire = flat.to(wire_dtype) if wire_dtype is not None and flat.is_floating_point() else flat
            wire.div_(world)
            wait(start(dist.all_reduce, wire, group=group))
            sent += ring_bytes(wire.numel() * wire.element_size(), world)
            for t, value in zip(chunk, split(wire, chunk)):
                t.copy_(value)
    return sent


def default_reduce(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Average ``tensors`` in place across the group, coalesced (``reduce_function``'s default)."""
    average_(tensors, group)


def average_optimizer_states(
    optimizers: Sequence[torch.optim.Optimizer],
    group: Optional[dist.ProcessGroup],
    view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> int:
    """Average the optimizers' floating-point state tensors (momenta, Adam moments) over ``group``; returns the bytes sent.

    Training on local gradients leaves them different on every rank, so
    after the weights are averaged the replicas would drift apart again under
    gradient averaging. Only entries every rank holds, with the same shape and
    dtype, are averaged (a parameter that never had a gradient on some rank
    has no state there); scalar entries (step counts) are left alone. ``view``
    gives the tensor averaged in place of each entry (FSDP2's: its local shard). A
    collective: every rank calls it.
    """
    entries = []
    for i, opt in enumerate(optimizers):
        for j, param_group in enumerate(opt.param_groups):
            for k, p in enumerate(param_group["params"]):
                for key, value in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                    if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                        value = view(value)
                        entries.append(((i, j, k, str(key), tuple(value.shape), str(value.dtype)), value))
    gathered = all_gather_objects([sig for sig, _ in entries], group)
    common = set(gathered[0]).intersection(*gathered[1:])
    tensors = [value for sig, value in entries if sig in common]
    return average_(tensors, group) if tensors else 0
