"""The "bytegrad" algorithm (8-bit compressed gradient averaging) and its codec.

The codec is checked in-process; the algorithm on 2 and 3 real gloo ranks (3
gives parts of uneven length and padding) against "allreduce" trained side by
side in the same group.
"""

import copy

import launch
import pytest
import torch
import torch.distributed as dist
from models import MLP, batch
from scenarios import mse_loss, spread_across_ranks
from unit.codecs.codec_reference import dequantize_minmax, minmax_bytes, quantize_minmax

import unison
from unison.algorithms.gradient.bytegrad import ByteGrad, Exchange, wire_bytes_8bit
from unison.engine.codecs import MinMax8
from unison.engine.codecs import minmax8 as codecs

STEPS = 5
# Largest relative difference allowed between bytegrad's and allreduce's parameter
# change after STEPS steps. 8-bit rounding stays well under it; a halved average
# (divided twice) or a lost part gives 0.5 or more.
CHANGE_TOLERANCE = 0.05


# ---- the codec, in-process --------------------------------------------------


def chunk_of_each_element(numel, chunks):
    """The chunk index of each of ``numel`` elements quantized in ``chunks`` chunks."""
    size = -(-numel // chunks)
    return torch.arange(numel) // size


@pytest.mark.parametrize("numel,chunks", [(1000, 1), (1000, 8), (1001, 7), (37, 5), (3, 3), (5, 5)])
def test_round_trip_within_half_a_step(numel, chunks):
    g = torch.Generator().manual_seed(numel + chunks)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 2, numel)
    codes, mins, scales = quantize_minmax(x, chunks)
    size = -(-numel // chunks)
    assert codes.dtype == torch.uint8 and codes.numel() == size * chunks
    assert mins.dtype == scales.dtype == torch.float32 and mins.numel() == scales.numel() == chunks
    y = dequantize_minmax(codes, mins, scales, numel)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    k = chunk_of_each_element(numel, chunks)
    half_step = scales[k] / 2
    # Half a step, plus float32 rounding of the arithmetic.
    bound = half_step * (1 + 1e-4) + 1e-6 * x.abs().max()
    assert bool(((x - y).abs() <= bound).all()), float(((x - y).abs() / half_step).max())
    # Each chunk's extremes are used: the codes span 0..255 where the chunk is not constant.
    spans = codes.view(chunks, size).int()
    assert bool((spans.amin(1) == 0).all()) and bool((spans.amax(1)[scales > 0] == 255).all())


def test_constant_chunks_round_trip_exactly():
    x = torch.cat([torch.full((64,), 0.3), torch.randn(64), torch.zeros(64), torch.full((64,), -7e-9)])
    codes, mins, scales = quantize_minmax(x, 4)
    assert scales[0] == 0 and scales[2] == 0 and scales[3] == 0
    assert torch.isfinite(scales).all() and torch.isfinite(mins).all()
    y = dequantize_minmax(codes, mins, scales, x.numel())
    for k in (0, 2, 3):
        assert torch.equal(y[64 * k : 64 * (k + 1)], x[64 * k : 64 * (k + 1)])
    assert torch.equal(dequantize_minmax(*quantize_minmax(torch.full((5,), 2.5), 2), 5), torch.full((5,), 2.5))


def test_padding_does_not_widen_the_last_chunk():
    # 10 values in 4 chunks of 3: the last chunk holds one real value and two of padding.
    x = torch.arange(10, dtype=torch.float32) + 100
    codes, mins, scales = quantize_minmax(x, 4)
    assert scales[-1] == 0 and mins[-1] == 109
    assert minmax_bytes(10, 4) == 12 + 32


def test_codec_rejects_bad_chunks():
    with pytest.raises(ValueError, match="positive integer"):
        quantize_minmax(torch.ones(4), 0)
    with pytest.raises(ValueError, match="chunks"):
        dequantize_minmax(torch.zeros(10, dtype=torch.uint8), torch.zeros(3), torch.zeros(3), 10)


@pytest.mark.parametrize(
    "numel,rows,chunk_size,parts", [(5000, 2, 10, 7), (4999, 3, 7, 50), (1000, 8, 3, 4), (300, 2, 10, 1)]
)
def test_split_codec_is_the_whole_codec_bit_for_bit(monkeypatch, numel, rows, chunk_size, parts):
    # Small blocks, so that small buffers make many parts (the padding of 3 and 8 rows included).
    monkeypatch.setattr(codecs, "BLOCK", 64)
    g = torch.Generator().manual_seed(numel)
    x, feedback = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 0.01
    whole = MinMax8(numel, rows=rows, chunk_size=chunk_size)
    pieces = whole.split(parts)
    assert 1 <= len(pieces) <= parts and sum(p.chunks for p in pieces) == whole.chunks
    f1 = feedback.clone()
    packed = whole.encode_from(x.clone(), whole.empty(), feedback=f1)
    x2, f2 = x.clone(), feedback.clone()
    pad = whole.pad_value(x2, f2)
    split = [p.encode_from(x2, p.empty(), feedback=f2, pad=pad) for p in pieces]
    assert torch.equal(f1, f2), "error feedback differs"
    mins, scales, codes = whole.parts(packed)
    summed = whole.sum_encode(packed, whole.empty(1))
    first = 0
    for p, b in zip(pieces, split):
        m, s, c = p.parts(b)
        part = slice(first, first + p.chunks)
        assert torch.equal(m, mins[:, part]) and torch.equal(s, scales[:, part]) and torch.equal(c, codes[:, part])
        sm, ss, sc = p.parts(p.sum_encode(b, p.empty(1)))
        wm, ws, wc = whole.parts(summed)
        assert torch.equal(sm, wm[:, part]) and torch.equal(ss, ws[:, part]) and torch.equal(sc, wc[:, part])
        first += p.chunks
    out = torch.full((numel,), float("nan"))
    for p, b in zip(pieces, split):
        p.decode_into(b, out)
    assert torch.equal(out, whole.decode_into(packed, torch.empty(numel)))


@pytest.mark.parametrize("numel,world", [(3_000_001, 2), (2_500_000, 3), (1000, 2)])
def test_wire_bytes_are_the_parts_rows(numel, world):
    ex = Exchange(numel, world, 1000, torch.device("cpu"), part_values=500_000)
    assert len(ex.parts) >= (2 if numel > 10**6 else 1)
    sent = 2 * (world - 1) * sum(p.row_bytes for p in ex.parts)
    assert wire_bytes_8bit(numel, world, 1000, 500_000) == sent
    assert abs(sent - 2 * (world - 1) * ex.codec.row_bytes) <= 8 * len(ex.parts)


# ---- options ------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"chunk_size": -4}, "chunk_size must be a positive integer"),
        ({"chunk_size": 1.5}, "chunk_size must be a positive integer"),
        ({"chunk_size": True}, "chunk_size must be a positive integer"),
        ({"error_feedback": "yes"}, "error_feedback must be True or False"),
        ({"error_feedback": 1}, "error_feedback must be True or False"),
        ({"bits": 4}, "allowed options: chunk_size, error_feedback"),
    ],
)
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        unison.algorithms.create("bytegrad", **options)


