"""Throughput of unison's codecs on one device, each schedule beside a copy of the same bytes.

Every codec an algorithm sends with, on ``--numel`` float32 values (default: the
gradients of ``common.mlp()``, about 22M, one flat buffer as in a bucket): the fp16 and
bf16 casts in the buffer's own bytes (``halfcast``, there and back), 8-bit min-max
(``MinMax8``: encode, with error feedback, decode, decode-add, the sum of 4 rows
re-encoded), the chunk-wise top-k (``TopK``), sparseloco's tiled top-k at its defaults
(``TiledTopK``: encode with error feedback, the mean of 4 messages over their senders),
demo's per-bucket work at its defaults (the momentum, the DCT per chunk, the top-k, the
inverse DCT of what is kept; 4 messages added; the inverse DCT of the average) and
PowerSGD rank 4 (compress: P = M Q, orthogonalize, Q = M^T P; decompress with error
feedback) on matrices of GPT-2's widths (768 and 3072 columns).

Each codec runs in each of its schedules (``unison.engine.codecs.schedule``): on the CPU
the blocked loop and the GPU's whole-buffer schedule forced on the CPU; elsewhere the
whole one. With ``--baseline REV`` the codecs of git revision REV (today's code, say)
run beside them, from a copy of that revision's modules. Contenders alternate within
each of ``--rounds`` rounds; each measurement is the median of ``--reps`` calls next to
``dst.copy_(src)`` of the same float32 bytes timed right before it (``vs_copy``: the
copy's time over the codec's, 1.0 = as fast as a copy); the table shows each
contender's best round (the casts alone vary up to 20% from run to run here).

    python benchmarks/bench_codecs.py --baseline cd4f050 --json   # CPU, one thread
    python benchmarks/bench_codecs.py --device cuda --numel 124000000 --json benchmarks/results/codecs_cuda.json

``--count-ops 4194304,67108864`` counts instead the ops one call of each case issues on the
``meta`` device (where a GPU's schedule runs without a GPU), in each schedule: the whole
schedule's count must not grow with the values.

``--frontier`` also sets demo's and sparseloco's codecs against a charlm training step
(``--frontier-size``, default large: 10.7M parameters; one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, Iterator, Optional

import torch
from common import WORKLOADS

import unison
from unison.algorithms.gradient import powersgd
from unison.engine.codecs import schedule as schedules

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "codecs.json")
MODULES = ("minmax8", "lowrank", "halfcast", "topk", "tiles", "tiled_topk", "dct")
Case = tuple[Callable[[], object], int]


def codecs_of(rev: Optional[str]) -> types.SimpleNamespace:
    """The codec modules of git revision ``rev`` (None: this checkout's), by today's names.

    Before the codecs had a package (unison/engine/codecs/), 8-bit min-max and PowerSGD's
    factors lived in engine/codecs.py and the others beside it in engine/."""
    if rev is None:
        return types.SimpleNamespace(**{m: importlib.import_module(f"unison.engine.codecs.{m}") for m in MODULES})
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    name = f"codecs_{sha.stdout.strip()}"
    folder = os.path.join(tempfile.mkdtemp(), name)
    os.makedirs(folder)
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "unison/engine/codecs/"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    packaged = any(path.endswith("codecs/__init__.py") for path in listed)
    paths = (
        [p for p in listed if p.endswith(".py")]
        if packaged
        else [f"unison/engine/{m}.py" for m in ("codecs", "halfcast", "topk", "tiles", "tiled_topk", "dct")]
    )
    for path in paths:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True)
        with open(os.path.join(folder, os.path.basename(path)), "w") as f:
            f.write(text.stdout)
    if not packaged:
        open(os.path.join(folder, "__init__.py"), "w").close()
    sys.path.insert(0, os.path.dirname(folder))
    found = {m: f"{name}.{m}" if packaged or m not in ("minmax8", "lowrank") else f"{name}.codecs" for m in MODULES}
    return types.SimpleNamespace(**{m: importlib.import_module(path) for m, path in found.items()})


@contextlib.contextmanager
def forced(schedule: Optional[str]) -> Iterator[None]:
    """Every codec built and every codec function called inside runs ``schedule`` (None: as is)."""
    before = os.environ.get(schedules.ENV)
    if schedule is not None:
        os.environ[schedules.ENV] = schedule
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(schedules.ENV, None)
        else:
            os.environ[schedules.ENV] = before


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs, after one warm-up run, the device drained around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cast_cases(c: types.SimpleNamespace, flat: torch.Tensor) -> dict[str, Case]:
    """The casts of ``fp16`` / ``bf16`` (and DiLoCo's, DASO's wire dtype): the bucket narrowed
    in its own bytes and widened back (what ``unison.algorithms.gradient.cast`` runs)."""
    cases = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        buffer = flat.clone()

        def there_and_back(b: torch.Tensor = buffer, d: torch.dtype = dtype) -> None:
            c.halfcast.widen_(c.halfcast.narrow_(b, d), b)

        cases[f"{name} narrow+widen"] = (there_and_back, flat.numel())
    return cases


def minmax_cases(c: types.SimpleNamespace, flat: torch.Tensor, rows: int, chunk_size: int) -> dict[str, Case]:
    """bytegrad's, qadam's and low_precision_decentralized's codec: the bucket (``rows`` parts)
    into 8-bit messages and back; the sum of 4 ranks' rows re-encoded (bytegrad's reduce)."""
    n, device = flat.numel(), flat.device
    codec = c.minmax8.MinMax8(n, rows=rows, chunk_size=chunk_size, device=device)
    message, out, feedback = codec.empty(), torch.empty_like(flat), torch.zeros_like(flat)
    codec.encode_from(flat, message)
    four = c.minmax8.MinMax8(n, rows=4, chunk_size=chunk_size, device=device)
    received, reduced = four.empty(), four.empty(1)
    four.encode_from(flat, received)
    return {
        "minmax8 encode": (lambda: codec.encode_from(flat, message), n),
        "minmax8 encode+ef": (lambda: codec.encode_from(flat, message, feedback=feedback), n),
        "minmax8 decode": (lambda: codec.decode_into(message, out), n),
        "minmax8 decode_add": (lambda: codec.decode_add(message, out), n),
        "minmax8 sum_encode 4": (lambda: four.sum_encode(received, reduced), n),
    }


def powersgd_cases(c: types.SimpleNamespace, mats: list[torch.Tensor], rank: int) -> dict[str, Case]:
    """PowerSGD's local work on every compressible matrix (``LowRank``, as ``powersgd`` runs it)."""
    device = mats[0].device
    low = c.lowrank.LowRank([m.shape for m in mats], rank, device=device)
    low.q_flat.copy_(torch.randn(low.q_flat.shape, generator=torch.Generator().manual_seed(0)))
    residuals = [torch.zeros_like(m) for m in mats]

    def compress() -> None:
        low.compute_p(mats)
        low.orthogonalize_p()
        low.compute_q(mats)

    numel = sum(m.numel() for m in mats)
    return {
        f"powersgd r{rank} compress": (compress, numel),
        f"powersgd r{rank} decompress+ef": (lambda: low.finish(mats, residuals), numel),
    }


