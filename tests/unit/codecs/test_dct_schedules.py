"""DeMo's codec in its two schedules (``unison.engine.codecs.dct``, ``engine.codecs.schedule``): the
same values on the CPU (bit for bit where the arithmetic is the same, else to a stated tolerance),
and on ``meta`` the whole schedule's ops the same for 4M values as for 64M, at most 64 a method,
where the blocked schedule's grow with the values."""

from __future__ import annotations

import inspect

import pytest
import torch

import unison
from unison.algorithms.gradient.demo import DemoState, Entry, spans
from unison.engine.buckets import Bucket
from unison.engine.codecs.dct import FullTopK, codec, dct_matrix, transform_, transform_tiles_
from unison.engine.codecs.schedule import ENV
from unison.engine.codecs.topk import BLOCK, TopK

from .ops import ops

SCHEDULES = ("blocked", "whole")
#: A DCT coefficient is a float32 sum of ``chunk`` products: the whole schedule's one product of all
#: rows and the blocked schedule's products of a block of rows may take the sums in another order
#: (BLAS picks its kernel by the rows it is given), a few units in the last place of values of
#: order 1 (7e-7 seen); held to 1e-5.
ATOL = 1e-5
#: Values of 4M and 64M float32: a buffer of each, its op count the same in the whole schedule.
SIZES = (1 << 22, 1 << 26)
MOST = 64
META = torch.device("meta")


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def both(fn):
    """``fn(schedule)`` for the blocked schedule and the whole one."""
    return [fn(s) for s in SCHEDULES]


def test_transform_rows_agree_to_the_reduction_order():
    x, d = gaussian(1000, 64), dct_matrix(64)
    blocked, whole = both(lambda s: transform_(x.clone(), d, torch.empty(64 * 7), schedule=s))  # blocks of 7 rows
    torch.testing.assert_close(whole, blocked, rtol=0, atol=ATOL)
    torch.testing.assert_close(whole, x @ d, rtol=0, atol=ATOL)


def test_transform_tiles_agree_bit_for_bit():
    """Both schedules run the same products of each tile (the right one on rows, the left one batched)."""
    x, dh, dw = gaussian(37, 16, 8), dct_matrix(16), dct_matrix(8)
    for left, right in ((dh, dw.T.contiguous()), (dh.T.contiguous(), dw)):
        blocked, whole = (transform_tiles_(x.clone(), left, right, torch.empty(3 * 128), schedule=s) for s in SCHEDULES)
        assert torch.equal(whole, blocked)
        torch.testing.assert_close(whole, left @ x @ right, rtol=0, atol=ATOL)


@pytest.mark.parametrize("feedback", [True, False])
def test_full_topk_agrees_bit_for_bit(feedback):
    """The same coefficients give the same message and the same values kept: the per-chunk top-k,
    gather and scatter are the same arithmetic over a block of chunks or over all of them."""
    x = gaussian(2500 * 64)  # blocks of 1024 chunks and a part
    x[:64] = 0.0  # chunks of ties
    x[64:128] = 1.0
    codecs = [FullTopK(x.numel(), 64, 4, schedule=s) for s in SCHEDULES]
    kept = [x.clone() for _ in codecs]
    messages = [c.encode(k, c.empty(), feedback=feedback) for c, k in zip(codecs, kept)]
    assert [c.schedule for c in codecs] == list(SCHEDULES)
    assert torch.equal(messages[0], messages[1]) and torch.equal(kept[0], kept[1])
    for alpha in (1.0, 0.25):
        sums = [c.decode_add(messages[0], torch.ones_like(x), alpha) for c in codecs]
        assert torch.equal(sums[0], sums[1])
    counts = [c.count_add(messages[0], torch.zeros_like(x)) for c in codecs]
    assert torch.equal(counts[0], counts[1])


@pytest.mark.parametrize("alpha, senders", [(1.0, True), (0.25, False)])
def test_adding_all_messages_at_once_is_adding_each(alpha, senders):
    """``FullTopK.add_all`` (DeMo's decode of every rank's message) adds what ``decode_add`` and
    ``count_add`` add message by message, in the same order: bit for bit."""
    c = FullTopK(50 * 64, 64, 3)
    messages = c.empty(4)
    for r in range(4):
        x = gaussian(c.numel, seed=r)
        x[: 64 * r] = 0.0  # chunks of zeros send zeros
        c.encode(x, messages[r])
    target, counts = gaussian(c.numel, seed=9), torch.zeros(c.numel)
    expected, expected_counts = target.clone(), counts.clone()
    for message in messages:
        c.decode_add(message, expected, alpha)
        c.count_add(message, expected_counts)
    c.add_all(messages, target, alpha, counts if senders else None)
    assert torch.equal(target, expected)
    if senders:
        assert torch.equal(counts, expected_counts)


