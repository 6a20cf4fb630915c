"""SparseLoCo on 2 and 4 gloo ranks: every sync against the update written by hand (both forms, one harness)
(tests/unit/codecs/topk_reference.py), equal replicas after a sync, the bytes counted, exact resume by
unison.save/load (between syncs and with a sync in flight), switch_to in and out."""

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
from tests.unit.codecs.topk_reference import (
    binned,
    quantized_topk,
    sparseloco_sync,
    sparseloco_tiled_sync,
    tile_positions,
)

FIRST_FORM = {"layout": "flat", "quantizer": "max", "mean": "world"}  # unison's first form, before the references'
# (options, steps). The first form: 2-bit values with uint8 indices (chunks of 248) and decay; 4-bit with
# int16 indices (chunks of 866), a fixed k and beta = 1; 8-bit, one chunk, a period of 1. The references'
# form (the defaults): 16 x 16 tiles (the MLP's 32 x 32 matrices in 4, its biases in chunks of 16) at
# 10%, 2 bits; the default 64 x 64 tiles (whole matrices) at 1/32 and 4 bits.
CASES = [
    ({"period": 3, "chunk": 256, "density": 0.05, "bits": 2, "beta": 0.9, "outer_lr": 0.8, **FIRST_FORM}, 9),
    ({"period": 2, "chunk": 1000, "topk": 20, "bits": 4, "beta": 1.0, "outer_lr": 1.0, **FIRST_FORM}, 6),
    ({"period": 1, "chunk": 4096, "density": 0.02, "bits": 8, "beta": 0.5, "outer_lr": 0.7, **FIRST_FORM}, 3),
    ({"period": 3, "tile": 16, "density": 0.1, "bits": 2, "beta": 0.9, "outer_lr": 0.8}, 9),
    ({"period": 2, "density": 1 / 32, "bits": 4, "beta": 0.95, "outer_lr": 1.0}, 4),
    # Templar's forms on tiles of side 24 (the MLP's 32 x 32 matrices in 16 x 16 tiles, its biases in
    # chunks of 16): each tile a whole 24 x 24 tile's k (58, not 26), the biases whole; then both.
    ({"period": 2, "tile": 24, "density": 0.1, "bits": 2, "beta": 0.9, "outer_lr": 0.8, "fixed_k": True}, 4),
    ({"period": 2, "tile": 24, "density": 0.1, "bits": 2, "beta": 0.9, "outer_lr": 0.8, "dense_vectors": True}, 4),
    (
        {
            "period": 2,
            "tile": 24,
            "density": 0.1,
            "bits": 4,
            "beta": 0.9,
            "outer_lr": 0.8,
            "fixed_k": True,
            "dense_vectors": True,
        },
        4,
    ),
    # Templar's defence: each rank's decoded tensor scaled by min(1, median norm / own norm) before the mean
    ({"period": 2, "density": 1 / 16, "bits": 2, "beta": 0.9, "outer_lr": 0.8, "median_clip": True}, 4),
]


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def train_step(model, opt, x, y) -> float:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def reference_sync(options: dict, k: int, glob: list, errors: list, weights: list) -> list[torch.Tensor]:
    """The hand-written outer step of ``options``' form over per-tensor lists (``errors[r]``: rank
    r's error feedback, updated in place; ``weights[r]``: the weights its inner steps left): the
    first form over the concatenated tensors, ``k`` entries a chunk; the references' tensor by tensor."""
    common = {"beta": options["beta"], "outer_lr": options["outer_lr"], "bits": options["bits"]}
    if options.get("layout") != "flat":
        templar = {k: options.get(k, False) for k in ("fixed_k", "dense_vectors", "median_clip")}
        return sparseloco_tiled_sync(
            glob, errors, weights, side=options.get("tile", 64), density=options["density"], **common, **templar
        )
    cat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    flat_errors = [cat(e) for e in errors]
    out = sparseloco_sync(cat(glob), flat_errors, [cat(w) for w in weights], chunk=options["chunk"], k=k, **common)
    for e, f in zip(errors, flat_errors):
        torch._foreach_copy_(e, [t.view(g.shape) for t, g in zip(f.split([g.numel() for g in glob]), glob)])
    return [t.view(g.shape) for t, g in zip(out.split([g.numel() for g in glob]), glob)]


