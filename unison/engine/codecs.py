"""Wire codecs: plain functions turning flat tensors into fewer bytes and back.

Each codec is a pair of functions over flat tensors, with no state and no
communication, so an algorithm can compress a bucket (or part of one), send the
pieces with any collective, and decode them on the other side. Every function
is vectorized: one set of tensor operations whatever the number of chunks.

8-bit min-max (``quantize_minmax`` / ``dequantize_minmax``)
    The input is cut into equal chunks; each chunk is mapped linearly from its
    own [min, max] onto the integers 0..255. A chunk costs one byte per element
    plus 8 bytes of side data (its float32 min and scale), and decodes to
    within half a quantization step (``scale / 2``) of the input. A constant
    chunk has scale 0 and decodes exactly. Non-finite inputs are not
    representable: a chunk holding inf or NaN decodes to NaN, so overflow
    checks (e.g. AMP's grad scaler) still see it.
"""

from __future__ import annotations

import torch

#: The largest 8-bit code: a chunk's max maps to it, its min to 0.
LEVELS = 255


def pad_edge(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` flattened and extended to ``length`` elements by repeating its last one.

    Repeating a real value (rather than zeros) keeps the padded chunk's range,
    and so its quantization step, what the real values alone would give.
    Returns ``x`` itself (flattened) when no padding is needed.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    if length < n:
        raise ValueError(f"cannot pad {n} elements down to {length}")
    if length == n:
        return flat
    out = flat.new_empty(length)
    out[:n] = flat
    out[n:] = flat[-1] if n else 0
    return out


def minmax_params(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's min and quantization step (``(max - min) / 255``), float32."""
    mins = rows.amin(dim=-1)
    return mins, (rows.amax(dim=-1) - mins) / LEVELS


def encode_rows_(rows: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Write the 8-bit codes of ``rows`` (float32, ``[..., size]``) into ``out`` (uint8, same shape).

    ``rows`` is used as scratch and overwritten: ``(x - min) / scale + 0.5``,
    clamped, then truncated by the conversion (rounding to nearest). A
    constant row (scale 0) gets code 0 everywhere. Each step is a separate
    same-dtype in-place operation: mixed-dtype fused ones are several times
    slower on CPU.
    """
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    shift = 0.5 - mins * inverse
    rows.mul_(inverse[..., None]).add_(shift[..., None]).clamp_(0, LEVELS)
    out.copy_(rows)


def decode_rows(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = codes * scale + min`` row by row (``out`` float32, same shape as ``codes``)."""
    out.copy_(codes)
    return out.mul_(scales[..., None]).add_(mins[..., None])


def quantize_minmax(x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to 8 bits per element, with a min and a scale per chunk.

    ``x`` (any shape, read flat, converted to float32) is padded by repeating
    its last element up to ``chunks * ceil(numel / chunks)`` and split into
    ``chunks`` equal chunks. Returns ``(codes, mins, scales)``: ``codes`` is a
    flat uint8 tensor of the padded length, ``mins`` and ``scales`` are
    float32 tensors of length ``chunks``. Element ``i`` of chunk ``k`` decodes
    as ``codes[i] * scales[k] + mins[k]``.
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    flat = x.detach().reshape(-1).float()
    size = max(1, -(-flat.numel() // chunks))
    padded = pad_edge(flat, size * chunks)
    rows = (padded.clone() if padded.data_ptr() == x.data_ptr() else padded).view(chunks, size)
    mins, scales = minmax_params(rows)
    codes = torch.empty(chunks, size, dtype=torch.uint8, device=rows.device)
    encode_rows_(rows, mins, scales, codes)
    return codes.reshape(-1), mins, scales


def dequantize_minmax(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """Decode ``quantize_minmax``'s output: the first ``numel`` values, as float32.

    ``codes`` holds ``len(mins)`` equal chunks; ``mins`` and ``scales`` are
    their side data. Several quantized tensors with the same chunk length can
    be decoded in one call by concatenating their codes, mins and scales.
    """
    chunks = mins.numel()
    if scales.numel() != chunks or chunks == 0 or codes.numel() % chunks:
        raise ValueError(f"{codes.numel()} codes cannot be split into the {chunks} chunks given by mins ({mins.numel()}) and scales ({scales.numel()})")
    if numel > codes.numel():
        raise ValueError(f"asked for {numel} values but only {codes.numel()} codes were given")
    rows = codes.reshape(chunks, -1)
    out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    return decode_rows(rows, mins.float(), scales.float(), out).reshape(-1)[:numel]


def minmax_bytes(numel: int, chunks: int) -> int:
    """Wire size of ``quantize_minmax(x, chunks)`` for ``numel`` elements: codes plus side data."""
    size = max(1, -(-numel // chunks))
    return size * chunks + 8 * chunks


#: Cast codecs: the dtypes a tensor may travel in, by option value (DASO's ``downcast_type``,
#: DiLoCo's ``wire_dtype``).
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(value) -> "torch.dtype | None":
    """The wire dtype named by ``value`` (a name of ``WIRE_DTYPES`` or one of its dtypes), else None."""
    if isinstance(value, torch.dtype):
        return value if value in WIRE_DTYPES.values() else None
    return WIRE_DTYPES.get(value) if isinstance(value, str) else None
