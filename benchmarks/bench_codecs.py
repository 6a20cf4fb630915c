"""Throughput of unison's gradient codecs on one CPU thread, against a plain copy.

Each codec works on the gradients of ``common.mlp()`` (about 22M float32
values, one flat buffer as in a bucket): the fp16 and bf16 casts (there and
back), bytegrad's 8-bit min-max encode and decode (``MinMax8``, one row per
rank of a 2-rank group), and PowerSGD rank-4 compress (P = M Q, orthogonalize,
Q = M^T P) and decompress with error feedback (M - P Q^T kept, P Q^T written)
on the MLP's matrices, and the low-bandwidth codecs at their defaults: sparseloco's
tile-wise top-k with 2-bit binned values (``engine.codecs.tiled_topk.TiledTopK``: encode with error feedback,
one message's decode-add) and demo's per-bucket work (the momentum, the DCT per chunk,
the top-k, the inverse DCT of what is kept; a decode: one message added; the inverse DCT of the average).
Throughput is float32 gradient bytes per second (the input of an
encode, the output of a decode), the median of ``--reps`` repetitions, next to
``dst.copy_(src)`` of the same bytes measured in the same run.

    flock /tmp/unison-tests.lock python benchmarks/bench_codecs.py --json benchmarks/results/frontier_codecs.json

The ``frontier`` block sets the two against a training step of the bench's charlm
(``--frontier-size``, default large: 10.7M parameters; forward, backward and AdamW, batch
32 x 64 characters, one thread): demo encodes once and decodes ``W`` messages every step,
sparseloco once per ``period`` steps (the cost per step is the sync's over 16).

    flock /tmp/unison-test.lock python benchmarks/bench_codecs.py --json

Prints a table; ``--json`` writes benchmarks/results/codecs.json (or the path given).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
from common import WORKLOADS

import unison
from unison.algorithms.gradient import powersgd
from unison.engine.codecs import LowRank, MinMax8, dct
from unison.engine.codecs.tiled_topk import TiledTopK
from unison.engine.codecs.tiles import TiledBuffer, Tiles

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(HERE, "results", "codecs.json")


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cast_cases(flat: torch.Tensor) -> dict:
    """The cast codecs: float32 bucket to the wire dtype and back (what ``unison.algorithms.gradient.cast`` runs)."""
    cases = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        wire = torch.empty(flat.numel(), dtype=dtype)
        back = torch.empty_like(flat)
        cases[f"{name} encode"] = (lambda w=wire: w.copy_(flat), flat.numel())
        cases[f"{name} decode"] = (lambda w=wire, b=back: b.copy_(w), flat.numel())
    return cases


def minmax_cases(flat: torch.Tensor, rows: int, chunk_size: int) -> dict:
    """bytegrad's codec: the bucket (``rows`` parts) into 8-bit messages and back."""
    codec = MinMax8(flat.numel(), rows=rows, chunk_size=chunk_size)
    message = codec.empty()
    out = torch.empty_like(flat)
    codec.encode_from(flat, message)
    return {
        "minmax8 encode": (lambda: codec.encode_from(flat, message), flat.numel()),
        "minmax8 decode": (lambda: codec.decode_into(message, out), flat.numel()),
    }


def powersgd_cases(mats: list[torch.Tensor], rank: int) -> dict:
    """PowerSGD's local work on every compressible matrix (``LowRank``, as ``unison.algorithms.gradient.powersgd`` runs it)."""
    low = LowRank([m.shape for m in mats], rank)
    low.q_flat.copy_(torch.randn(low.q_flat.shape, generator=torch.Generator().manual_seed(0)))
    residuals = [torch.zeros_like(m) for m in mats]

    def compress():
        low.compute_p(mats)
        low.orthogonalize_p()
        low.compute_q(mats)

    numel = sum(m.numel() for m in mats)
    return {
        f"powersgd r{rank} compress": (compress, numel),
        f"powersgd r{rank} decompress+ef": (lambda: low.finish(mats, residuals), numel),
    }