def check_against_reference() -> list[dict]:
    """Each rank computes every rank's error feedback and the global weights by hand from the
    weights the inner steps left (gathered densely), and compares them with what it holds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for options, steps in CASES:
        torch.manual_seed(0)
        net = MLP()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        inner: list = []  # registered before the wrapper's hook: after the inner step, before the outer one
        opt.register_step_post_hook(lambda o, _a, _k, inner=inner, net=net: inner.append(flat(net)))
        glob = [p.detach().clone() for p in net.parameters()]
        start = flat(net)
        model = unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create("sparseloco", **options))
        state = model.algorithm_state
        errors = [[torch.zeros_like(g) for g in glob] for _ in range(world)]
        gaps, feedback_gaps, spreads, syncs = [], [], [], 0
        for s in range(steps):
            train_step(model, opt, *batch(s, rank))
            spreads.append(spread_across_ranks(net))
            if (s + 1) % options["period"]:
                continue
            weights = [torch.empty_like(start) for _ in range(world)]
            dist.all_gather(weights, inner[-1])
            split = [[t.view(g.shape) for t, g in zip(w.split([g.numel() for g in glob]), glob)] for w in weights]
            glob = reference_sync(options, state.codecs[0].k, glob, errors, split)
            gaps.append(max((p.detach() - g).abs().max().item() for p, g in zip(net.parameters(), glob)))
            held = list(state.by_name(state.errors).values())
            feedback_gaps.append(max((h - e).abs().max().item() for h, e in zip(held, errors[rank])))
            syncs += 1
        out.append(
            {
                "gaps": gaps,
                "feedback_gaps": feedback_gaps,
                "spreads": spreads,
                "period": options["period"],
                "bytes": model.comm_stats["bytes_total"],
                "expected_bytes": syncs * (world - 1) * state.codecs[0].nbytes,
                "moved": (flat(net) - start).abs().max().item(),
            }
        )
        model.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_sync_is_the_hand_written_update(world):
    for rank_results in launch.run(check_against_reference, world, timeout=120):
        for (options, _), r in zip(CASES, rank_results):
            tolerance = (
                1e-6 if options.get("layout") == "flat" else 1e-5
            )  # the bins decode to means, summed in another order
            assert len(r["gaps"]) == len(r["spreads"]) // r["period"] > 0
            assert max(r["gaps"]) < tolerance, (options, r["gaps"])
            assert max(r["feedback_gaps"]) < tolerance, (options, r["feedback_gaps"])
            assert r["moved"] > 1e-3
            for s, spread in enumerate(r["spreads"], 1):
                if s % r["period"] == 0:
                    assert spread == 0.0, (s, r["spreads"])  # bit for bit: the same messages added in order
                else:
                    assert spread > 1e-5, (s, r["spreads"])
            assert r["bytes"] == r["expected_bytes"] > 0


# (spec, save at): between two syncs; and streamed, fragment 1's sync (launched at step 4) in flight
RESUMED = [
    ("sparseloco:period=3,layout=flat,chunk=256,density=0.05,beta=0.9", 5),
    ("sparseloco:period=4,fragments=2,delay=1,tile=16,density=0.05,bits=4", 4),
]
STEPS = 10


def build(spec: str, seed: int):
    torch.manual_seed(seed)
    net = MLP()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    return unison.DataParallel(net, optimizer=opt, algorithm=spec), net, opt


def check_resume(path: str) -> dict:
    """10 steps straight, or 5 (4) + save + other weights + load + the rest: the same bits."""
    rank, out = dist.get_rank(), {}
    for spec, save_at in RESUMED:
        model, net, opt = build(spec, 0)
        for s in range(STEPS):
            train_step(model, opt, *batch(s, rank))
        straight, feedback = flat(net), [e.flat.clone() for e in model.algorithm_state.errors]
        model.close()

        model, net, opt = build(spec, 0)
        for s in range(save_at):
            train_step(model, opt, *batch(s, rank))
        in_flight = bool(model.algorithm_state.streams.inflight)
        unison.save(path, model, opt, step=save_at)
        model.close()

        model, net, opt = build(spec, 1)
        state = unison.load(path, model, opt)
        for s in range(state["step"], STEPS):
            train_step(model, opt, *batch(s, rank))
        out[spec] = {
            "in_flight": in_flight,
            "weights": (flat(net) - straight).abs().max().item(),
            "feedback": max((e.flat - f).abs().max().item() for e, f in zip(model.algorithm_state.errors, feedback)),
            "nonzero_feedback": all(f.abs().sum().item() > 0 for f in feedback),
        }
        model.close()
    return out


def test_save_and_load_resume_exactly(tmp_path):
    for r in launch.run(check_resume, 2, str(tmp_path / "ckpt.pt"), timeout=120):
        assert [r[spec]["in_flight"] for spec, _ in RESUMED] == [False, True]
        for spec, _ in RESUMED:
            assert r[spec]["weights"] == 0.0 and r[spec]["feedback"] == 0.0, (spec, r[spec])
            assert r[spec]["nonzero_feedback"], spec


def check_switch() -> dict:
    """allreduce -> sparseloco (its global weights are the weights) -> allreduce, classic and
    streamed with a sync in flight at the switch: replicas equal after each switch out."""
    rank, out = dist.get_rank(), {"spreads": [], "losses": []}
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model = unison.DataParallel(net, optimizer=opt)
    step = 0
    for spec, steps in (("sparseloco:period=2,tile=16,density=0.1", 5), ("sparseloco:period=4,fragments=2,delay=1", 6)):
        for _ in range(2):
            out["losses"].append(train_step(model, opt, *batch(step % 4, rank)))
            step += 1
        model.switch_to(spec)
        state = model.algorithm_state
        glob = torch.cat([v.reshape(-1) for v in state.by_name(state.globals).values()])
        out.setdefault("global_is_weights", []).append(torch.equal(glob, flat(net)))
        for _ in range(steps):
            out["losses"].append(train_step(model, opt, *batch(step % 4, rank)))
            step += 1
        out.setdefault("drifted", []).append(spread_across_ranks(net) > 0)
        out.setdefault("in_flight", []).append(bool(model.algorithm_state.streams.inflight))
        model.switch_to("allreduce")
        out["spreads"].append(spread_across_ranks(net))
    for _ in range(4):
        out["losses"].append(train_step(model, opt, *batch(step % 4, rank)))
        step += 1
    model.close()
    return out


def test_switch_to_in_and_out():
    for r in launch.run(check_switch, 2, timeout=60):
        assert r["global_is_weights"] == [True, True]
        assert r["drifted"] == [True, True] and r["in_flight"] == [False, True]
        assert r["spreads"] == [0.0, 0.0]
        assert sum(r["losses"][-4:]) < sum(r["losses"][:4])


# ---- hierarchical: 4 ranks as 2 nodes x 2 --------------------------------------------------
NODES = {"UNISON_NODES": "2"}
HIERARCHICAL = {"period": 2, "chunk": 256, "density": 0.05, "bits": 2, "beta": 0.9, "outer_lr": 0.8, **FIRST_FORM}


def check_hierarchical() -> dict:
    """Every sync against the hand-written two-level update: each node's mean pseudo-gradient,
    each local rank's shard (whole chunks) folded into that node's error feedback of the shard,
    its quantized top-k averaged over the nodes; and the bytes inside and across nodes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = unison.topology()
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    inner: list = []
    opt.register_step_post_hook(lambda o, _a, _k: inner.append(flat(net)))
    glob = flat(net)
    spec = unison.algorithms.create("sparseloco", hierarchical=True, **HIERARCHICAL)
    model = unison.DataParallel(net, optimizer=opt, algorithm=spec)
    state = model.algorithm_state
    codec, levels, part = state.codecs[0], state.levels, state.node_parts[0]
    padded, size = state.tiles[0].numel, state.tiles[0].runs[0].size
    nodes, local = topo.num_nodes, topo.local_world_size
    bounds = part.bounds
    errors = [[torch.zeros(bounds[j + 1] - bounds[j]) for j in range(local)] for _ in range(nodes)]
    gaps, feedback_gaps, spreads, syncs = [], [], [], 0
    for s in range(6):
        train_step(model, opt, *batch(s, rank))
        spreads.append(spread_across_ranks(net))
        if (s + 1) % HIERARCHICAL["period"]:
            continue
        weights = [torch.empty_like(glob) for _ in range(world)]
        dist.all_gather(weights, inner[-1])
        update = torch.zeros(padded)
        for j in range(local):
            a, b = bounds[j], bounds[j + 1]
            if b == a:
                continue
            for n in range(nodes):
                delta = torch.zeros(padded)
                delta[: glob.numel()] = torch.stack([glob - weights[n * local + i] for i in range(local)]).mean(0)
                e = errors[n][j].mul_(HIERARCHICAL["beta"]).add_(delta[a:b])
                sent = quantized_topk(e, size, codec.k, HIERARCHICAL["bits"])
                e.sub_(sent)
                update[a:b] += sent / nodes
        glob = glob - HIERARCHICAL["outer_lr"] * update[: glob.numel()]
        gaps.append((flat(net) - glob).abs().max().item())
        start, end = levels.shard(bounds)
        mine = errors[topo.node][topo.local_rank]
        feedback_gaps.append((state.errors[0].flat[start:end] - mine).abs().max().item())
        syncs += 1
    out = {
        "gaps": gaps,
        "feedback_gaps": feedback_gaps,
        "spreads": spreads,
        "bytes": model.comm_stats["bytes_total"],
        "cross": levels.inter_bytes,
        "expected_cross": syncs * (nodes - 1) * part.codec.nbytes,
        "expected_bytes": syncs * (2 * levels.leg_bytes(padded, 4, bounds) + (nodes - 1) * part.codec.nbytes),
        "flat_bytes": syncs * (world - 1) * codec.nbytes,
        "moved": (glob - inner[0]).abs().max().item(),
    }
    model.close()
    return out


