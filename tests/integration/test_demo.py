"""DeMo on 2 and 4 gloo ranks: every step against the update written by hand in plain torch
(momentum, DCT per chunk, top-k, average, inverse DCT, SGD), equal replicas, the bytes counted,
exact resume by unison.save/load, switch_to in and out."""

from __future__ import annotations

import math

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import spread_across_ranks

import unison
from tests.unit.codecs.topk_reference import quantized_topk
from unison.engine.codecs.dct import message_bytes
from unison.engine.codecs.topk import SCALE_DTYPES

LR = 0.05
# (options, steps): float32 values (the paper's) without the sign, chunks of 64, the mean over all ranks;
# 4-bit values with float32 scales in chunks of 32; 8-bit values, one coefficient per chunk of 16, no
# momentum decay to speak of, the mean over all ranks; the defaults.
CASES = [
    ({"beta": 0.9, "chunk": 64, "topk": 4, "mean": "world", "bits": 32, "sign": False}, 4),
    ({"beta": 0.5, "chunk": 32, "topk": 3, "bits": 4, "scale_dtype": "fp32"}, 3),
    ({"beta": 0.999, "chunk": 16, "topk": 1, "bits": 8, "mean": "world", "sign": False}, 3),
    ({}, 3),  # the defaults: 2-bit values, bfloat16 scales, the sign, the mean over senders
    # 2-D tiles (8 x 8, 4 x 8) and vector chunks (8, and a 4-value bias: one chunk) with float32 values;
    # with the defaults' 2-bit values and the sign, one coefficient of 8 sent (8 of an 8 x 8 tile)
    ({"beta": 0.9, "chunk": 8, "topk": 2, "mean": "world", "bits": 32, "sign": False, "layout": "tiles"}, 3),
    ({"chunk": 8, "topk": 1, "layout": "tiles"}, 3),
]


def dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, written from its definition."""
    d = torch.tensor(
        [
            [math.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n) for j in range(n)]
            for k in range(n)
        ],
        dtype=torch.float64,
    )
    return d.float()


def divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` not above ``cap``."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def coefficients(m: torch.Tensor, chunk: int, layout: str):
    """The DCT coefficients of ``m`` as rows of equal blocks ``[blocks, size]``, and the function that
    turns such rows back into ``m``'s shape. ``"chunks"``: padded to whole chunks, a 1-D DCT each;
    ``"tiles"`` (the paper's code): a matrix (``shape[0] x rest``) in ``h x w`` tiles, each side the
    largest divisor of its dimension not above ``chunk``, a 2-D DCT each; a vector in chunks of the
    largest divisor of its length not above ``chunk``."""
    n, shape = m.numel(), m.shape
    if layout == "tiles" and m.dim() >= 2:
        rows, cols = shape[0], n // shape[0]
        h, w = divisor(rows, chunk), divisor(cols, chunk)
        if h * w >= chunk:
            dh, dw = dct(h), dct(w)
            tiles = m.reshape(rows // h, h, cols // w, w).permute(0, 2, 1, 3)
            coeffs = (dh @ tiles @ dw.T).reshape(-1, h * w)

            def back(c: torch.Tensor) -> torch.Tensor:
                t = dh.T @ c.reshape(rows // h, cols // w, h, w) @ dw
                return t.permute(0, 2, 1, 3).reshape(shape)

            return coeffs, back
    size = divisor(n, chunk) if layout == "tiles" else chunk
    d = dct(size)
    padded = torch.zeros(math.ceil(n / size) * size)
    padded[:n] = m.reshape(-1)
    return padded.view(-1, size) @ d.T, lambda c: (c @ d).reshape(-1)[:n].view(shape)


def reference_step(
    momenta, grads, *, beta, chunk, topk, bits=None, sign=False, scale_dtype="fp32", mean="senders", layout="chunks"
):
    """One DeMo step of every rank (``momenta[r][i]``: rank r's momentum of parameter i, updated in
    place) from their gradients; returns each parameter's direction (the same on every rank): the
    inverse DCT of each coefficient's mean over the ranks that sent it (``mean="senders"``) or over
    all. With tiles each block sends ``topk / chunk`` of its coefficients (at least one)."""
    world = len(momenta)
    directions = []
    for i in range(len(grads[0])):
        sent_sum, senders, back = None, 0, None
        for r in range(world):
            m = momenta[r][i]
            m.mul_(beta).add_(grads[r][i])
            coeffs, back = coefficients(m, chunk, layout)
            size = coeffs.shape[1]
            k = topk if layout == "chunks" else min(size, max(1, round(topk * size / chunk)))
            if bits is None:
                sent = torch.zeros_like(coeffs)
                idx = coeffs.abs().topk(k, dim=1).indices
                sent.scatter_(1, idx, coeffs.gather(1, idx))
            else:
                sent = quantized_topk(coeffs.reshape(-1), size, k, bits, SCALE_DTYPES[scale_dtype]).view_as(coeffs)
            m.copy_(back(coeffs - sent))
            sent_sum = sent if sent_sum is None else sent_sum + sent
            senders = senders + (sent != 0).float()
        average = sent_sum / (senders.clamp(min=1) if mean == "senders" else world)
        direction = back(average)
        directions.append(direction.sign() if sign else direction)
    return directions


def spelled_out(algo) -> dict:
    """Every option ``reference_step`` takes, as ``algo`` (a Demo) holds it: its defaults included."""
    return {
        "beta": algo.beta,
        "chunk": algo.chunk,
        "topk": algo.topk,
        "bits": algo.value_bits,
        "sign": algo.sign,
        "scale_dtype": algo.scale_dtype or "bf16",
        "mean": algo.mean,
        "layout": algo.layout,
    }


def train_step(model, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def check_against_reference() -> list[dict]:
    """Each rank replays every rank's gradients on a plain copy of the model and steps it by hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for options, steps in CASES:
        torch.manual_seed(0)
        net, ref = MLP(), MLP()
        ref.load_state_dict(net.state_dict())
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        algo = unison.algorithms.create("demo", **options)
        model = unison.DataParallel(net, optimizer=opt, algorithm=algo)
        options = spelled_out(algo)
        params = list(ref.parameters())
        momenta = [[torch.zeros_like(p) for p in params] for _ in range(world)]
        gaps, momentum_gaps, spreads, bytes_, expected = [], [], [], [], []
        for s in range(steps):
            grads = []
            for r in range(world):
                ref.zero_grad()
                F.mse_loss(ref(batch(s, r)[0]), batch(s, r)[1]).backward()
                grads.append([p.grad.detach().clone() for p in params])
            directions = reference_step(momenta, grads, **options)
            with torch.no_grad():
                for p, g in zip(params, directions):
                    p.sub_(LR * g)
            train_step(model, opt, *batch(s, rank))
            gaps.append((flat(net) - flat(ref)).abs().max().item())
            saved = model.algorithm_state.state_dict()["feedback"]
            names = [n for n, _ in ref.named_parameters()]
            momentum_gaps.append(max((saved[n] - m).abs().max().item() for n, m in zip(names, momenta[rank])))
            spreads.append(spread_across_ranks(net))
            bytes_.append(model.comm_stats["bytes_last_step"])
            expected.append(sum((world - 1) * message_size(options, b) for b in model._core.reducer.buckets))
        out.append(
            {"gaps": gaps, "momentum_gaps": momentum_gaps, "spreads": spreads, "bytes": bytes_, "expected": expected}
        )
        model.close()
    return out


def message_size(options: dict, bucket) -> int:
    """Bytes of one rank's message of ``bucket``, from its layout: chunks as ``engine.codecs.dct`` packs
    them; tiles with 12-bit indices (packed in pairs) for tiles of more than 256 values, else 8."""
    chunk, topk, bits = options["chunk"], options["topk"], options.get("bits")
    scale = SCALE_DTYPES[options["scale_dtype"]]
    if options["layout"] == "chunks":
        padded = sum(math.ceil(v.numel() / chunk) * chunk for v in bucket.views)
        return message_bytes(padded, chunk, topk, bits, scale)
    blocks = [coefficients(torch.zeros(v.shape), chunk, "tiles")[0].shape for v in bucket.views]
    sent = sum(b * min(size, max(1, round(topk * size / chunk))) for b, size in blocks)
    width = 8 if max(size for _, size in blocks) <= 256 else 12
    head = 0 if bits is None else sum(b for b, _ in blocks) * scale.itemsize
    aligned = lambda n: math.ceil(n / 4) * 4  # noqa: E731
    index = 3 * math.ceil(sent / 2) if width == 12 else sent
    values = sent * 4 if bits is None else math.ceil(sent * bits / 8)
    return aligned(aligned(aligned(head) + index) + values)


@pytest.mark.parametrize("world", [2, 4])
def test_every_step_is_the_hand_written_update(world):
    for rank_results in launch.run(check_against_reference, world, timeout=120):
        for (options, _), r in zip(CASES, rank_results):
            assert max(r["gaps"]) < 1e-5, (options, r["gaps"])
            assert max(r["momentum_gaps"]) < 1e-5, (options, r["momentum_gaps"])
            assert r["spreads"] == [0.0] * len(r["spreads"])  # the same messages decoded in rank order
            for sent, packed in zip(r["bytes"], r["expected"]):
                assert packed > 0 and 0 <= sent - packed <= 6  # and the has-a-gradient flags: a byte per parameter


# every option's kind: float32 values, 2-bit values with the sign, 2-D tiles
RESUMED = [
    "demo:beta=0.9,chunk=64,topk=4,bits=32,sign=false",
    "demo:beta=0.99,chunk=32,topk=2,bits=2,sign=True",
    "demo:chunk=8,topk=1,layout=tiles",
]
STEPS, SAVE_AT = 8, 4


def build(spec: str, seed: int):
    torch.manual_seed(seed)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.5)
    return unison.DataParallel(net, optimizer=opt, algorithm=spec), net, opt


