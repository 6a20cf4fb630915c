"""The blocked codecs of ``unison.engine.codecs`` against their plain arithmetic, in-process.

``MinMax8.encode_from`` / ``decode_into`` / ``sum_encode`` must give the bytes
and values of ``encode_`` / ``decode_`` on the whole padded buffer, for any
block size (small blocks here, so layouts span many blocks and padding falls
inside, at the edge of and after the last block).
"""

import pytest
import torch

from unison.engine.codecs import MinMax8, decode_, encode_
from unison.engine.codecs import minmax8 as codecs

CASES = [(1000, 3, 64), (10, 3, 4), (4, 3, 1024), (5000, 2, 100), (12345, 2, 1024), (1, 1, 16), (7, 5, 2)]


def reference_encode(codec: MinMax8, x: torch.Tensor, packed: torch.Tensor) -> None:
    """Quantize the whole padded buffer at once (what ``encode_from`` must match)."""
    n = codec.numel
    values = torch.empty(codec.rows, codec.chunks, codec.size)
    values.view(-1)[:n].copy_(x)
    values.view(-1)[n:].fill_(values.view(-1)[n - 1])
    encode_(values, *codec.parts(packed))


def same_message(codec: MinMax8, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two packed messages carry the same mins, scales and codes (not the alignment bytes)."""
    return all(torch.equal(x, y) for x, y in zip(codec.parts(a), codec.parts(b)))


@pytest.fixture(params=[1 << 17, 100, 7], ids=lambda b: f"block{b}")
def block(request, monkeypatch):
    monkeypatch.setattr(codecs, "BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("numel,rows,chunk_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_minmax8_blocked_matches_whole_buffer(block, numel, rows, chunk_size, dtype):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)).to(dtype)
    codec = MinMax8(numel, rows=rows, chunk_size=chunk_size)
    expected, got = codec.empty(), codec.empty()
    reference_encode(codec, x, expected)
    assert same_message(codec, codec.encode_from(x, got), expected)

    mins, scales, codes = codec.parts(expected)
    whole = decode_(codes, mins, scales, torch.empty(rows, codec.chunks, codec.size)).view(-1)[:numel]
    assert torch.equal(codec.decode_into(got, torch.empty(numel, dtype=dtype)), whole.to(dtype))

    residual = (torch.randn(numel, generator=g) * 1e-2).to(dtype)
    ours = residual.clone()
    summed = x + residual
    reference_encode(codec, summed, expected)
    lost = summed.clone().sub_(
        decode_(codes, mins, scales, torch.empty(rows, codec.chunks, codec.size)).view(-1)[:numel]
    )
    assert same_message(codec, codec.encode_from(x, got, feedback=ours), expected)
    assert torch.equal(ours, lost)


@pytest.mark.parametrize("numel,rows,chunk_size", CASES)
def test_sum_encode_quantizes_the_sum_of_the_rows(block, numel, rows, chunk_size):
    g = torch.Generator().manual_seed(numel + 1)
    codec = MinMax8(numel, rows=rows, chunk_size=chunk_size)
    received = codec.encode_from(torch.randn(numel, generator=g), codec.empty())
    mins, scales, codes = codec.parts(received)
    decoded = decode_(codes, mins, scales, torch.empty(rows, codec.chunks, codec.size))
    total = decoded[0].clone()
    for r in range(1, rows):
        total.add_(decoded[r])
    expected = codec.empty(1)
    encode_(total[None], *codec.parts(expected))
    assert same_message(codec, codec.sum_encode(received, codec.empty(1)), expected)


def test_minmax8_makes_no_full_size_buffer():
    codec = MinMax8(1 << 20, rows=2)
    assert codec._values is None and codec._work.numel() <= 2 * codecs.BLOCK
    codec.encode_from(torch.randn(1 << 20), codec.empty())
    assert codec._values is None