def demo_step(m: torch.Tensor, chunk: int, topk: int, bits, schedule: str):
    """DeMo's encode as demo.py runs it (DCT, top-k with feedback, inverse DCT) and the decoded
    direction, every part in ``schedule``: (message, momentum kept, direction)."""
    d = dct_matrix(chunk)
    scratch = torch.empty(max(BLOCK, chunk))  # blocks of 1024 chunks
    c = codec(m.numel(), chunk, topk, bits, m.device, scratch)
    rows = m.view(-1, chunk)
    transform_(rows, d.T.contiguous(), scratch)
    message = c.encode(m, c.empty())
    transform_(rows, d, scratch)
    sent = c.decode_add(message, torch.zeros_like(m))
    transform_(sent.view(-1, chunk), d, scratch)
    return message, m, sent, c


def separated(chunks: int, chunk: int, topk: int) -> torch.Tensor:
    """Momentum whose DCT has, in each chunk, ``topk`` coefficients of magnitudes 5, 6, 7, 8 (random
    places and signs) over the rest in (-4, 4): no near-tie for a reduction order's rounding to
    swap, and none of their codes near a rounding boundary of the 2/4/8-bit grids."""
    g = torch.Generator().manual_seed(3)
    c = torch.rand(chunks, chunk, generator=g).mul_(8).sub_(4)
    places = torch.rand(chunks, chunk, generator=g).argsort(1)[:, :topk]
    signs = torch.randint(0, 2, (chunks, topk), generator=g).mul_(2).sub_(1)
    c.scatter_(1, places, signs * torch.arange(8 - topk + 1, 9.0))
    return (c @ dct_matrix(chunk)).view(-1)


@pytest.mark.parametrize("bits", [None, 2, 4, 8])
def test_a_demo_step_agrees_in_both_schedules(monkeypatch, bits):
    """Through ``codec()``, each schedule forced by the environment: the same entries sent (and
    the same codes), what is sent plus what is kept is the momentum, and the values sent, the
    momentum kept and the direction agree to the transforms' tolerance."""
    chunk, topk = 64, 4
    m = separated(2500, chunk, topk)  # blocks of 1024 chunks and a part
    out = []
    for s in SCHEDULES:
        monkeypatch.setenv(ENV, s)
        out.append(demo_step(m.clone(), chunk, topk, bits, s))
    (mb, kb, sb, cb), (mw, kw, sw, cw) = out
    if isinstance(cw, FullTopK):
        assert cw.schedule == "whole"
        (vb, ib), (vw, iw) = cb.parts(mb), cw.parts(mw)
    else:
        (vb, ib, pb), (vw, iw, pw) = cb.parts(mb), cw.parts(mw)
        assert torch.equal(pb, pw)  # the codes
    assert torch.equal(ib.sort(1).values, iw.sort(1).values)
    torch.testing.assert_close(vw.float(), vb.float(), rtol=0, atol=ATOL)  # values, or scales
    torch.testing.assert_close(kw, kb, rtol=0, atol=ATOL)
    torch.testing.assert_close(sw, sb, rtol=0, atol=ATOL)
    for kept, sent in ((kb, sb), (kw, sw)):
        torch.testing.assert_close(kept + sent, m, rtol=0, atol=ATOL)


def test_demo_transforms_agree_in_both_schedules_with_tiles(monkeypatch):
    """``layout="tiles"``: a matrix's 2-D tiles (bit for bit) and a vector's 1-D chunks (to ``ATOL``)."""
    algo = unison.algorithms.create("demo:layout=tiles,chunk=8,topk=2")
    shapes = [torch.Size([32, 24]), torch.Size([16, 48]), torch.Size([100])]  # 8 x 8 tiles, one span (whole)
    grads = [gaussian(*s, seed=i) for i, s in enumerate(shapes)]
    state = DemoState(algo.chunk, density=algo.topk / algo.chunk)
    bucket = Bucket(0, [0, 1, 2], ["w", "v", "b"], [], torch.zeros(0), grads)
    entry = Entry(grads, algo.chunk, torch.device("cpu"), state.momenta.tiles(bucket))
    torch._foreach_add_(entry.views, entry.pair(grads))
    results = []
    for s in SCHEDULES:
        monkeypatch.setenv(ENV, s)
        state.scratch = torch.empty(200)  # a few tiles a block
        values = entry.flat.clone()
        algo._transform(state, entry, values)
        forward = values.clone()
        algo._transform(state, entry, values, inverse=True)
        results.append((forward, values))
    (fb, bb), (fw, bw) = results
    assert entry.tiles is not None and len(spans(entry.tiles, True)) == 2 < len(spans(entry.tiles, False))
    matrix = 2 * 32 * 24
    assert torch.equal(fw[:matrix], fb[:matrix])
    torch.testing.assert_close(fw, fb, rtol=0, atol=ATOL)
    torch.testing.assert_close(bw, bb, rtol=0, atol=ATOL)
    torch.testing.assert_close(bw, entry.flat, rtol=0, atol=ATOL)