def momentum(model) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, t in sorted(model.algorithm_state.state_dict()["feedback"].items())])


def check_resume(path: str) -> dict:
    """8 steps straight, or 4 + save + other weights + load + the rest: the same bits."""
    rank, out = dist.get_rank(), {}
    for spec in RESUMED:
        model, net, opt = build(spec, 0)
        for s in range(STEPS):
            train_step(model, opt, *batch(s, rank))
        straight, kept = flat(net), momentum(model)
        model.close()

        model, net, opt = build(spec, 0)
        for s in range(SAVE_AT):
            train_step(model, opt, *batch(s, rank))
        unison.save(path, model, opt, step=SAVE_AT)
        model.close()

        model, net, opt = build(spec, 1)
        state = unison.load(path, model, opt)
        for s in range(state["step"], STEPS):
            train_step(model, opt, *batch(s, rank))
        out[spec] = {
            "weights": (flat(net) - straight).abs().max().item(),
            "momentum": (momentum(model) - kept).abs().max().item(),
            "nonzero": kept.abs().sum().item() > 0,
            "spread": spread_across_ranks(net),
        }
        model.close()
    return out


def test_save_and_load_resume_exactly(tmp_path):
    results = launch.run(check_resume, 2, str(tmp_path / "ckpt.pt"), timeout=120)
    for r in results:
        for spec in RESUMED:
            assert r[spec]["weights"] == 0.0 and r[spec]["momentum"] == 0.0, (spec, r[spec])
            assert r[spec]["nonzero"] and r[spec]["spread"] == 0.0, spec
    assert results[0][RESUMED[0]] is not None


def check_switch() -> dict:
    """allreduce -> demo -> allreduce -> demo (a fresh momentum) -> local_sgd -> demo: replicas
    equal all along, and the loss falls."""
    rank, out = dist.get_rank(), {"spreads": [], "losses": [], "fresh": []}
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    model = unison.DataParallel(net, optimizer=opt)
    step = 0
    specs = (
        "demo:chunk=32,topk=8",
        "allreduce",
        "demo:chunk=32,topk=8,bits=8",
        "local_sgd:period=2",
        "demo:layout=tiles",
    )
    for spec in specs:
        model.switch_to(spec)
        if spec.startswith("demo"):
            out["fresh"].append(model.algorithm_state.state_dict()["feedback"] == {})  # none before its first backward
        for _ in range(3):
            out["losses"].append(train_step(model, opt, *batch(step % 4, rank)))
            step += 1
        out["spreads"].append(spread_across_ranks(net))
    model.switch_to("allreduce")
    out["spreads"].append(spread_across_ranks(net))
    model.close()
    return out


def test_switch_to_in_and_out():
    for r in launch.run(check_switch, 2, timeout=60):
        assert r["fresh"] == [True, True, True]
        assert r["spreads"][:3] + r["spreads"][4:] == [0.0] * 5  # local_sgd drifts between its syncs
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3])


# ---- hierarchical: 4 ranks as 2 nodes x 2 --------------------------------------------------
NODES = {"UNISON_NODES": "2"}
HIERARCHICAL = [{"beta": 0.9, "chunk": 16, "topk": 2}, {"beta": 0.5, "chunk": 32, "topk": 3, "bits": 4, "sign": True}]