def sparseloco_cases(flat: torch.Tensor) -> dict:
    """sparseloco's codec at its defaults: top-k of each 64 x 64 tile (the values seen as a matrix
    of 4096 columns) with 2-bit binned values, from an error feedback that keeps the rest
    (encode), and one rank's message averaged into the global weights (decode)."""
    algo = unison.algorithms.create("sparseloco")
    rows = max(1, flat.numel() // 4096)
    values = flat[: rows * 4096] if flat.numel() >= 4096 else flat
    shape = torch.Size([rows, 4096]) if flat.numel() >= 4096 else values.shape
    tiles = Tiles([shape], algo.layout, algo.size, algo.density, algo.topk)
    codec = TiledTopK(tiles.runs, algo.bits, algo.quantizer)
    error, target = TiledBuffer(tiles, flat.device), torch.zeros(tiles.numel)
    error.load([values.view(shape)])
    message = codec.encode(error.flat.clone(), codec.empty())
    return {
        "sparseloco encode": (lambda: codec.encode(error.flat, message), values.numel()),
        "sparseloco decode": (lambda: codec.mean_into(message[None], target, -1.0), values.numel()),
    }


def demo_cases(flat: torch.Tensor) -> dict:
    """demo's per-bucket work at its defaults (engine.codecs.dct): encode = ``m = beta m + g``, the DCT of
    each chunk, the top-k taken out, the inverse DCT of the rest; decode = one message added into
    the average (once per rank); inverse = the average's inverse DCT (once per bucket)."""
    algo = unison.algorithms.create("demo")
    n = -(-flat.numel() // algo.chunk) * algo.chunk
    grad = torch.zeros(n)
    grad[: flat.numel()].copy_(flat)
    momentum, target = torch.zeros(n), torch.zeros(n)
    d = dct.dct_matrix(algo.chunk)
    dt = d.t().contiguous()
    scratch = torch.empty(1 << 16)
    codec = dct.codec(n, algo.chunk, algo.topk, algo.value_bits, torch.device("cpu"), scratch, algo._scale)
    message = codec.empty()

    def encode() -> None:
        momentum.mul_(algo.beta).add_(grad)
        rows = momentum.view(-1, algo.chunk)
        dct.transform_(rows, dt, scratch)
        codec.encode(momentum, message)
        dct.transform_(rows, d, scratch)

    return {
        "demo encode": (encode, flat.numel()),
        "demo decode": (lambda: codec.decode_add(message, target, 0.25), flat.numel()),
        "demo inverse": (lambda: dct.transform_(target.view(-1, algo.chunk), d, scratch), flat.numel()),
    }


def charlm_step_seconds(size: str, reps: int) -> tuple[float, int]:
    """Median seconds of one charlm training step (forward, backward, AdamW; batch 32 x 64) and its parameters."""
    from unison.apps.workloads import charlm

    net = charlm.build(0, 100, 64, **charlm.SIZES[size])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 100, (32, 64), generator=g), torch.randint(0, 100, (32, 64), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        charlm.loss_fn(net(x), y).backward()
        opt.step()

    return median_seconds(step, max(3, reps // 2)), sum(p.numel() for p in net.parameters())


def frontier(rows: list[dict], size: str, reps: int, world: int) -> dict:
    """The low-bandwidth codecs' cost in a training step of charlm ``size`` on ``world`` ranks, from
    their measured ms per MB: demo encodes once, decodes ``world`` messages and takes one inverse DCT
    every step; sparseloco encodes once and decodes ``world`` messages once per sync (period 16)."""
    step_s, params = charlm_step_seconds(size, reps)
    mb = params * 4 / 1e6
    per_mb = {r["codec"]: r["ms"] / (r["bytes"] / 1e6) for r in rows}
    period = unison.algorithms.create("sparseloco").period
    demo_ms = mb * (per_mb["demo encode"] + world * per_mb["demo decode"] + per_mb["demo inverse"])
    sync_ms = mb * (per_mb["sparseloco encode"] + world * per_mb["sparseloco decode"])
    step_ms = step_s * 1e3
    return {
        "model": f"charlm {size}",
        "params": params,
        "world": world,
        "step_ms": step_ms,
        "ms_per_mb": {k: v for k, v in per_mb.items() if k.startswith(("demo", "sparseloco"))},
        "demo_ms_per_step": demo_ms,
        "demo_share_of_step": demo_ms / step_ms,
        "sparseloco_ms_per_sync": sync_ms,
        "sparseloco_period": period,
        "sparseloco_share_of_step": sync_ms / period / step_ms,
        "sparseloco_sync_vs_step": sync_ms / step_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per codec (median)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--rows", type=int, default=2, help="MinMax8 rows (ranks of the group)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="MinMax8 values per chunk")
    parser.add_argument("--frontier-size", default="large", help="charlm size the codecs are set against")
    parser.add_argument("--world", type=int, default=4, help="ranks whose messages each rank decodes (frontier)")
    parser.add_argument(
        "--json",
        nargs="?",
        const=DEFAULT_JSON,
        default=None,
        metavar="PATH",
        help=f"write results (default path {DEFAULT_JSON})",
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = list(WORKLOADS[args.workload][0]().parameters())
    numel = sum(p.numel() for p in params)
    flat = torch.randn(numel) * 1e-3
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    mats = [v.reshape(v.shape[0], -1) for v in views if powersgd.is_compressible(v.shape, args.rank, 2.0)]

    cases = {
        **cast_cases(flat),
        **minmax_cases(flat, args.rows, args.chunk_size),
        **powersgd_cases(mats, args.rank),
        **sparseloco_cases(flat),
        **demo_cases(flat),
    }
    rows = []
    for name, (fn, count) in cases.items():
        src, dst = torch.randn(count), torch.empty(count)
        copy_s = median_seconds(functools.partial(dst.copy_, src), args.reps)
        codec_s = median_seconds(fn, args.reps)
        nbytes = count * 4
        rows.append(
            {
                "codec": name,
                "bytes": nbytes,
                "ms": codec_s * 1e3,
                "gbps": nbytes / codec_s / 1e9,
                "copy_gbps": nbytes / copy_s / 1e9,
                "vs_copy": copy_s / codec_s,
            }
        )
        del src, dst

    print(f"{'codec':<24} {'MB':>7} {'ms':>8} {'GB/s':>7} {'copy GB/s':>10} {'x copy':>7}")
    for r in rows:
        print(
            f"{r['codec']:<24} {r['bytes'] / 1e6:7.1f} {r['ms']:8.2f} {r['gbps']:7.2f} {r['copy_gbps']:10.2f} {r['vs_copy']:7.2f}"
        )
    front = frontier(rows, args.frontier_size, args.reps, args.world)
    print(
        f"{front['model']} ({front['params']:,} parameters), one step {front['step_ms']:.0f} ms on one thread: "
        f"demo's codec {front['demo_ms_per_step']:.0f} ms a step ({front['demo_share_of_step']:.1%}), "
        f"sparseloco's {front['sparseloco_ms_per_sync']:.0f} ms a sync "
        f"({front['sparseloco_share_of_step']:.2%} of a step at period {front['sparseloco_period']}), {args.world} ranks"
    )
    if args.json:
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "workload": args.workload,
            "numel": numel,
            "reps": args.reps,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "frontier": front}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