# ---- op counts on meta: the whole schedule's are the same for 4M values as for 64M


def counts(make, schedule=None) -> list[int]:
    """The ops of ``make(numel)()`` for each of ``SIZES``."""
    return [ops(make(n, schedule)) for n in SIZES]


def constant(found: list[int], most: int = MOST) -> None:
    assert found[0] == found[1] and found[0] <= most, found


def grows(found: list[int]) -> None:
    assert found[1] > 4 * found[0], found


def transform_rows(numel, schedule):
    rows, d = torch.empty(numel // 64, 64, device=META), torch.empty(64, 64, device=META)
    scratch = torch.empty(BLOCK, device=META)
    return lambda: transform_(rows, d, scratch, schedule)


def transform_tiles(numel, schedule):
    tiles, d = torch.empty(numel // 4096, 64, 64, device=META), torch.empty(64, 64, device=META)
    scratch = torch.empty(BLOCK, device=META)
    return lambda: transform_tiles_(tiles, d, d, scratch, schedule)


def full_topk(method):
    def make(numel, schedule):
        c = FullTopK(numel, 64, 2, META, torch.empty(BLOCK, device=META), schedule)
        values, message = torch.empty(numel, device=META), c.empty()
        if method == "encode":
            return lambda: c.encode(values, message)
        if method == "decode_add":
            return lambda: c.decode_add(message, values, 0.25)
        return lambda: c.count_add(message, values)

    return make


METHODS = {
    "transform_": transform_rows,
    "transform_tiles_": transform_tiles,
    **{f"FullTopK.{m}": full_topk(m) for m in ("encode", "decode_add", "count_add")},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_the_whole_schedule_issues_as_many_ops_for_64m_values_as_for_4m(method):
    constant(counts(METHODS[method]))  # meta's own schedule: whole


@pytest.mark.parametrize("method", ["transform_", "transform_tiles_", "FullTopK.encode"])
def test_the_blocked_schedule_forced_on_meta_grows_with_the_values(method):
    """The proof the count above would catch a loop over blocks (the CPU's schedule)."""
    grows(counts(METHODS[method], "blocked"))


def whole_topk() -> bool:
    """Whether ``TopK`` has a schedule of its own (its whole schedule counts with DeMo's)."""
    return "schedule" in inspect.signature(TopK).parameters


def demo_round(numel: int, bits: int, layout: str = "chunks", world: int = 4):
    """DeMo's encode of one bucket and its decode of ``world`` messages, on meta: a bucket of
    four matrices of two shapes (each a quarter of ``numel``) and a vector."""
    algo = unison.algorithms.create(f"demo:bits={bits},layout={layout}")
    side = int((numel // 4) ** 0.5)
    shapes = [torch.Size([side, side]), torch.Size([side // 2, 2 * side])] * 2 + [torch.Size([1000])]
    flat = torch.empty(sum(s.numel() for s in shapes), device=META)
    grads = [t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes)]
    density = algo.topk / algo.chunk if layout == "tiles" else None
    state = DemoState(algo.chunk, density=density)
    bucket = Bucket(0, list(range(len(grads))), [f"p{i}" for i in range(len(grads))], [], flat, grads)
    entry = state.momenta.get(bucket)
    _, code, mine, everyone = algo._codec(state, bucket, entry, world)
    encode = lambda: algo.encode(state, bucket, entry, code, mine)  # noqa: E731
    decode = lambda: algo.direction(state, bucket, entry, code, everyone)  # noqa: E731
    encode(), decode()  # the DCT matrices and the views of the decode buffer, made once
    return encode, decode


#: DeMo's cases on meta: (bits, layout, most ops of its encode, of its decode of 4 messages).
#: ``layout="tiles"`` with 2-bit values is the one over 64 (84 and 67 ops, the same at every
#: size): a 2-D DCT per span of same-shaped tiles and per span of vectors, each way, around
#: ``TiledTopK``'s binned encode (52 ops) and its mean over senders (40).
DEMO_CASES = [(32, "chunks", MOST, MOST), (2, "chunks", MOST, MOST), (32, "tiles", MOST, MOST), (2, "tiles", 84, 67)]


@pytest.mark.skipif(not whole_topk(), reason="TopK has no whole schedule yet")
@pytest.mark.parametrize("bits, layout, encodes, decodes", DEMO_CASES)
def test_demo_encodes_and_decodes_a_bucket_in_as_many_ops_for_64m_values_as_for_4m(bits, layout, encodes, decodes):
    rounds = [demo_round(n, bits, layout) for n in SIZES]
    constant([ops(encode) for encode, _ in rounds], encodes)
    constant([ops(decode) for _, decode in rounds], decodes)


def test_demos_blocked_schedule_forced_on_meta_grows(monkeypatch):
    monkeypatch.setenv(ENV, "blocked")
    rounds = [demo_round(n, 32) for n in SIZES]
    grows([ops(encode) for encode, _ in rounds])
