"""SparseLoCo's layout and codec as its references run them (``unison.engine.codecs.tiles``,
``unison.engine.codecs.tiled_topk``): each tensor's tiles, the top-k per tile, the binned 2-bit values,
12-bit indices, the mean over senders; each against a plain reference (tests/unit/codecs/topk_reference.py)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.codecs.topk_reference import quantized_topk, tile_positions, tiled_message
from unison.engine.codecs.tiled_topk import TiledTopK, index_bytes, pack_indices, unpack_indices
from unison.engine.codecs.tiles import TiledBuffer, Tiles
from unison.engine.codecs.topk import TopK

CPU = torch.device("cpu")
# a matrix in 64 x 64 tiles, one in 48 x 64 (96 rows), a vector of 64, one of a prime length (chunks
# evened, padded), a tiny one, a 3-D tensor too small for tiles (a vector), one cut 1 x 64 (97 rows)
SHAPES = [(128, 192), (96, 64), (64,), (97,), (5,), (3, 3, 3), (97, 64)]


def tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def layout(density: float = 1 / 32, side: int = 64) -> Tiles:
    return Tiles([torch.Size(s) for s in SHAPES], "tiles", side, density)


def test_each_chunk_holds_the_positions_the_reference_cuts():
    tiles = layout()
    xs = [torch.arange(1, t.numel() + 1, dtype=torch.float32).view(t.shape) for t in tensors(0)]
    buffer = TiledBuffer(tiles, CPU)
    buffer.load(xs)
    for x, run in zip(xs, tiles.runs):
        chunks = buffer.flat[run.offset : run.offset + run.numel].view(run.chunks, run.size)
        expected = [torch.where(p >= 0, x.reshape(-1)[p.clamp(min=0)], 0.0) for p in tile_positions(x.shape, 64)]
        assert torch.equal(chunks, torch.stack(expected)), x.shape
    back = tiles.unpad(buffer.flat, [x.shape for x in xs])
    assert all(torch.equal(a, b) for a, b in zip(back, xs))
    assert [(r.chunks, r.size) for r in tiles.runs] == [
        (6, 4096),
        (2, 3072),
        (1, 64),
        (2, 49),
        (1, 5),
        (1, 27),
        (97, 64),
    ]
    assert tiles.pad is not None and tiles.pad.tolist() == [tiles.runs[3].offset + 97]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("density", [1 / 64, 1 / 32, 0.2])
def test_round_trip_is_the_references_binned_top_k_per_tile(bits, density):
    tiles, xs = layout(density), tensors(bits)
    codec = TiledTopK(tiles.runs, bits)
    e = TiledBuffer(tiles, CPU)
    e.load(xs)
    message = codec.encode(e.flat, codec.empty())
    tiles.zero_pad(e.flat)
    decoded = torch.zeros(tiles.numel)
    codec.mean_into(message[None], decoded)
    got = tiles.unpad(decoded, [x.shape for x in xs])
    kept = tiles.unpad(e.flat, [x.shape for x in xs])
    for x, g, rest in zip(xs, got, kept):
        torch.testing.assert_close(g, tiled_message(x, 64, density, bits), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rest + g, x, rtol=0, atol=1e-6)  # the feedback keeps exactly what was not sent
    assert message.numel() == codec.nbytes and codec.nbytes % 4 == 0


def test_the_bins_send_what_was_chosen_in_sum():
    """Each code decodes to the mean of its bin: per tensor the values sent sum to those chosen,
    and an outlier, alone in its bin, is sent as it is."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 100.0
    tiles = Tiles([x.shape], "tiles", 64, 1 / 16)
    e = TiledBuffer(tiles, CPU)
    e.load([x])
    codec = TiledTopK(tiles.runs, 2)
    where, _ = codec.decode(codec.encode(e.flat, codec.empty()))
    chosen = TiledBuffer(tiles, CPU).load([x])[where]  # one run of one chunk: its places are the buffer's
    sent = torch.zeros(tiles.numel)
    codec.mean_into(codec.encode(TiledBuffer(tiles, CPU).load([x]), codec.empty())[None], sent)
    torch.testing.assert_close(sent.sum(), chosen.sum(), rtol=1e-5, atol=1e-4)
    assert sent[0].item() == pytest.approx(100.0, rel=1e-6)


