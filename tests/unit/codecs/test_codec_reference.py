"""The reference quantizer of codec_reference agrees with the library's packed MinMax8 codec."""

from __future__ import annotations

import pytest
import torch

from unison.engine.codecs import MinMax8

from .codec_reference import dequantize_minmax, minmax_bytes, quantize_minmax


@pytest.mark.parametrize("numel,chunk_size", [(1001, 100), (37, 5), (4, 16), (300, 300)])
def test_reference_is_one_packed_row_bit_for_bit(numel, chunk_size):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    codec = MinMax8(numel, chunk_size=chunk_size)
    message = codec.empty()
    codec.encode(codec.load(x), message)
    mins, scales, codes = codec.parts(message)
    ref_codes, ref_mins, ref_scales = quantize_minmax(x, codec.chunks)
    assert torch.equal(ref_mins, mins.reshape(-1)) and torch.equal(ref_scales, scales.reshape(-1))
    assert torch.equal(ref_codes, codes.reshape(-1))
    assert torch.equal(
        dequantize_minmax(ref_codes, ref_mins, ref_scales, numel), codec.decode(message).reshape(-1)[:numel]
    )
    # The packed row is the reference's bytes, padded to a multiple of 4.
    assert codec.row_bytes == -(-minmax_bytes(numel, codec.chunks) // 4) * 4
