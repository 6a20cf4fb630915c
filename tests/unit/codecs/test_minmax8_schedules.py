"""MinMax8's two schedules: the same bytes and values bit for bit on the CPU, and the whole
schedule's op count, on ``meta``, the same for 4M values as for 64M.

Both schedules run the same elementwise arithmetic and the same exact reductions (min, max;
``sum_encode`` adds the rows in the same order), so no tolerance is needed.
"""

from __future__ import annotations

import pytest
import torch

from unison.engine.codecs import MinMax8

from .ops import OpCounter, ops

LAYOUTS = [
    (1, 1, 16),
    (7, 1, 2),
    (7, 3, 2),
    (7, 5, 2),
    (1000, 2, 64),
    (1000, 3, 100),
    (1000, 4, 1024),
    (12345, 4, 1000),
    ((1 << 18) + 5, 2, 1000),
    ((1 << 18) + 5, 3, 1024),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INTS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits (NaN equals NaN, -0 differs from 0)."""
    return t.contiguous().view(INTS.get(t.dtype, t.dtype))


def assert_same_message(codec: MinMax8, a: torch.Tensor, b: torch.Tensor) -> None:
    """The same mins, scales and codes (not the alignment bytes, never written)."""
    for x, y in zip(codec.parts(a), codec.parts(b)):
        assert torch.equal(bits(x), bits(y))


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over several magnitudes, with a constant run, an inf and a NaN where there is room."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)
    if numel >= 1000:
        x[100:300] = 0.25  # constant chunks
        x[500] = float("inf")
        x[700] = float("nan")
    return x.to(dtype)


def pair(numel: int, rows: int, chunk_size: int) -> tuple[MinMax8, MinMax8]:
    return (
        MinMax8(numel, rows=rows, chunk_size=chunk_size, schedule="blocked"),
        MinMax8(numel, rows=rows, chunk_size=chunk_size, schedule="whole"),
    )


@pytest.mark.parametrize("numel,rows,chunk_size", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_and_decode_agree(numel, rows, chunk_size, dtype):
    blocked, whole = pair(numel, rows, chunk_size)
    assert (blocked.schedule, whole.schedule) == ("blocked", "whole")
    x = sample(numel, dtype, numel)
    a, b = blocked.encode_from(x, blocked.empty()), whole.encode_from(x, whole.empty())
    assert_same_message(blocked, a, b)
    assert_same(
        blocked.decode_into(a, torch.empty(numel, dtype=dtype)),
        whole.decode_into(a, torch.full((numel,), 7.0, dtype=dtype)),
    )
    base = sample(numel, dtype, numel + 1)
    assert_same(blocked.decode_add(a, base.clone()), whole.decode_add(a, base.clone()))
    # encode / decode of the value buffer: one schedule only, but held to the encode_from bytes
    c = whole.empty()
    whole.encode(whole.load(x), c)
    assert_same_message(whole, a, c)


@pytest.mark.parametrize("numel,rows,chunk_size", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_feedback_agrees(numel, rows, chunk_size, dtype):
    blocked, whole = pair(numel, rows, chunk_size)
    x = sample(numel, dtype, numel + 2)
    fa = (torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e-2).to(dtype)
    fb = fa.clone()
    assert_same_message(
        blocked, blocked.encode_from(x, blocked.empty(), feedback=fa), whole.encode_from(x, whole.empty(), feedback=fb)
    )
    assert_same(fa, fb)


@pytest.mark.parametrize("numel,rows,chunk_size", LAYOUTS)
@pytest.mark.parametrize(
    "dtype,minus_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float64)],
)
def test_minus_agrees_and_leaves_its_inputs(numel, rows, chunk_size, dtype, minus_dtype):
    blocked, whole = pair(numel, rows, chunk_size)
    x, minus = sample(numel, dtype, numel + 4), sample(numel, minus_dtype, numel + 5)
    kept = x.clone()
    a = blocked.encode_from(x, blocked.empty(), minus=minus)
    assert_same(x, kept)  # the pad's difference is made in a copy (it was made in x's last value)
    b = whole.encode_from(x, whole.empty(), minus=minus)
    assert_same(x, kept)
    assert_same_message(blocked, a, b)
    loaded = blocked.empty()
    blocked.encode(blocked.load(x, minus=minus), loaded)
    assert_same_message(blocked, a, loaded)


@pytest.mark.parametrize("numel,rows,chunk_size", [lay for lay in LAYOUTS if lay[1] in (2, 4)])
def test_sum_encode_agrees(numel, rows, chunk_size):
    blocked, whole = pair(numel, rows, chunk_size)
    received = blocked.encode_from(sample(numel, torch.float32, numel + 6), blocked.empty())
    assert_same_message(
        blocked, blocked.sum_encode(received, blocked.empty(1)), whole.sum_encode(received, whole.empty(1))
    )


@pytest.mark.parametrize("numel,rows,chunk_size", [(1000, 3, 64), (12345, 4, 1000), ((1 << 18) + 5, 2, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_parts_agree(numel, rows, chunk_size, dtype, monkeypatch):
    from unison.engine.codecs import minmax8

    monkeypatch.setattr(minmax8, "BLOCK", 100)  # a chunk a block: several parts
    blocked, whole = pair(numel, rows, chunk_size)
    x = sample(numel, dtype, numel + 7)
    fa = (torch.randn(numel, generator=torch.Generator().manual_seed(8)) * 1e-2).to(dtype)
    fb = fa.clone()
    pad = blocked.pad_value(x, fa)
    ya, yb = torch.zeros(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
    parts = list(zip(blocked.split(3), whole.split(3)))
    assert len(parts) > 1
    for pa, pb in parts:
        a = pa.encode_from(x, pa.empty(), feedback=fa, pad=pad)
        assert_same_message(pa, a, pb.encode_from(x, pb.empty(), feedback=fb, pad=pad))
        assert_same_message(pa, pa.sum_encode(a, pa.empty(1)), pb.sum_encode(a, pb.empty(1)))
        pa.decode_into(a, ya)
        pb.decode_into(a, yb)
    assert_same(fa, fb)
    assert_same(ya, yb)


def test_decode_add_decodes_where_out_lives():
    """``decode_add`` with ``out`` on another device than the codec's.

    What the CPU can show: the codec's buffers on ``meta`` (standing in for a GPU: nothing there
    can be read), the message and ``out`` on the CPU. Decoding on the codec's device, as the
    old code did, fails there; decoding where ``out`` lives gives a CPU codec's values, in
    either schedule, and no non-blocking copy onto the CPU is issued (its result would be read
    before it lands). What it cannot show: the CUDA race itself (a pinned host buffer read
    before the device's copy into it completes), which needs a GPU.
    """
    numel = 5000
    x = sample(numel, torch.float32, 9)
    local = MinMax8(numel, rows=2, chunk_size=100)
    message = local.encode_from(x, local.empty())
    expected = local.decode_add(message, torch.ones(numel))
    for schedule in ("blocked", "whole"):
        remote = MinMax8(numel, rows=2, chunk_size=100, device=torch.device("meta"), schedule=schedule)
        with Copies() as copies:
            got = remote.decode_add(message, torch.ones(numel))
        assert_same(got, expected)
        assert copies.to_cpu_non_blocking == 0


def test_offloaded_minus_moves_in_one_copy():
    """``minus`` on another device (pinned host memory on a GPU) moves once, ordered on the stream."""
    n = 4 << 20
    codec = MinMax8(n, device=torch.device("meta"))
    x, minus = torch.empty(n, device="meta"), torch.empty(n)
    with OpCounter() as counter:
        codec.encode_from(x, codec.empty(), minus=minus)
    assert counter.names.get("_to_copy", 0) == 1


class Copies(OpCounter):
    """Counts copies onto the CPU that are issued non-blocking."""

    def __init__(self) -> None:
        super().__init__()
        self.to_cpu_non_blocking = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_") and kwargs.get("non_blocking", len(args) > 2 and args[2]):
            target = kwargs.get("device") if name == "_to_copy" else args[0].device
            if target is not None and torch.device(target).type == "cpu":
                self.to_cpu_non_blocking += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


# ---- op counts on meta -------------------------------------------------------


def method_ops(numel: int, schedule: str, rows: int) -> dict[str, int]:
    """The aten ops of each of MinMax8's methods on ``numel`` values (on meta)."""
    meta = torch.device("meta")
    codec = MinMax8(numel, rows=rows, device=meta, schedule=schedule)
    x, feedback = torch.empty(numel, device=meta), torch.empty(numel, device=meta)
    minus = torch.empty(numel, device=meta, dtype=torch.bfloat16)
    half, packed = torch.empty(numel, device=meta, dtype=torch.float16), codec.empty()
    part = codec.split(4)[1]
    return {
        "encode": ops(lambda: codec.encode(codec.load(x), packed)),
        "decode": ops(lambda: codec.decode(packed)),
        "encode_from": ops(lambda: codec.encode_from(x, packed)),
        "encode_from feedback": ops(lambda: codec.encode_from(x, packed, feedback=feedback)),
        "encode_from minus": ops(lambda: codec.encode_from(x, packed, minus=minus)),
        "decode_into": ops(lambda: codec.decode_into(packed, half)),
        "decode_add": ops(lambda: codec.decode_add(packed, half)),
        "sum_encode": ops(lambda: codec.sum_encode(packed, codec.empty(1))),
        "pad_value": ops(lambda: codec.pad_value(x, feedback)),
        "part encode_from": ops(lambda: part.encode_from(x, part.empty(), feedback=feedback, pad=x[0])),
        "part decode_into": ops(lambda: part.decode_into(part.empty(), half)),
        "part sum_encode": ops(lambda: part.sum_encode(part.empty(), part.empty(1))),
    }


@pytest.mark.parametrize("rows", [1, 4])
def test_whole_schedule_ops_do_not_grow(rows):
    assert MinMax8(8, device=torch.device("meta")).schedule == "whole"
    small, large = method_ops(4 << 20, "whole", rows), method_ops(64 << 20, "whole", rows)
    assert small == large
    assert max(small.values()) <= 64, small


def test_blocked_schedule_ops_grow():
    """The counts above are not trivially flat: the blocked loop, forced on meta, grows with the values."""
    small, large = method_ops(4 << 20, "blocked", 1), method_ops(64 << 20, "blocked", 1)
    assert large["encode_from"] > 10 * small["encode_from"] > 10 * 64


# ---- the algorithms' loops around the codec: the whole schedule forced on the CPU ----------


@pytest.mark.parametrize("late", [False, True])
def test_low_precision_decentralized_mix_agrees(late, monkeypatch):
    from unison.algorithms.averaging import low_precision_decentralized as lpd

    monkeypatch.setattr(lpd, "pieces", lambda n, size: [slice(a, min(n, a + 1000)) for a in range(0, n, 1000)])
    numel, outs = 12345, []
    for schedule in ("blocked", "whole"):
        monkeypatch.setenv("UNISON_CODEC_SCHEDULE", schedule)
        copies = lpd.Copies.__new__(lpd.Copies)
        copies.hold(sample(numel, torch.float32, 10), [1, 2], lpd.shared_scratch([numel], torch.device("cpu")), False)
        for i, replica in enumerate(copies.replicas):
            replica.copy_(sample(numel, torch.float32, 11 + i))
        outs.append(copies.mix_into(sample(numel, torch.float32, 20), late=late))
    assert_same(*outs)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("same_settings", [True, False])
def test_qadam_scale_agrees(inverse, same_settings, monkeypatch):
    from unison.algorithms.gradient import qadam
    from unison.engine.buckets import Bucket
    from unison.optim import QAdamOptimizer

    monkeypatch.setattr(qadam, "PIECE", 1000)
    shapes = [(3000,), (40, 50), (7,), (1234,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    groups = [{"params": params[:2]}, {"params": params[2:], "eps": 1e-8 if same_settings else 1e-3}]
    opt = QAdamOptimizer(groups, warmup_steps=10)
    g = torch.Generator().manual_seed(12)
    for p in params[:3]:  # the last has no variance yet
        v = torch.rand(p.shape, generator=g)
        v.view(-1)[:5] = 0.0
        v.view(-1)[5] = float("nan")
        opt.state[p]["exp_avg_sq"] = v
    numel = sum(p.numel() for p in params)
    start = torch.randn(numel, generator=g)
    outs = []
    for schedule in ("blocked", "whole"):
        monkeypatch.setenv("UNISON_CODEC_SCHEDULE", schedule)
        flat = start.clone()
        views, at = [], 0
        for p in params:
            views.append(flat[at : at + p.numel()].view(p.shape))
            at += p.numel()
        qadam._scale(opt, Bucket(0, list(range(4)), [""] * 4, params, flat, views), inverse=inverse)
        outs.append(flat)
    assert_same(*outs)