def test_options_and_state_without_error_feedback():
    alg = unison.algorithms.create("bytegrad")
    assert isinstance(alg, ByteGrad)
    assert alg.options == {"error_feedback": False, "chunk_size": 1024, "hierarchical": False}
    assert "bytegrad" in unison.algorithms.names()
    state = unison.DataParallel(MLP(), algorithm=alg).algorithm_state  # what it built for a model
    assert state.state_dict() == {}
    with pytest.raises(ValueError, match="error_feedback=True"):
        state.load_state_dict({"residuals": {"w": torch.zeros(2)}})


# ---- on real ranks ------------------------------------------------------------


def flat_params(model):
    """All parameters of ``model`` as one detached flat tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def spread_of_grads(model) -> float:
    """Largest difference of a gradient element between this rank and the others."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return (hi - lo).abs().max().item()


def train(models, steps, start=0, lr=0.05, momentum=0.9):
    """Train each DataParallel model in lockstep on this rank's batches."""
    rank = dist.get_rank()
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    for s in range(start, start + steps):
        x, y = batch(s, rank)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            mse_loss(m, x, y, rank).backward()
            opt.step()


def relative_change_error(model, reference, initial) -> float:
    """How far ``model``'s change from ``initial`` is from ``reference``'s, relative to the latter."""
    ref = flat_params(reference) - initial
    return ((flat_params(model) - initial) - ref).norm().item() / ref.norm().item()


