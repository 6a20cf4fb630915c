"""``TopK`` and ``TiledTopK`` in their two schedules (``unison.engine.codecs.schedule``): on the CPU
the whole schedule gives what the blocked one gives, and on ``meta`` it issues the same ops for
4M values as for 64M, at most 64 a call."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

from tests.unit.codecs.ops import ops
from unison.engine.codecs.schedule import BLOCKED, ENV, WHOLE
from unison.engine.codecs.tiled_topk import TiledTopK
from unison.engine.codecs.tiles import TiledBuffer, Tiles
from unison.engine.codecs.topk import TopK

CPU, META = torch.device("cpu"), torch.device("meta")
#: The bins' mean and deviation are segment sums in the whole schedule (``index_add``, one entry
#: after another) and torch's vectorized sums per run in the blocked one: the same to a few ulps
#: of the run's values, so the tables (bin means plus that mean) and what the feedback keeps
#: differ by about as much. The codes and indices are asserted equal: no value of these seeds
#: lies within those ulps of a bin's edge.
BINS_RTOL, BINS_ATOL = 1e-5, 1e-6
# 64 x 64 tiles, 48 x 40 tiles, vectors in chunks of 64 and evened chunks, a 1 x 64 cut, one value
SHAPES = [(256, 192), (96, 80), (640,), (128, 64), (97,), (5,), (3, 3, 3), (97, 64), (1,), (128, 64)]


def pair(make: Callable[[str], object]) -> tuple:
    return make(BLOCKED), make(WHOLE)


# ---- TopK -----------------------------------------------------------------------------------


def topk_input(numel: int, padded: int, seed: int, zero_chunk: Optional[int] = None) -> torch.Tensor:
    x = torch.zeros(padded)
    x[:numel] = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if zero_chunk is not None:
        x[:zero_chunk] = 0.0  # a chunk of zeros: ties everywhere, scale 0
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize(
    "numel,chunk,density,topk",
    [(300_000, 4096, 0.02, None), (300, 64, 0.1, None), (1, 4096, 0.02, None), (200_000, 256, 0.0, 3)],
)
def test_topk_whole_is_blocked_bit_for_bit(numel, chunk, density, topk, bits, scale_dtype, feedback):
    blocked, whole = pair(
        lambda s: TopK(numel, chunk, density or 0.02, topk, bits, scale_dtype=scale_dtype, schedule=s)
    )
    assert (blocked.schedule, whole.schedule) == (BLOCKED, WHOLE)
    a = topk_input(numel, blocked.padded, numel + bits, zero_chunk=blocked.size if blocked.chunks > 1 else None)
    b = a.clone()
    ma, mb = blocked.encode(a, blocked.empty(), feedback), whole.encode(b, whole.empty(), feedback)
    assert torch.equal(ma, mb) and torch.equal(a, b)
    target = torch.randn(blocked.padded, generator=torch.Generator().manual_seed(1))
    ta, tb = blocked.decode_add(ma, target.clone(), -0.3), whole.decode_add(mb, target.clone(), -0.3)
    assert torch.equal(ta, tb)
    ca, cb = blocked.count_add(ma, torch.ones(blocked.padded)), whole.count_add(mb, torch.ones(blocked.padded))
    assert torch.equal(ca, cb)
    assert torch.equal(blocked.decode(ma), whole.decode(mb))


def test_topk_whole_takes_no_scratch_and_a_shared_one_is_left_alone():
    scratch = torch.full((1 << 16,), 7.0)
    codec = TopK(100_000, 4096, 0.02, device=CPU, scratch=scratch, schedule=WHOLE)
    codec.encode(topk_input(100_000, codec.padded, 0), codec.empty())
    assert bool((scratch == 7.0).all())


# ---- TiledTopK ------------------------------------------------------------------------------


def tiled_input(tiles: Tiles, shapes: list, seed: int, zero: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(s, generator=g) for s in shapes]
    if zero:
        xs[0][:64] = 0.0  # whole tiles of zeros (ties, a zero scale, zeros sent)
        xs[3].zero_()  # a whole tensor of zeros: a run of zeros (table of zeros)
    buffer = TiledBuffer(tiles, CPU)
    buffer.load(xs)
    return buffer.flat


def layouts() -> list:
    tiles = Tiles([torch.Size(s) for s in SHAPES], "tiles", 64, 1 / 32)
    bounds = tiles.bounds(3)
    return [
        ("tiles", tiles, tiles.runs),
        ("shard", tiles, tiles.slice(bounds[1], bounds[2])),  # a node's shard: runs cut from a layout
        ("flat", Tiles([torch.Size(s) for s in SHAPES], "flat", 4096, 0.02), None),
        ("topk", Tiles([torch.Size(s) for s in SHAPES], "tiles", 64, topk=3), None),
    ]


LAYOUTS = layouts()


def codecs(runs, bits: int, quantizer: str, scale_dtype: torch.dtype) -> tuple[TiledTopK, TiledTopK]:
    return pair(lambda s: TiledTopK(runs, bits, quantizer, scale_dtype, CPU, schedule=s))  # type: ignore[arg-type]


def check(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=BINS_RTOL, atol=BINS_ATOL)


@pytest.mark.parametrize("name", [n for n, _, _ in LAYOUTS])
@pytest.mark.parametrize("quantizer,bits", [("bins", 2), ("bins", 4), ("bins", 8), ("max", 2), ("max", 8), ("max", 32)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("zero", [False, True])
def test_tiled_whole_encodes_what_blocked_encodes(name, quantizer, bits, scale_dtype, feedback, zero):
    """Bit for bit but for the bins' tables (``BINS_RTOL``): the same indices, codes and scales."""
    _, tiles, runs = next(layout for layout in LAYOUTS if layout[0] == name)
    runs = tiles.runs if runs is None else runs
    blocked, whole = codecs(runs, bits, quantizer, scale_dtype)
    a = tiled_input(tiles, SHAPES, bits, zero)[: blocked.numel].clone()
    b = a.clone()
    ma, mb = blocked.encode(a, blocked.empty(), feedback), whole.encode(b, whole.empty(), feedback)
    exact = quantizer == "max" or bits == 32
    heads = slice(0, blocked._heads.stop)
    assert torch.equal(ma[heads.stop :], mb[heads.stop :])  # indices and codes
    check(blocked.heads(ma).float(), whole.heads(mb).float(), exact)
    check(a, b, exact)
    wa, va = blocked.decode(ma)
    wb, vb = whole.decode(mb)
    assert torch.equal(wa, wb)
    check(va, vb, exact)