def topk_cases(c: types.SimpleNamespace, flat: torch.Tensor) -> dict[str, Case]:
    """The chunk-wise top-k (``TopK``: chunks of 4096, 1/64 of each sent in 2 bits), encode with
    error feedback and one message added."""
    codec = c.topk.TopK(flat.numel(), chunk=4096, density=1 / 64, bits=2, device=flat.device)
    error = torch.zeros(codec.padded, device=flat.device)
    error[: flat.numel()].copy_(flat)
    target = torch.zeros(codec.padded, device=flat.device)
    message = codec.encode(error.clone(), codec.empty())
    return {
        "topk encode": (lambda: codec.encode(error, message), flat.numel()),
        "topk decode_add": (lambda: codec.decode_add(message, target), flat.numel()),
    }


def sparseloco_cases(c: types.SimpleNamespace, flat: torch.Tensor) -> dict[str, Case]:
    """sparseloco's codec at its defaults: top-k of each 64 x 64 tile (the values seen as a matrix
    of 4096 columns) with 2-bit binned values, from an error feedback that keeps the rest
    (encode), and 4 ranks' messages averaged over their senders into the global weights."""
    algo = unison.algorithms.create("sparseloco")
    rows = max(1, flat.numel() // 4096)
    values = flat[: rows * 4096] if flat.numel() >= 4096 else flat
    shape = torch.Size([rows, 4096]) if flat.numel() >= 4096 else values.shape
    tiles = c.tiles.Tiles([shape], algo.layout, algo.size, algo.density, algo.topk)
    codec = c.tiled_topk.TiledTopK(tiles.runs, algo.bits, algo.quantizer, device=flat.device)
    error, target = c.tiles.TiledBuffer(tiles, flat.device), torch.zeros(tiles.numel, device=flat.device)
    error.load([values.view(shape)])
    message = codec.encode(error.flat.clone(), codec.empty())
    four = torch.stack([message] * 4)
    return {
        "sparseloco encode": (lambda: codec.encode(error.flat, message), values.numel()),
        "sparseloco mean_into 4": (lambda: codec.mean_into(four, target, -1.0), values.numel()),
    }


def demo_cases(c: types.SimpleNamespace, flat: torch.Tensor) -> dict[str, Case]:
    """demo's per-bucket work at its defaults (``dct``): encode = ``m = beta m + g``, the DCT of
    each chunk, the top-k taken out, the inverse DCT of the rest; decode = 4 messages added
    into the average; inverse = the average's inverse DCT (once per bucket)."""
    algo = unison.algorithms.create("demo")
    device = flat.device
    n = -(-flat.numel() // algo.chunk) * algo.chunk
    grad = torch.zeros(n, device=device)
    grad[: flat.numel()].copy_(flat)
    momentum, target = torch.zeros(n, device=device), torch.zeros(n, device=device)
    d = c.dct.dct_matrix(algo.chunk, device=device)
    dt = d.t().contiguous()
    scratch = torch.empty(1 << 16, device=device)
    codec = c.dct.codec(n, algo.chunk, algo.topk, algo.value_bits, device, scratch, algo._scale)
    message = codec.empty()

    def encode() -> None:
        momentum.mul_(algo.beta).add_(grad)
        rows = momentum.view(-1, algo.chunk)
        c.dct.transform_(rows, dt, scratch)
        codec.encode(momentum, message)
        c.dct.transform_(rows, d, scratch)

    four = torch.stack([message] * 4)

    def decode() -> None:
        add_all = getattr(codec, "add_all", None)  # demo's mean: the messages read once, a scatter-add each
        if add_all is not None:
            add_all(four, target, 0.25)
        else:  # before add_all
            for _ in range(4):
                codec.decode_add(message, target, 0.25)

    return {
        "demo encode": (encode, flat.numel()),
        "demo decode 4": (decode, flat.numel()),
        "demo inverse": (lambda: c.dct.transform_(target.view(-1, algo.chunk), d, scratch), flat.numel()),
    }


def build_cases(c: types.SimpleNamespace, flat: torch.Tensor, mats: list[torch.Tensor], args) -> dict[str, Case]:
    return {
        **cast_cases(c, flat),
        **minmax_cases(c, flat, args.rows, args.chunk_size),
        **topk_cases(c, flat),
        **sparseloco_cases(c, flat),
        **demo_cases(c, flat),
        **powersgd_cases(c, mats, args.rank),
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

    return median_seconds(step, max(3, reps // 2), torch.device("cpu")), sum(p.numel() for p in net.parameters())


def frontier(rows: list[dict], size: str, reps: int, world: int) -> dict:
    """The low-bandwidth codecs' cost in a training step of charlm ``size`` on ``world`` ranks, from
    their measured ms per MB: demo encodes once, decodes ``world`` messages and takes one inverse DCT
    every step; sparseloco encodes once and decodes ``world`` messages once per sync (period 16)."""
    step_s, params = charlm_step_seconds(size, reps)
    mb = params * 4 / 1e6
    per_mb = {r["codec"]: r["ms"] / (r["bytes"] / 1e6) for r in rows}
    period = unison.algorithms.create("sparseloco").period
    demo_ms = mb * (per_mb["demo encode"] + world * per_mb["demo decode 4"] / 4 + per_mb["demo inverse"])
    sync_ms = mb * (per_mb["sparseloco encode"] + world * per_mb["sparseloco mean_into 4"] / 4)
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


def count_ops(args: argparse.Namespace) -> list[dict]:
    """The ops one call of each case issues on ``meta``, per schedule and size (``--count-ops``)."""
    sys.path.insert(0, ROOT)
    from tests.unit.codecs.ops import ops

    meta, sizes = torch.device("meta"), [int(n) for n in args.count_ops.split(",")]
    counts: dict[str, dict[str, object]] = {}
    for schedule in (args.schedules or "blocked,whole").split(","):
        for numel in sizes:
            flat = torch.empty(numel, device=meta)
            with forced(schedule):
                cases = build_cases(codecs_of(None), flat, gpt2_matrices(numel, meta), args)
                for name, (fn, _) in cases.items():
                    if args.only is None or args.only in name:
                        try:
                            counted: object = ops(fn)
                        except (RuntimeError, NotImplementedError) as error:
                            counted = f"n/a: {str(error).splitlines()[0][:60]}"
                        counts.setdefault(name, {"codec": name})[f"{schedule} {numel}"] = counted
    columns = [f"{s} {n}" for s in (args.schedules or "blocked,whole").split(",") for n in sizes]
    print(f"{'codec':<26} " + " ".join(f"{c:>16}" for c in columns))
    for row in counts.values():
        print(f"{row['codec']:<26} " + " ".join(f"{str(row.get(c, '')):>16}" for c in columns))
    return list(counts.values())


def gpt2_matrices(numel: int, device: torch.device) -> list[torch.Tensor]:
    """About ``numel`` values in matrices of GPT-2's widths: 768 and 3072 columns, two of each."""
    rows = max(1, numel // (2 * (768 + 3072)))
    return [torch.randn(rows, cols, device=device) * 1e-3 for cols in (768, 3072, 768, 3072)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="where the codecs run (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--numel", type=int, default=None, help="values per buffer (default: the workload's)")
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument(
        "--schedules",
        default=None,
        help="schedules to run, comma-separated (default: blocked,whole on cpu, else whole)",
    )
    parser.add_argument("--baseline", default=None, metavar="REV", help="also run the codecs of git revision REV")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, contenders alternating (best round shown)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median)")
    parser.add_argument("--only", default=None, help="run only the codecs whose names contain this text")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--rows", type=int, default=2, help="MinMax8 rows (ranks of the group)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="MinMax8 values per chunk")
    parser.add_argument("--count-ops", default=None, metavar="N,N", help="count ops on meta at these sizes instead")
    parser.add_argument("--frontier", action="store_true", help="set demo and sparseloco against a charlm step")
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

    if args.count_ops:
        counted = count_ops(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "meta": {"command": " ".join(["python", "benchmarks/bench_codecs.py", *sys.argv[1:]])},
                        "ops": counted,
                    },
                    f,
                    indent=1,
                )
        return
    device = torch.device(args.device)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.numel is None:
        params = list(WORKLOADS[args.workload][0]().parameters())
        numel = sum(p.numel() for p in params)
        flat = (torch.randn(numel) * 1e-3).to(device)
        views, offset = [], 0
        for p in params:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        mats = [v.reshape(v.shape[0], -1) for v in views if powersgd.is_compressible(v.shape, args.rank, 2.0)]
    else:
        numel = args.numel
        flat = torch.randn(numel, device=device) * 1e-3
        mats = gpt2_matrices(numel, device)
    default = "blocked,whole" if device.type == "cpu" else "whole"
    contenders: list[tuple[str, Optional[str], types.SimpleNamespace]] = [
        (s, s, codecs_of(None)) for s in (args.schedules or default).split(",")
    ]
    if args.baseline:
        contenders.insert(0, (f"at {args.baseline}", None, codecs_of(args.baseline)))
    built = {}
    for label, schedule, c in contenders:
        with forced(schedule):
            built[label] = build_cases(c, flat, mats, args)
    names = [n for n in built[contenders[0][0]] if args.only is None or args.only in n]
    best: dict[tuple[str, str], dict] = {}
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for name in names:
            for label, schedule, _ in order:
                fn, count = built[label][name]
                copy_s = median_seconds(functools.partial(dst[:count].copy_, src[:count]), args.reps, device)
                with forced(schedule):
                    codec_s = median_seconds(fn, args.reps, device)
                nbytes = count * 4
                row = {
                    "codec": name,
                    "contender": label,
                    "bytes": nbytes,
                    "ms": codec_s * 1e3,
                    "gbps": nbytes / codec_s / 1e9,
                    "copy_ms": copy_s * 1e3,
                    "copy_gbps": nbytes / copy_s / 1e9,
                    "vs_copy": copy_s / codec_s,
                }
                if (name, label) not in best or row["vs_copy"] > best[name, label]["vs_copy"]:
                    best[name, label] = row
    rows = [best[n, label] for n in names for label, _, _ in contenders]
    first = contenders[0][0]
    for row in rows:
        row["vs_first"] = row["vs_copy"] / best[row["codec"], first]["vs_copy"]
    print(f"{device} ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}), {numel:,} values")
    print(f"{'codec':<26} {'contender':<14} {'ms':>9} {'GB/s':>7} {'copy GB/s':>10} {'vs_copy':>8} {'/ ' + first:>12}")
    for r in rows:
        print(
            f"{r['codec']:<26} {r['contender']:<14} {r['ms']:9.2f} {r['gbps']:7.2f} {r['copy_gbps']:10.2f} "
            f"{r['vs_copy']:8.3f} {r['vs_first']:12.3f}"
        )
    front = None
    if args.frontier:
        blocked = [r for r in rows if r["contender"] == contenders[-1][0]]
        front = frontier(blocked, args.frontier_size, args.reps, args.world)
        print(
            f"{front['model']} ({front['params']:,} parameters), one step {front['step_ms']:.0f} ms on one thread: "
            f"demo's codec {front['demo_ms_per_step']:.0f} ms a step ({front['demo_share_of_step']:.1%}), "
            f"sparseloco's {front['sparseloco_ms_per_sync']:.0f} ms a sync "
            f"({front['sparseloco_share_of_step']:.2%} of a step at period {front['sparseloco_period']}), {args.world} ranks"
        )
    if args.json:
        meta = {
            "torch": torch.__version__,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
            "numel": numel,
            "rounds": args.rounds,
            "reps": args.reps,
            "baseline": args.baseline,
            "command": " ".join(["python", "benchmarks/bench_codecs.py", *sys.argv[1:]]),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "frontier": front}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