@pytest.mark.parametrize("count", [1, 2, 7, 1000])
def test_twelve_bit_indices_pack_two_to_three_bytes_exactly(count):
    where = torch.randint(0, 4096, (count + count % 2,), generator=torch.Generator().manual_seed(count))
    if count % 2:
        where[-1] = 0
    out = torch.empty(index_bytes(where.numel(), 12), dtype=torch.uint8)
    pack_indices(where, 12, out)
    assert out.numel() == 3 * where.numel() // 2
    assert torch.equal(unpack_indices(out, 12, torch.empty_like(where)), where)
    edge = torch.tensor([0, 4095, 4095, 0, 2048, 15])
    packed = torch.empty(9, dtype=torch.uint8)
    pack_indices(edge, 12, packed)
    assert torch.equal(unpack_indices(packed, 12, torch.empty_like(edge)), edge)


@pytest.mark.parametrize("senders", [True, False])
def test_the_mean_is_over_the_senders_of_each_coordinate(senders):
    """Three ranks' messages: each coordinate's mean over the ranks that sent it (the references'
    ``scatter_reduce(mean, include_self=False)``), or the sum over all three."""
    tiles = layout(1 / 8)
    codec = TiledTopK(tiles.runs, 2)
    messages, dense = codec.empty(3), []
    for r in range(3):
        e = TiledBuffer(tiles, CPU)
        e.load(tensors(10 + r))
        codec.encode(e.flat, messages[r])
        one = torch.zeros(tiles.numel)
        codec.mean_into(messages[r][None], one)
        dense.append(one)
    stacked = torch.stack(dense)
    sent = (stacked != 0).sum(0)
    expected = stacked.sum(0) / (sent.clamp(min=1) if senders else 3)
    out = torch.full((tiles.numel,), 2.0)
    codec.mean_into(messages, out, alpha=-0.5, senders=senders)
    torch.testing.assert_close(out, 2.0 - 0.5 * expected, rtol=1e-6, atol=1e-6)
    assert (sent == 1).any() and (sent > 1).any()  # some coordinates one rank sent, some several


def test_the_first_form_is_the_flat_max_codec_bit_for_bit():
    """``layout="flat"``, ``quantizer="max"``: the same decoded values as ``engine.codecs.topk.TopK``."""
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    tiles = Tiles([x.shape], "flat", 4096, 0.02)
    codec = TiledTopK(tiles.runs, 2, "max")
    old = TopK(x.numel(), 4096, 0.02, bits=2)
    e, e_old = torch.zeros(tiles.numel), torch.zeros(old.padded)
    e[: x.numel()], e_old[: x.numel()] = x, x
    out = torch.zeros(tiles.numel)
    codec.mean_into(codec.encode(e, codec.empty())[None], out, senders=False)
    assert torch.equal(out[: x.numel()], old.decode(old.encode(e_old, old.empty())))
    assert torch.equal(e, e_old)
    torch.testing.assert_close(out[: x.numel()], quantized_topk(x, 4096, old.k, 2), rtol=1e-6, atol=1e-6)


def test_shards_fall_on_chunk_boundaries_and_a_cut_inside_a_chunk_is_refused():
    tiles = layout()
    bounds = tiles.bounds(3)
    assert bounds[0] == 0 and bounds[-1] == tiles.numel and bounds == sorted(bounds)
    runs = [tiles.slice(a, b) for a, b in zip(bounds, bounds[1:])]
    assert sum(r.numel for part in runs for r in part) == tiles.numel
    assert sum(r.count for part in runs for r in part) == tiles.count
    with pytest.raises(ValueError, match="does not fall on chunk boundaries"):
        tiles.slice(1, tiles.numel)


def test_a_bfloat16_table_is_what_every_rank_decodes_and_the_feedback_keeps():
    xs = tensors(5)
    tiles = layout()
    codec = TiledTopK(tiles.runs, 2, scale_dtype=torch.bfloat16)
    full = TiledTopK(tiles.runs, 2)
    e = TiledBuffer(tiles, CPU)
    e.load(xs)
    start = e.flat.clone()
    message = codec.encode(e.flat, codec.empty())
    tiles.zero_pad(e.flat)
    out = torch.zeros(tiles.numel)
    codec.mean_into(message[None], out)
    torch.testing.assert_close(e.flat + out, start, rtol=0, atol=1e-6)
    assert codec.heads(message).dtype == torch.bfloat16
    assert codec.nbytes < full.nbytes