def check_hierarchical() -> list[dict]:
    """Hierarchical demo is flat demo over the nodes, each sending the DeMo message of its mean
    gradient (chunks never straddle a shard: each is one local rank's): checked step by step
    against the hand-written update on ``nodes`` ranks with the node means as their gradients."""
    rank, topo = dist.get_rank(), unison.topology()
    nodes, local = topo.num_nodes, topo.local_world_size
    out = []
    for options in HIERARCHICAL:
        torch.manual_seed(0)
        net, ref = MLP(), MLP()
        ref.load_state_dict(net.state_dict())
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        algo = unison.algorithms.create("demo", hierarchical=True, **options)
        model = unison.DataParallel(net, optimizer=opt, algorithm=algo)
        options = spelled_out(algo)
        params = list(ref.parameters())
        momenta = [[torch.zeros_like(p) for p in params] for _ in range(nodes)]
        gaps, spreads, bytes_, cross = [], [], [], []
        for s in range(4):
            means = []
            for n in range(nodes):
                grads = []
                for r in range(n * local, (n + 1) * local):
                    ref.zero_grad()
                    F.mse_loss(ref(batch(s, r)[0]), batch(s, r)[1]).backward()
                    grads.append([p.grad.detach().clone() for p in params])
                means.append([torch.stack(g).mean(0) for g in zip(*grads)])
            directions = reference_step(momenta, means, **options)
            with torch.no_grad():
                for p, g in zip(params, directions):
                    p.sub_(LR * g)
            before = model.algorithm_state.levels.inter_bytes
            train_step(model, opt, *batch(s, rank))
            cross.append(model.algorithm_state.levels.inter_bytes - before)
            gaps.append((flat(net) - flat(ref)).abs().max().item())
            spreads.append(spread_across_ranks(net))
            bytes_.append(model.comm_stats["bytes_last_step"])
        levels, chunk = model.algorithm_state.levels, options["chunk"]
        flat_bytes = 0
        for b in model._core.reducer.buckets:
            padded = sum(math.ceil(v.numel() / chunk) * chunk for v in b.views)
            flat_bytes += (dist.get_world_size() - 1) * message_bytes(
                padded, chunk, options["topk"], options["bits"], SCALE_DTYPES[options["scale_dtype"]]
            )
        out.append({"gaps": gaps, "spreads": spreads, "bytes": bytes_, "cross": cross, "flat_bytes": flat_bytes})
        assert levels is not None
        model.close()
    return out


def test_hierarchical_sums_in_the_node_and_sends_only_the_sparse_form_across():
    for rank_results in launch.run(check_hierarchical, 4, env=NODES, timeout=120):
        for r in rank_results:
            assert max(r["gaps"]) < 1e-4, r["gaps"]  # the node's sum is taken in another order than the mean
            assert r["spreads"] == [0.0] * 4  # every rank writes the same gathered direction
            assert all(c > 0 for c in r["cross"]) and max(r["cross"]) < r["flat_bytes"] / 2
            assert all(b > c for b, c in zip(r["bytes"], r["cross"]))  # and the legs inside the node


def check_optimizer_pairing() -> dict:
    """demo built with each optimizer: the warnings each rank saw."""
    import warnings

    seen = {}
    for name, make, spec in [
        ("AdamW", torch.optim.AdamW, "demo"),
        ("RMSprop", torch.optim.RMSprop, "demo"),
        ("SGD", torch.optim.SGD, "demo"),
        ("AdamW unsigned", torch.optim.AdamW, "demo:sign=false"),
    ]:
        net = MLP()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            unison.DataParallel(net, optimizer=make(net.parameters(), lr=LR), algorithm=spec).close()
        seen[name] = [str(w.message) for w in caught if "pair demo" in str(w.message).lower()]
    return seen


def test_demo_on_the_sign_warns_once_on_rank_0_when_the_optimizer_is_adaptive():
    first, second = launch.run(check_optimizer_pairing, 2, timeout=60)
    assert len(first["AdamW"]) == 1 and "AdamW" in first["AdamW"][0] and "torch.optim.SGD" in first["AdamW"][0]
    assert len(first["RMSprop"]) == 1 and "RMSprop" in first["RMSprop"][0]
    assert first["SGD"] == first["AdamW unsigned"] == []
    assert all(messages == [] for messages in second.values())  # rank 1 says nothing
