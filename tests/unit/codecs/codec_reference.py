"""Reference 8-bit min-max quantization as plain allocating functions, for tests only.

Copies of ``quantize_minmax``, ``dequantize_minmax`` and ``minmax_bytes`` from
``unison.engine.codecs`` (the same arithmetic: the library's ``encode_`` and
``decode_`` on one ``[chunks, size]`` array), kept here so the library need not
carry functions only tests use.
"""

from __future__ import annotations

import torch

from unison.engine.codecs import SIDE_BYTES, decode_, encode_


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
        raise ValueError(
            f"{codes.numel()} codes cannot be split into the {chunks} chunks given by mins ({mins.numel()}) and scales ({scales.numel()})"
        )
    if numel > codes.numel():
        raise ValueError(f"asked for {numel} values but only {codes.numel()} codes were given")
    rows = codes.reshape(chunks, -1)
    out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
    return decode_(rows, mins.float(), scales.float(), out).reshape(-1)[:numel]


def minmax_bytes(numel: int, chunks: int) -> int:
    """Bytes of ``quantize_minmax(x, chunks)`` for ``numel`` values: codes plus side data."""
    return max(1, -(-numel // chunks)) * chunks + SIDE_BYTES * chunks