@pytest.mark.parametrize("name", [n for n, _, _ in LAYOUTS])
@pytest.mark.parametrize("quantizer,bits", [("bins", 2), ("bins", 4), ("max", 4), ("max", 32)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("senders", [True, False])
def test_tiled_whole_decodes_and_means_blocked_messages_bit_for_bit(name, quantizer, bits, scale_dtype, ranks, senders):
    """Decoding is the same arithmetic in both schedules: the same messages give the same bits,
    the mean over senders (zeros sent not counted) and the plain mean, with ``alpha != 1``."""
    _, tiles, runs = next(layout for layout in LAYOUTS if layout[0] == name)
    runs = tiles.runs if runs is None else runs
    blocked, whole = codecs(runs, bits, quantizer, scale_dtype)
    messages = blocked.empty(ranks)
    for r in range(ranks):
        blocked.encode(tiled_input(tiles, SHAPES, 10 + r, zero=r == 1)[: blocked.numel].clone(), messages[r])
    for m in messages:
        wa, va = blocked.decode(m)
        wb, vb = whole.decode(m)
        assert torch.equal(wa, wb) and torch.equal(va, vb)
    start = torch.randn(blocked.numel, generator=torch.Generator().manual_seed(2))
    ta = blocked.mean_into(messages, start.clone(), -0.7, senders)
    tb = whole.mean_into(messages, start.clone(), -0.7, senders)
    assert torch.equal(ta, tb)


@pytest.mark.parametrize("quantizer,bits", [("bins", 2), ("max", 8), ("max", 32)])
@pytest.mark.parametrize("senders", [True, False])
def test_tiled_whole_round_trip_is_blocked_round_trip(quantizer, bits, senders):
    """Each schedule's own messages, three ranks: the means agree (to ``BINS_RTOL`` with bins)."""
    tiles = LAYOUTS[0][1]
    blocked, whole = codecs(tiles.runs, bits, quantizer, torch.float32)
    out = []
    for codec in (blocked, whole):
        messages = codec.empty(3)
        for r in range(3):
            codec.encode(tiled_input(tiles, SHAPES, 20 + r, zero=False).clone(), messages[r])
        out.append(codec.mean_into(messages, torch.ones(tiles.numel), 0.5, senders))
    check(out[0], out[1], quantizer == "max")


# ---- op counts on meta ----------------------------------------------------------------------


def model_shapes(side: int) -> list[tuple[int, ...]]:
    """A few matrices and vectors of a transformer-like block, ``side`` its width (a multiple of 64)."""
    return [(side, side), (side,), (4 * side, side), (side, 4 * side), (side,), (side, side), (3 * side, side)]


#: ~4M and ~64M values: the same shapes, each side 4 times longer.
SIDES = (576, 2304)


def topk_counts(schedule: Optional[str], side: int) -> dict[str, int]:
    numel = sum(torch.Size(s).numel() for s in model_shapes(side))
    codec = TopK(numel, 4096, 0.02, bits=2, device=META, schedule=schedule)
    values, target = torch.empty(codec.padded, device=META), torch.empty(codec.padded, device=META)
    message = codec.encode(values, codec.empty())
    return {
        "encode": ops(lambda: codec.encode(values, message)),
        "decode_add": ops(lambda: codec.decode_add(message, target, 0.5)),
        "count_add": ops(lambda: codec.count_add(message, target)),
        "decode": ops(lambda: codec.decode(message)),
    }


def tiled_counts(schedule: Optional[str], side: int, cut: str, quantizer: str, bits: int) -> dict[str, int]:
    tiles = Tiles([torch.Size(s) for s in model_shapes(side)], cut, 64 if cut == "tiles" else 4096, 1 / 64)  # type: ignore[arg-type]
    codec = TiledTopK(tiles.runs, bits, quantizer, device=META, schedule=schedule)  # type: ignore[arg-type]
    values, target = torch.empty(tiles.numel, device=META), torch.empty(tiles.numel, device=META)
    message, messages = codec.empty(), codec.empty(4)
    return {
        "encode": ops(lambda: codec.encode(values, message)),
        "decode": ops(lambda: codec.decode(message)),
        "mean_into senders": ops(lambda: codec.mean_into(messages, target, 0.5, True)),
        "mean_into plain": ops(lambda: codec.mean_into(messages, target, 0.5, False)),
    }


def test_the_shapes_hold_4m_and_64m_values():
    sizes = [sum(torch.Size(s).numel() for s in model_shapes(side)) for side in SIDES]
    assert 4e6 < sizes[0] < 4.5e6 and 64e6 < sizes[1] < 72e6


def test_on_meta_the_codecs_take_the_whole_schedule(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert TopK(10, device=META).schedule == WHOLE and TopK(10).schedule == BLOCKED
    runs = Tiles([torch.Size((64, 64))]).runs
    assert TiledTopK(runs, device=META).schedule == WHOLE and TiledTopK(runs).schedule == BLOCKED


def test_topk_whole_ops_do_not_grow_with_the_values():
    small, large = (topk_counts(WHOLE, side) for side in SIDES)
    assert small == large and max(small.values()) <= 64, small


@pytest.mark.parametrize("cut", ["tiles", "flat"])
@pytest.mark.parametrize("quantizer,bits", [("bins", 2), ("bins", 4), ("max", 2), ("max", 8), ("bins", 32)])
def test_tiled_whole_ops_do_not_grow_with_the_values(cut, quantizer, bits):
    small, large = (tiled_counts(WHOLE, side, cut, quantizer, bits) for side in SIDES)
    assert small == large and max(small.values()) <= 64, small


def test_the_blocked_schedule_forced_on_meta_grows():
    """What the two tests above would see of the blocked loops: the counts grow with the values."""
    small, large = (topk_counts(BLOCKED, side) for side in SIDES)
    assert large["encode"] > 10 * small["encode"] > 640
    small, large = (tiled_counts(BLOCKED, side, "tiles", "bins", 2) for side in SIDES)
    assert large["encode"] > 8 * small["encode"] > 640
    assert large["mean_into senders"] > 8 * small["mean_into senders"]