def against_allreduce():
    """bytegrad (default chunks; small chunks over several buckets; error feedback) next to allreduce."""
    torch.manual_seed(0)
    base = MLP(hidden=48)
    initial = flat_params(base)
    variants = {
        "default": {"algorithm": "bytegrad"},
        "small_chunks_many_buckets": {"algorithm": ByteGrad(chunk_size=100), "bucket_cap_mb": 0.004},
        "error_feedback": {"algorithm": ByteGrad(error_feedback=True, chunk_size=300)},
    }
    allreduce = unison.DataParallel(copy.deepcopy(base))
    models = {name: unison.DataParallel(copy.deepcopy(base), **kw) for name, kw in variants.items()}
    train([allreduce, *models.values()], STEPS)
    out = {}
    for name, m in models.items():
        out[name] = {
            "buckets": len(m._core.reducer.buckets),
            "spread": spread_across_ranks(m),
            "grad_spread": spread_of_grads(m),
            "change_error": relative_change_error(m, allreduce, initial),
            "bytes_ratio": m.comm_stats["bytes_per_step"] / allreduce.comm_stats["bytes_per_step"],
            "bytes_per_step": m.comm_stats["bytes_per_step"],
        }
    out["allreduce_bytes_per_step"] = allreduce.comm_stats["bytes_per_step"]
    return out


def error_feedback_checkpoint():
    """Save a bytegrad(error_feedback=True) model, load it into a fresh one, step both once."""
    torch.manual_seed(1)
    model = unison.DataParallel(MLP(), algorithm=ByteGrad(error_feedback=True))
    train([model], 3, momentum=0.0)
    state = model.state_dict()
    saved = state.get("_unison_algorithm")
    residuals = saved["state"]["residuals"] if saved else {}
    restored = unison.DataParallel(MLP(hidden=32), algorithm=ByteGrad(error_feedback=True))
    restored.load_state_dict(state)
    weights_only = unison.DataParallel(MLP(), algorithm=ByteGrad(error_feedback=True))
    weights_only.load_state_dict({k: v for k, v in state.items() if k != "_unison_algorithm"})
    train([model, restored, weights_only], 1, start=3, momentum=0.0)
    return {
        "saved_name": saved["name"] if saved else None,
        "residual_names": sorted(residuals),
        "param_names": sorted(n for n, _ in model.module.named_parameters()),
        "residual_norm": sum(t.norm().item() for t in residuals.values()),
        "restored_diff": (flat_params(model) - flat_params(restored)).abs().max().item(),
        "weights_only_diff": (flat_params(model) - flat_params(weights_only)).abs().max().item(),
    }


def one_rank_group():
    """In a group of one, bytegrad sends nothing and leaves the gradient untouched."""
    solo = dist.new_group([0])
    out = None
    if dist.get_rank() == 0:
        torch.manual_seed(2)
        base = MLP()
        a = unison.DataParallel(copy.deepcopy(base), process_group=solo)
        b = unison.DataParallel(copy.deepcopy(base), process_group=solo, algorithm=ByteGrad(error_feedback=True))
        train([a, b], 2)
        out = {
            "diff": (flat_params(a) - flat_params(b)).abs().max().item(),
            "bytes": b.comm_stats["bytes_per_step"],
            "allreduce_bytes": a.comm_stats["bytes_per_step"],
            "steps": b.comm_stats["steps"],
        }
    dist.barrier()
    return out


