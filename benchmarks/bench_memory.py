"""Memory of every contender over local training, in copies of the parameters (P).

Two gloo ranks (one torch thread each) train a ~31M-parameter MLP (P = 126 MB
of fp32 weights) for 12 steps at batch 32 per rank, SGD with momentum 0.9 (QAdam
with its own optimizer, against local Adam). Every contender runs in fresh
processes, built from the same seed, with glibc's mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``) so that a freed buffer leaves the resident set
instead of staying in the heap (``--glibc-default`` leaves glibc's dynamic
threshold as it is, to see what that costs). Per rank it records:

* ``live``: the bytes of every tensor storage reachable from Python at the end
  (``unison.memory.live_tensor_bytes``: each storage once, the gradients and the
  optimizer state included), less what was live before the model was built;
* ``rss``: the resident set at the end less the resident set before the model was
  built (also what C++ holds, unseen by ``live``: torch DDP's own buckets);
* ``peak``: the peak resident set over the training steps (VmHWM, reset after the
  wrapper is built) less the resident set before the model was built;
* ``construct``: the peak resident set while the wrapper is built less the
  resident set just before (a construction's transient copies, over P alone);
* ``cuda``: ``torch.cuda.max_memory_allocated`` where CUDA is available (the model,
  data and state on the GPU). Both ranks may share one GPU: then they talk over gloo
  (NCCL refuses two ranks on one device; ``--backend`` chooses otherwise).

The table gives each, less local training's (``local``: the same loop, no
communication; 3P of live tensors: weights, gradients, momentum), over P.
Contenders: ``local``, ``local_adam``, ``ddp`` (torch DDP, gradient_as_bucket_view)
and unison algorithms as ``NAME`` or ``NAME:opt=value,...``.

Example::

    python benchmarks/bench_memory.py                              # about 3 minutes
    python benchmarks/bench_memory.py --contenders local,ddp,allreduce --json /tmp/m.json
    python benchmarks/bench_memory.py --contenders local,ddp,allreduce,local_sgd,diloco --glibc-default \
        --json benchmarks/results/memory_glibc_default.json

Prints a table; writes benchmarks/results/memory.json (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import launch, split_contenders
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unison
from unison.memory import live_tensor_bytes, parameter_bytes, peak_rss_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = (
    "local,local_adam,ddp,allreduce,fp16,bf16,bytegrad,powersgd:rank=4,qadam,nonblocking,"
    "local_sgd,async,decentralized,decentralized:peer_selection=ring,low_precision_decentralized,diloco,"
    "daso:warmup_epochs=0,sparseloco,demo"
)
BASELINE = {"qadam": "local_adam", "local_adam": "local_adam"}  # what a contender is compared with


def wide_mlp(width: int = 2048, depth: int = 8) -> nn.Module:
    """About 31M parameters in layers of 16 MiB (several per 25 MiB bucket)."""
    dims = [1024] + [width] * depth + [10]
    layers: list[nn.Module] = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(args: dict) -> dict:
    unison.init(backend=args["backend"])
    torch.set_num_threads(1)
    spec, steps = args["spec"], args["steps"]
    name = spec.partition(":")[0]
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = torch.randn(args["batch"], 1024, generator=g), torch.randint(0, 10, (args["batch"],), generator=g)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        x, y = x.cuda(), y.cuda()
    before = live_tensor_bytes()
    reset_peak()
    rss0 = rss_bytes()
    torch.manual_seed(0)
    net = wide_mlp().to(x.device)
    adam = name in ("qadam", "local_adam")
    if name == "qadam":
        opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=1e-4, warmup_steps=4)
    elif adam:
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    rss1 = rss_bytes()
    reset_peak()
    model: nn.Module = net
    if name == "ddp":
        model = DDP(net, gradient_as_bucket_view=True)
    elif name not in ("local", "local_adam"):
        algorithm = unison.algorithms.create(spec)
        model = unison.DataParallel(net, optimizer=opt, algorithm=algorithm)
    construct = peak_rss_bytes() - rss1
    reset_peak()
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if isinstance(model, unison.DataParallel) and (step + 1) % 4 == 0:
            model.end_epoch(float(loss.detach()))  # DASO's schedule advances by epochs
    del loss
    live = live_tensor_bytes([net], [opt]) - before
    out = {
        "P": parameter_bytes(net),
        "live": live,
        "rss": rss_bytes() - rss0,
        "peak": peak_rss_bytes() - rss0,
        "construct": construct,
        "cuda": torch.cuda.max_memory_allocated() if cuda else None,
    }
    if isinstance(model, unison.DataParallel):
        model.close()
    unison.shutdown()
    return out


def run(
    spec: str, steps: int, batch: int, nodes: int, glibc_default: bool = False, backend: str | None = None
) -> list[dict]:
    os.environ["UNISON_NODES"] = str(nodes)
    if glibc_default:  # glibc's own, dynamic threshold: freed large buffers may stay resident
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by the spawned ranks' glibc at start
    results = launch(worker, 2, {"spec": spec, "steps": steps, "batch": batch, "backend": backend})
    return [results[r] for r in sorted(results)]


def summarize(measured: dict[str, list[dict]]) -> dict:
    """Per contender: live tensors, peak RSS and construction transient over its baseline, in P
    (the larger of the two ranks)."""
    out = {}
    for spec, ranks in measured.items():
        base = measured.get(BASELINE.get(spec.partition(":")[0], "local"))
        entry: dict = {"P_bytes": ranks[0]["P"]}
        for key in ("live", "rss", "peak", "construct", "cuda"):
            if ranks[0][key] is None:
                continue
            entry[f"{key}_bytes"] = max(r[key] for r in ranks)
            if base is not None:
                over = (
                    max(r[key] - b[key] for r, b in zip(ranks, base)) if key != "construct" else entry[f"{key}_bytes"]
                )
                entry[f"{key}_P"] = round(over / ranks[0]["P"], 3)
        out[spec] = entry
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT, help="comma list (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (UNISON_NODES) the 2 ranks form")
    parser.add_argument(
        "--backend",
        default=None,
        help="process group backend (default: unison.init's choice; gloo where the 2 ranks share one GPU)",
    )
    parser.add_argument("--json", default=os.path.join(HERE, "results", "memory.json"))
    parser.add_argument(
        "--glibc-default",
        action="store_true",
        help="leave glibc's mmap threshold as it is (the resident set then keeps freed buffers: see docs)",
    )
    args = parser.parse_args(argv)
    contenders = split_contenders(args.contenders)
    for base in ("local", "local_adam"):
        if base not in contenders:
            contenders.insert(0, base)
    backend = args.backend
    if backend is None and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        backend = "gloo"  # both ranks on the one GPU
    measured, failed = {}, {}
    for spec in contenders:
        try:
            measured[spec] = run(spec, args.steps, args.batch, args.nodes, args.glibc_default, backend)
        except Exception as exc:  # one contender's failure is reported, the others still measured
            failed[spec] = f"{type(exc).__name__}: {exc}"[-2000:]
            print(f"FAILED {spec}: {failed[spec]}", file=sys.stderr, flush=True)
            continue
        print(f"measured {spec}", file=sys.stderr, flush=True)
    summary = summarize(measured)
    p = summary["local"]["P_bytes"]
    print(f"2 ranks, {args.steps} steps, P = {p / 1e6:.0f} MB; overheads over local training in P (max over ranks)")
    print(f"{'contender':34} {'live':>7} {'RSS':>7} {'peak RSS':>9} {'construct':>9} {'cuda':>7}")
    for spec, e in summary.items():
        cuda = f"{e['cuda_P']:7.2f}" if "cuda_P" in e else f"{'-':>7}"
        print(f"{spec:34} {e['live_P']:7.2f} {e['rss_P']:7.2f} {e['peak_P']:9.2f} {e['construct_P']:9.2f} {cuda}")
    config = {
        "command": " ".join(["python", "benchmarks/bench_memory.py", *sys.argv[1:]]),
        "steps": args.steps,
        "batch": args.batch,
        "nodes": args.nodes,
        "contenders": contenders,
        "malloc": "glibc default" if args.glibc_default else "MALLOC_MMAP_THRESHOLD_=1048576",
        "backend": backend or "unison.init's default",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"config": config, "torch": torch.__version__, "summary": summary, "ranks": measured, "failed": failed},
            f,
            indent=2,
        )
    print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