def test_float32_values_travel_exact_with_no_table_or_scale():
    """``bits=32`` (demo's tiles, as its paper sends): each chunk's top-k as float32, exactly; the
    message is the 12-bit indices (tiles of 4096 values) and 4 bytes a value, nothing else."""
    xs = tensors(7)
    tiles = layout()
    codec = TiledTopK(tiles.runs, 32)
    e = TiledBuffer(tiles, CPU)
    e.load(xs)
    start = e.flat.clone()
    message = codec.encode(e.flat, codec.empty())
    out = torch.zeros(tiles.numel)
    codec.mean_into(message[None], out)
    assert torch.equal(e.flat + out, start)  # what was sent left the buffer, exactly
    assert torch.equal(out[out != 0], start[out != 0])  # and arrives as it was
    assert int((out != 0).sum()) == tiles.count
    width = max(r.size for r in tiles.runs)
    indices = index_bytes(tiles.count + tiles.count % 2, 12 if width > 256 else 8)
    assert codec.nbytes == -(-indices // 4) * 4 + 4 * tiles.count


@pytest.mark.parametrize("schedule", ["blocked", "whole"])
def test_median_clip_keeps_one_replica_sent_100_times_larger_to_the_median_one(schedule):
    """Templar's defence (``clip``): four replicas, the last one's tensors 100x. With the clip each
    message's share of a tensor weighs at most that tensor's median norm m, so the attacked mean
    stays within (3 |m_a - m_c| + m_a + m_c) / 4 of the clean one (m_a, m_c: the medians of the two
    sets; the honest shares move by at most |m_a - m_c| each); without it the large one dominates."""
    tiles = layout(1 / 16)
    codec = TiledTopK(tiles.runs, 2, schedule=schedule)
    shapes = [torch.Size(s) for s in SHAPES]

    def messages(scale_last: float) -> torch.Tensor:
        out = []
        for rank in range(4):
            e = TiledBuffer(tiles, CPU)
            e.load([x * (scale_last if rank == 3 else 1.0) for x in tensors(10 + rank)])
            out.append(codec.encode(e.flat, codec.empty()).clone())
        return torch.stack(out)

    def mean(msgs: torch.Tensor, clip: bool) -> list[torch.Tensor]:
        return tiles.unpad(codec.mean_into(msgs, torch.zeros(tiles.numel), senders=False, clip=clip), shapes)

    def medians(msgs: torch.Tensor) -> list[float]:
        """Each tensor's median norm over the messages as decoded (the lower middle one)."""
        each = [tiles.unpad(codec.mean_into(m[None], torch.zeros(tiles.numel), senders=False), shapes) for m in msgs]
        return [sorted(float(d[t].norm()) for d in each)[1] for t in range(len(shapes))]

    clean, attacked = messages(1.0), messages(100.0)
    for t, (a, c, m_a, m_c) in enumerate(
        zip(mean(attacked, True), mean(clean, True), medians(attacked), medians(clean))
    ):
        assert float((a - c).norm()) <= (3 * abs(m_a - m_c) + m_a + m_c) / 4 * (1 + 1e-5), SHAPES[t]
    for t, (a, c, m_c) in enumerate(zip(mean(attacked, False), mean(clean, False), medians(clean))):
        assert float((a - c).norm()) > 10 * m_c, SHAPES[t]  # unclipped: 99 / 4 of the large replica's share


def test_median_clip_is_the_same_under_both_schedules():
    tiles = layout(1 / 16)
    blocked, whole = TiledTopK(tiles.runs, 2, schedule="blocked"), TiledTopK(tiles.runs, 2, schedule="whole")
    msgs = []
    for rank in range(3):
        e = TiledBuffer(tiles, CPU)
        e.load([x * (1 + 3 * rank) for x in tensors(20 + rank)])
        msgs.append(blocked.encode(e.flat, blocked.empty()).clone())
    messages = torch.stack(msgs)
    for senders in (True, False):
        a = blocked.mean_into(messages, torch.zeros(tiles.numel), senders=senders, clip=True)
        b = whole.mean_into(messages, torch.zeros(tiles.numel), senders=senders, clip=True)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, blocked.mean_into(messages, torch.zeros(tiles.numel), senders=senders))