def test_hierarchical_sums_in_the_node_and_sends_only_the_sparse_form_across():
    for r in launch.run(check_hierarchical, 4, env=NODES, timeout=120):
        assert len(r["gaps"]) == 3 and max(r["gaps"]) < 1e-5, r["gaps"]
        assert max(r["feedback_gaps"]) < 1e-5, r["feedback_gaps"]
        assert r["moved"] > 1e-3
        assert [s for i, s in enumerate(r["spreads"], 1) if i % 2 == 0] == [0.0, 0.0, 0.0]  # the same bits everywhere
        assert r["cross"] == r["expected_cross"] > 0
        assert r["bytes"] == r["expected_bytes"]
        assert r["cross"] < r["flat_bytes"] / 4  # across nodes: one shard's message per node, not every rank's


HIERARCHICAL_TILED = {"period": 2, "tile": 16, "density": 0.1, "bits": 2, "beta": 0.9, "outer_lr": 0.8}


def check_hierarchical_tiled() -> dict:
    """The references' form on 2 x 2 against the two-level update written plainly: the layout's
    chunks (``tile_positions`` of each tensor, in order) cut between the local ranks where the
    algorithm cuts them; each node's mean pseudo-gradient folded into its error feedback of each
    shard, each chunk's top-k, binned together per tensor's piece of the shard, and each
    coordinate averaged over the nodes that sent it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = unison.topology()
    nodes, local = topo.num_nodes, topo.local_world_size
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    inner: list = []
    opt.register_step_post_hook(lambda o, _a, _k: inner.append(flat(net)))
    glob = flat(net)
    model = unison.DataParallel(
        net, optimizer=opt, algorithm=unison.algorithms.create("sparseloco", hierarchical=True, **HIERARCHICAL_TILED)
    )
    state = model.algorithm_state
    shapes = [p.shape for p in net.parameters()]
    starts = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    chunks = []  # (tensor, positions in the flat weights, -1 for padding), in the layout's order
    for t, shape in enumerate(shapes):
        for positions in tile_positions(tuple(shape), HIERARCHICAL_TILED["tile"]):
            chunks.append((t, torch.where(positions >= 0, positions + starts[t], -1)))
    edges = [0]
    for _, positions in chunks:
        edges.append(edges[-1] + len(positions))
    cuts = [edges.index(b) for b in state.node_parts[0].bounds]  # the shards, in chunks
    errors = {(n, c): torch.zeros(len(chunks[c][1])) for n in range(nodes) for c in range(len(chunks))}
    gaps, spreads = [], []
    for s in range(6):
        train_step(model, opt, *batch(s, rank))
        spreads.append(spread_across_ranks(net))
        if (s + 1) % HIERARCHICAL_TILED["period"]:
            continue
        weights = [torch.empty_like(glob) for _ in range(world)]
        dist.all_gather(weights, inner[-1])
        total, count = torch.zeros_like(glob), torch.zeros_like(glob)
        for n in range(nodes):
            delta = torch.stack([glob - weights[n * local + i] for i in range(local)]).mean(0)
            for j in range(local):
                picked: dict = {}  # tensor -> [(chunk, place in chunk, value)]
                for c in range(cuts[j], cuts[j + 1]):
                    t, positions = chunks[c]
                    e = errors[(n, c)]
                    e.mul_(HIERARCHICAL_TILED["beta"]).add_(
                        torch.where(positions >= 0, delta[positions.clamp(min=0)], 0.0)
                    )
                    k = min(len(e), max(1, round(HIERARCHICAL_TILED["density"] * len(e))))
                    for i in torch.argsort(e.abs(), descending=True)[:k].tolist():
                        picked.setdefault(t, []).append((c, i, e[i].clone()))
                for entries in picked.values():
                    decoded = binned(torch.stack([v for _, _, v in entries]), HIERARCHICAL_TILED["bits"])
                    for (c, i, _), v in zip(entries, decoded):
                        where = int(chunks[c][1][i])
                        if where >= 0:  # padding sent stays out of the error feedback
                            errors[(n, c)][i] -= v
                        if where >= 0 and v != 0:
                            total[where] += v
                            count[where] += 1
        glob = glob - HIERARCHICAL_TILED["outer_lr"] * total / count.clamp(min=1)
        gaps.append((flat(net) - glob).abs().max().item())
    part = state.node_parts[0]
    out = {"gaps": gaps, "spreads": spreads, "cross": state.levels.inter_bytes, "message": part.codec.nbytes}
    model.close()
    return out


def test_hierarchical_references_form_is_the_two_level_update_written_plainly():
    for r in launch.run(check_hierarchical_tiled, 4, env=NODES, timeout=120):
        assert len(r["gaps"]) == 3 and max(r["gaps"]) < 1e-5, r["gaps"]
        assert [s for i, s in enumerate(r["spreads"], 1) if i % 2 == 0] == [0.0, 0.0, 0.0]
        assert r["cross"] == 3 * r["message"] > 0  # 3 syncs, one message to the one other node


def one_node() -> bool:
    torch.manual_seed(0)
    net = MLP()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model = unison.DataParallel(net, optimizer=opt, algorithm="sparseloco:hierarchical=true,period=2")
    for s in range(2):
        train_step(model, opt, *batch(s, dist.get_rank()))
    levels = model.algorithm_state.levels
    model.close()
    return levels is None and spread_across_ranks(net) == 0.0


def test_hierarchical_on_one_node_runs_flat():
    assert all(launch.run(one_node, 2, timeout=60))