def pipelined_exchange():
    """An Exchange in many pipelined parts next to one in a single part, on the same values."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x, residual = torch.randn(5000, generator=g), torch.randn(5000, generator=g) * 0.01
    block, codecs.BLOCK = codecs.BLOCK, 64  # small blocks: many parts of a small buffer
    try:
        many = Exchange(x.numel(), world, 10, x.device, part_values=300)
    finally:
        codecs.BLOCK = block
    one = Exchange(x.numel(), world, 10, x.device, part_values=10**9)
    a, ra, b, rb = x.clone(), residual.clone(), x.clone(), residual.clone()
    many.run(a, dist.group.WORLD, ra)
    one.run(b, dist.group.WORLD, rb)
    exact = x + residual
    dist.all_reduce(exact)
    lo, hi = a.clone(), a.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return {
        "parts": (len(many.parts), len(one.parts)),
        "diff": (a - b).abs().max().item(),
        "residual_diff": (ra - rb).abs().max().item(),
        "spread": (hi - lo).abs().max().item(),
        "error": ((a - exact).norm() / exact.norm()).item(),
    }


def all_checks(world):
    """Everything checked on real ranks, in one launched group."""
    out = {
        "vs_allreduce": against_allreduce(),
        "checkpoint": error_feedback_checkpoint(),
        "pipelined": pipelined_exchange(),
    }
    if world == 2:
        out["one_rank"] = one_rank_group()
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    """Each rank's results of ``all_checks`` on 2 and on 3 ranks."""
    return request.param, launch.run(all_checks, request.param, request.param, timeout=90)


def test_replicas_identical_and_close_to_allreduce(ranks):
    world, results = ranks
    for r in results:
        for name, v in r["vs_allreduce"].items():
            if not isinstance(v, dict):
                continue
            assert v["spread"] == 0.0, f"{name}: replicas differ by {v['spread']}"
            assert v["grad_spread"] == 0.0, f"{name}: gradients differ across ranks by {v['grad_spread']}"
            assert v["change_error"] < CHANGE_TOLERANCE, f"{name}: {v['change_error']:.4f} from allreduce"
            assert v["change_error"] > 0, f"{name}: no quantization error at all: was anything compressed?"
    assert results[0]["vs_allreduce"]["small_chunks_many_buckets"]["buckets"] >= 2


def test_bytes_about_a_quarter_of_allreduce(ranks):
    world, results = ranks
    for r in results:
        for name in ("default", "small_chunks_many_buckets", "error_feedback"):
            ratio = r["vs_allreduce"][name]["bytes_ratio"]
            assert 0.2 < ratio < 0.35, f"{name}: {ratio:.3f} of allreduce's bytes"


def test_error_feedback_state_round_trips(ranks):
    world, results = ranks
    for r in results:
        c = r["checkpoint"]
        assert c["saved_name"] == "bytegrad"
        assert c["residual_names"] == c["param_names"]
        assert c["residual_norm"] > 0, "the residuals are all zero: error feedback kept nothing"
        assert c["restored_diff"] == 0.0, f"restored model differs by {c['restored_diff']} after one step"
        assert c["weights_only_diff"] > 0, "dropping the residuals changed nothing: they are not used"


def test_group_of_one_is_exact(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("checked once, on 2 ranks")
    solo = results[0]["one_rank"]
    assert solo["diff"] == 0.0
    # A group of one has nothing to reduce: no gradient engine, nothing sent, as for allreduce.
    assert solo["bytes"] == solo["allreduce_bytes"] == 0


def test_pipelined_parts_are_bit_identical_to_one_part(ranks):
    world, results = ranks
    for r in results:
        p = r["pipelined"]
        assert p["parts"][0] > 4 and p["parts"][1] == 1, p["parts"]
        assert p["diff"] == 0.0 and p["residual_diff"] == 0.0, p
        assert p["spread"] == 0.0, f"ranks differ by {p['spread']}"
        assert 0 < p["error"] < 0.05, p["error"]
