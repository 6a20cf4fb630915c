"""Wire codecs: flat tensors turned into fewer bytes and back, with no communication.

8-bit min-max, the one 8-bit wire format of unison ("bytegrad", "qadam",
"low_precision_decentralized"): values are cut into equal chunks and each chunk
is mapped linearly from its own [min, max] onto the integers 0..255. A chunk
costs one byte per value plus 8 bytes of side data (its float32 min and
scale), and decodes to within half a quantization step (``scale / 2``) of the
input. A constant chunk has scale 0 and decodes exactly. A chunk holding inf
or NaN decodes to NaN, so overflow checks (AMP's grad scaler) still see it.

``encode_`` / ``decode_`` are the arithmetic; ``MinMax8`` is the packed layout
with reusable buffers that the algorithms send; ``quantize_minmax`` /
``dequantize_minmax`` are the same arithmetic as plain allocating functions.
"""

from __future__ import annotations

from typing import Optional

import torch

#: The largest 8-bit code: a chunk's max maps to it, its min to 0.
LEVELS = 255
#: Side data per chunk: a float32 min and a float32 scale.
SIDE_BYTES = 8


def encode_(values: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> None:
    """Quantize ``values`` (float32 ``[..., chunks, size]``, overwritten as scratch) chunk by chunk.

    Writes each chunk's min and step ``(max - min) / 255`` into ``mins`` and
    ``scales`` (float32 ``[..., chunks]``) and the codes ``(x - min) / scale``
    rounded to nearest into ``codes`` (uint8, shaped like ``values``). A
    constant chunk gets code 0 everywhere. ``scratch`` (float32
    ``[2, ..., chunks]``) avoids allocating the per-chunk factors.
    """
    torch.amin(values, dim=-1, out=mins)
    torch.amax(values, dim=-1, out=scales)
    scales.sub_(mins).div_(LEVELS)
    if scratch is None:
        scratch = values.new_empty((2, *mins.shape))
    inverse, shift = scratch[0], scratch[1]
    torch.reciprocal(scales, out=inverse).nan_to_num_(0.0, 0.0, 0.0)  # scale 0 (or non-finite): factor 0
    torch.mul(mins, inverse, out=shift).neg_().add_(0.5)
    # Separate same-dtype in-place steps: mixed-dtype fused ones are several times slower on CPU.
    values.mul_(inverse[..., None]).add_(shift[..., None]).clamp_(0, LEVELS)
    codes.copy_(values)  # truncation of x + 0.5: rounding to nearest


def decode_(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = codes * scale + min`` chunk by chunk (``out`` float32, shaped like ``codes``); returns ``out``."""
    out.copy_(codes)
    return out.mul_(scales[..., None]).add_(mins[..., None])


def layout(numel: int, rows: int, chunk_size: int) -> tuple[int, int, int]:
    """``MinMax8``'s layout: (chunks per row, values per chunk, bytes per packed row)."""
    per_row = -(-numel // rows)
    chunks = max(1, -(-per_row // chunk_size))
    size = max(1, -(-per_row // chunks))
    return chunks, size, -(-(SIDE_BYTES * chunks + chunks * size) // 4) * 4


class MinMax8:
    """The packed 8-bit layout of ``numel`` values cut into ``rows`` rows, with reusable buffers.

    Args:
        numel: values in all (a flat buffer's length).
        rows: equal parts, each packed as its own row (one per rank for an all_to_all).
        chunk_size: at most this many values per chunk.
        device: where the buffers live.

    A packed row is one uint8 tensor: the chunks' float32 mins, their scales,
    then one code per value, padded to a multiple of 4 bytes (so the side data
    is read as float32 without a copy). The values are padded up to
    ``rows * chunks * size`` by repeating the last one, which keeps the last
    chunk's range what the real values give.

    Example::

        codec = MinMax8(x.numel(), chunk_size=1024)
        message = codec.empty()
        codec.encode(codec.load(x), message)
        y = codec.decode(message)[: x.numel()]
    """

    def __init__(self, numel: int, rows: int = 1, chunk_size: int = 1024, device: torch.device = torch.device("cpu")) -> None:
        self.numel, self.rows = numel, rows
        self.chunks, self.size, self.row_bytes = layout(numel, rows, chunk_size)
        self.side = SIDE_BYTES * self.chunks
        self.values = torch.empty(rows, self.chunks, self.size, dtype=torch.float32, device=device)
        self.flat = self.values.view(-1)
        self._scratch = torch.empty(2, rows, self.chunks, dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of one message of all the rows."""
        return self.rows * self.row_bytes

    def empty(self, rows: Optional[int] = None) -> torch.Tensor:
        """A new message buffer of ``rows`` packed rows (default all)."""
        return torch.empty(self.rows if rows is None else rows, self.row_bytes, dtype=torch.uint8, device=self.values.device)

    def load(self, x: torch.Tensor, minus: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copy ``x`` (or ``x - minus``) into the value buffer, padded; returns it (``[rows, chunks, size]``)."""
        n = self.numel
        if minus is not None and x.dtype == minus.dtype == torch.float32:
            torch.sub(x, minus, out=self.flat[:n])
        else:
            self.flat[:n].copy_(x)
            if minus is not None:
                self.flat[:n].sub_(minus)  # in minus's precision, rounded to float32
        self.flat[n:].fill_(self.flat[n - 1])
        return self.values

    def parts(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of packed rows: mins and scales (``[r, chunks]``) and codes (``[r, chunks, size]``)."""
        side = packed[:, : self.side].view(torch.float32).unflatten(-1, (2, self.chunks))
        codes = packed[:, self.side : self.side + self.chunks * self.size].unflatten(-1, (self.chunks, self.size))
        return side[:, 0], side[:, 1], codes

    def encode(self, values: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Quantize ``values`` (``[r, chunks, size]``, overwritten) into ``packed`` (``r`` rows); returns ``packed``."""
        mins, scales, codes = self.parts(packed)
        encode_(values, mins, scales, codes, self._scratch[:, : packed.shape[0]])
        return packed

    def decode(self, packed: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The values ``packed`` carries, into ``out`` (default: the value buffer), ``[r, chunks, size]``."""
        mins, scales, codes = self.parts(packed)
        return decode_(codes, mins, scales, self.values[: packed.shape[0]] if out is None else out)


def quantize_minmax(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, read flat as float32) into exactly ``chunks`` equal chunks.

    ``x`` is padded by repeating its last element up to ``chunks * ceil(numel / chunks)``.
    Returns ``(codes, mins, scales)``: flat uint8 codes of the padded length,
    and float32 mins and scales of length ``chunks``. Element ``i`` of chunk
    ``k`` decodes as ``codes[i] * scales[k] + mins[k]``.
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    flat = x.detach().reshape(-1)
    n = flat.numel()
    size = max(1, -(-n // chunks))
    values = torch.empty(chunks, size, dtype=torch.float32, device=x.device)
    values.view(-1)[:n].copy_(flat)
    values.view(-1)[n:].fill_(values.view(-1)[n - 1] if n else 0)
    mins = torch.empty(chunks, dtype=torch.float32, device=x.device)
    scales = torch.empty_like(mins)
    codes = torch.empty(chunks, size, dtype=torch.uint8, device=x.device)
    encode_(values, mins, scales, codes)
    return codes.reshape(-1), mins, scales


def dequantize_minmax(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode ``quantize_minmax``'s output: its first ``numel`` values, as float32."""
    chunks = mins.numel()
    if scales.numel() != chunks or chunks == 0 or codes.numel() % chunks:
        raise ValueError(f"{codes.numel()} codes cannot be split into the {chunks} chunks given by mins ({mins.numel()}) and scales ({scales.numel()})")
    if numel > codes.numel():
        raise ValueError(f"asked for {numel} values but only {codes.numel()} codes were given")
    rows = codes.reshape(chunks, -1)
    out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    return decode_(rows, mins.float(), scales.float(), out).reshape(-1)[:numel]


def minmax_bytes(numel: int, chunks: int) -> int:
    """Bytes of ``quantize_minmax(x, chunks)`` for ``numel`` values: codes plus side data."""
    return max(1, -(-numel // chunks)) * chunks + SIDE_BYTES * chunks


#: Cast codecs: the dtypes a tensor may travel in, by option value (DASO's ``downcast_type``,
#: DiLoCo's ``wire_dtype``).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(value) -> "torch.dtype | None":
    """The wire dtype named by ``value`` (a name of ``WIRE_DTYPES`` or one of its dtypes), else None."""
    if isinstance(value, torch.dtype):
        return value if value in WIRE_DTYPES.values() else None
    return WIRE_DTYPES.get(value) if isinstance(value, str) else None
