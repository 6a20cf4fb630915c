"""Throughput of unison's gradient codecs on one CPU thread, against a plain copy.

Each codec works on the gradients of ``common.mlp()`` (about 22M float32
values, one flat buffer as in a bucket): the fp16 and bf16 casts (there and
back), bytegrad's 8-bit min-max encode and decode (``MinMax8``, one row per
rank of a 2-rank group), and PowerSGD rank-4 compress (P = M Q, orthogonalize,
Q = M^T P) and decompress with error feedback (M - P Q^T kept, P Q^T written)
on the MLP's matrices. Throughput is float32 gradient bytes per second (the input of an
encode, the output of a decode), the median of ``--reps`` repetitions, next to
``dst.copy_(src)`` of the same bytes measured in the same run.

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

from unison.algorithms.gradient import powersgd
from unison.engine.codecs import LowRank, MinMax8

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per codec (median)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--rows", type=int, default=2, help="MinMax8 rows (ranks of the group)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="MinMax8 values per chunk")
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

    cases = {**cast_cases(flat), **minmax_cases(flat, args.rows, args.chunk_size), **powersgd_cases(mats, args.rank)}
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
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
