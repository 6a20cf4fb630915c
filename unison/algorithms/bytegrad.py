"""Gradient averaging in 8 bits: about a quarter of allreduce's bytes on the wire.

Each bucket is cut into one part per rank. Every rank quantizes all its parts
(8-bit min-max per chunk, ``unison.compress``) and sends part r to rank r with
one all_to_all; rank r decodes what it received, sums it (gradients are
already scaled by 1/world, so the sum is the average), quantizes that average
again and all_gathers it. Every rank then decodes the same gathered bytes, its
own part included, so every replica ends with bit-identical gradients.

Codes and their per-chunk side data (float32 min and scale) travel packed in
one uint8 buffer per exchange: two collectives per bucket, run on a CommThread
over a private process group so they overlap the rest of backward.

With ``error_feedback`` each rank keeps what its own first quantization lost
(the residual, per parameter, saved in the checkpoint) and adds it to the next
step's gradient before quantizing, so that error is not lost but delayed.

In a world of one nothing is sent and nothing is quantized: the gradient is
left exactly as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..compress import decode_rows, encode_rows_, minmax_params
from .base import Algorithm
from .state import FlatState

# torch 2.13 renamed all_gather_into_tensor (the old name warns); older torch has only that one.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Bytes of side data per chunk: a float32 min and a float32 scale.
SIDE_BYTES = 8


class Exchange:
    """The 8-bit average of one flat buffer of ``numel`` elements over ``world`` ranks.

    The buffer is cut into ``world`` parts of ``chunks`` equal chunks (padded
    to ``world * part`` elements, so a chunk never straddles two parts). On
    the wire each part is one row: its uint8 codes, then its chunks' float32
    mins and scales as bytes. The work buffers are allocated once and reused
    every step: fresh full-size buffers cost more than the arithmetic.
    """

    def __init__(self, numel: int, world: int, chunk_size: int, device: torch.device):
        self.numel, self.world = numel, world
        per_rank = -(-numel // world)
        self.chunks = -(-per_rank // chunk_size)
        self.size = -(-per_rank // self.chunks)
        self.part = self.chunks * self.size
        self.total = self.part * world
        self.packed = self.part + SIDE_BYTES * self.chunks
        self.work = torch.empty(self.total, dtype=torch.float32, device=device)
        self.send = torch.empty(world, self.packed, dtype=torch.uint8, device=device)
        self.recv = torch.empty_like(self.send)
        self.mine = torch.empty(self.packed, dtype=torch.uint8, device=device)
        self.acc = torch.empty(self.chunks, self.size, dtype=torch.float32, device=device)

    def _codes(self, rows: torch.Tensor) -> torch.Tensor:
        """The code area of packed rows, shaped ``[..., chunks, size]``."""
        return rows[..., : self.part].unflatten(-1, (self.chunks, self.size))

    def _side(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mins and scales stored in packed rows, as ``[..., chunks]`` float32."""
        side = rows[..., self.part :].contiguous().view(torch.float32).unflatten(-1, (2, self.chunks))
        return side[..., 0, :], side[..., 1, :]

    def _encode(self, rows: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize ``rows`` (``[..., chunks, size]``, overwritten) into ``packed`` rows."""
        mins, scales = minmax_params(rows)
        packed[..., self.part :].copy_(torch.stack([mins, scales], dim=-2).flatten(-2).contiguous().view(torch.uint8))
        encode_rows_(rows, mins, scales, self._codes(packed))
        return mins, scales

    def run(self, flat: torch.Tensor, group, residual=None) -> torch.Tensor:
        """Sum ``flat`` across ``group`` in 8 bits, in place (blocking; run it on a CommThread).

        ``flat`` holds this rank's share (already divided by the world size, so
        the sum is the average). With ``residual``, it is added first and
        replaced by what this rank's quantization lost. Every rank ends with
        the same values: all decode the same gathered bytes.
        """
        n = self.numel
        local = self.work[:n]
        if residual is not None:
            torch.add(flat, residual, out=local)
            residual.copy_(local)
        else:
            local.copy_(flat)
        self.work[n:] = self.work[n - 1]
        rows = self.work.view(self.world, self.chunks, self.size)
        mins, scales = self._encode(rows, self.send)
        if residual is not None:
            residual.sub_(decode_rows(self._codes(self.send), mins, scales, rows).reshape(-1)[:n])
        dist.all_to_all_single(self.recv.view(-1), self.send.view(-1), group=group)
        received_mins, received_scales = self._side(self.recv)
        torch.sum(decode_rows(self._codes(self.recv), received_mins, received_scales, rows), dim=0, out=self.acc)
        self._encode(self.acc, self.mine)
        _all_gather(self.recv.view(-1), self.mine, group=group)
        gathered_mins, gathered_scales = self._side(self.recv)
        decode_rows(self._codes(self.recv), gathered_mins, gathered_scales, rows)
        flat.copy_(self.work[:n])
        return flat


def bucket_exchange(cache: dict, bucket, world: int, chunk_size: int) -> Exchange:
    """The reusable Exchange of ``bucket`` kept in ``cache`` (rebuilt if the bucket changed size)."""
    ex = cache.get(bucket.index)
    if ex is None or ex.numel != bucket.flat.numel() or ex.world != world:
        ex = cache[bucket.index] = Exchange(bucket.flat.numel(), world, chunk_size, bucket.flat.device)
    return ex


def wire_bytes_8bit(numel: int, world: int, chunk_size: int) -> int:
    """Bytes an Exchange sends from one rank: world-1 packed parts in each of its two collectives."""
    if world == 1 or numel == 0:
        return 0
    per_rank = -(-numel // world)
    chunks = -(-per_rank // chunk_size)
    return 2 * (world - 1) * (chunks * -(-per_rank // chunks) + SIDE_BYTES * chunks)


class ByteGrad(Algorithm):
    """8-bit compressed averaging: all_to_all of quantized parts, sum, all_gather of quantized sums.

    Options:
        error_feedback: keep each rank's local quantization error and add it
            to the next step's gradient (saved in the state dict).
        chunk_size: elements per quantization chunk (each has its own min and
            max). Smaller chunks follow the gradient's local range more closely
            and cost 8 bytes of side data each; the default 1024 costs under 1%
            over the 1 byte per element of the codes.
    """

    name = "bytegrad"
    defaults = {"error_feedback": False, "chunk_size": 1024}

    def __init__(self, **options: Any) -> None:
        """Validate the options; the residuals exist only with error feedback."""
        super().__init__(**options)
        self.residuals = FlatState() if self.options["error_feedback"] else None
        self.group = None
        self.thread = None
        self._exchanges: dict[int, Exchange] = {}

    def validate(self) -> None:
        """error_feedback is a bool; chunk_size a positive int."""
        ef, chunk = self.options["error_feedback"], self.options["chunk_size"]
        if not isinstance(ef, bool):
            raise ValueError(f"error_feedback must be True or False, got {ef!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size must be a positive integer (elements per quantization chunk), got {chunk!r}")

    def setup(self, model) -> None:
        """With more than one rank: a private group and a CommThread for the two exchanges."""
        if model.process_group is not None and model.world_size > 1:
            self.open_thread(model)


    def reduce_bucket(self, bucket, group):
        """Submit the bucket's exchanges to the CommThread; nothing to do alone or for an empty bucket."""
        world = dist.get_world_size(group)
        if world == 1 or bucket.flat.numel() == 0:
            return None
        if not bucket.flat.is_floating_point():
            raise TypeError(f"bytegrad reduces floating-point gradients; bucket {bucket.index} holds {bucket.flat.dtype}")
        residual = self.residuals.get(bucket) if self.residuals is not None else None
        return self.thread.submit(bucket_exchange(self._exchanges, bucket, world, self.options["chunk_size"]).run, bucket.flat, self.group, residual)

    def bucket_wire_bytes(self, bucket, world_size: int) -> int:
        """Packed parts sent to the other ranks: world-1 in the all_to_all, world-1 in the all_gather."""
        return wire_bytes_8bit(bucket.flat.numel(), world_size, self.options["chunk_size"])

    def state_dict(self) -> dict[str, Any]:
        """The error-feedback residuals by parameter name (nothing without error feedback)."""
        return {} if self.residuals is None else {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by ``state_dict``; refused without error feedback."""
        unknown = sorted(set(state) - {"residuals"})
        if unknown:
            raise ValueError(f"bytegrad state has unknown entries {unknown}; expected 'residuals'")
        if "residuals" not in state:
            return
        if self.residuals is None:
            raise ValueError("this state holds error-feedback residuals but bytegrad runs with error_feedback=False; create it with error_feedback=True")
        self.residuals.load_state_dict(state["residuals"])
