"""Step time and peak memory of unison's "allreduce" against torch DDP.

Two gloo ranks (one thread each) train the same model; unison and torch DDP
take turns, a few steps each, in one process group, so both see the same
machine load. Peak memory is measured separately, one fresh pair of processes
per contender (the peak resident set size of rank 0).

    python benchmarks/bench_allreduce.py                 # loopback
    ip netns exec lonet python benchmarks/bench_allreduce.py   # a slow link (docs/benchmarks.md: "The slow links")

Prints a table and writes benchmarks/results/allreduce.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import WORKLOADS, launch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

HERE = os.path.dirname(os.path.abspath(__file__))


def wrap(kind: str, module: nn.Module) -> nn.Module:
    return DDP(module) if kind == "ddp" else unison.DataParallel(module)


def train_step(model, opt, x, y) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def timing_worker(workload: str, batch: int, rounds: int, steps_per_round: int, warmup: int) -> dict:
    """Alternate DDP and unison in one process group; return per-step times."""
    unison.init()
    torch.set_num_threads(1)
    rank = dist.get_rank()
    make, data = WORKLOADS[workload]
    torch.manual_seed(0)
    base = make()
    models = {"ddp": wrap("ddp", copy.deepcopy(base)), "unison": wrap("unison", copy.deepcopy(base))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    x, y = data(g, batch), torch.randint(0, 10, (batch,), generator=g)
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + warmup):
        for kind in ("ddp", "unison") if r % 2 == 0 else ("unison", "ddp"):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps_per_round):
                train_step(models[kind], opts[kind], x, y)
            elapsed = (time.perf_counter() - start) / steps_per_round
            if r >= warmup:
                times[kind].append(elapsed)
    params = sum(p.numel() for p in base.parameters())
    stats = models["unison"].comm_stats
    unison.shutdown()
    return {"times": times, "params": params, "bytes_per_step": stats["bytes_per_step"]}


def memory_worker(workload: str, kind: str, batch: int, steps: int) -> dict:
    """Peak resident memory of one contender, alone in fresh processes."""
    unison.init()
    torch.set_num_threads(1)
    make, data = WORKLOADS[workload]
    torch.manual_seed(0)
    model = wrap(kind, make())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = data(g, batch), torch.randint(0, 10, (batch,), generator=g)
    for _ in range(steps):
        train_step(model, opt, x, y)
    unison.shutdown()
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,cnn")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=8, help="timed turns per contender")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "allreduce.json"))
    args = parser.parse_args(argv)

    report = {"machine": {"cores": os.cpu_count(), "torch": torch.__version__}, "workloads": {}}
    for workload in args.workloads.split(","):
        out = launch(timing_worker, 2, workload, args.batch, args.rounds, args.steps_per_round, args.warmup)[0]
        ddp_ms = statistics.median(out["times"]["ddp"]) * 1000
        uni_ms = statistics.median(out["times"]["unison"]) * 1000
        entry = {
            "params": out["params"],
            "ddp_ms_per_step": round(ddp_ms, 1),
            "unison_ms_per_step": round(uni_ms, 1),
            "ratio": round(uni_ms / ddp_ms, 3),
            "unison_bytes_per_step": out["bytes_per_step"],
        }
        if not args.no_memory:
            for kind in ("ddp", "unison"):
                mem = launch(memory_worker, 2, workload, kind, args.batch, 5)[0]
                entry[f"{kind}_peak_rss_mb"] = round(mem["peak_rss_mb"], 1)
        report["workloads"][workload] = entry
        print(f"{workload}: {json.dumps(entry)}", flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"\n{'workload':10} {'params':>10} {'DDP ms':>8} {'unison ms':>10} {'ratio':>6} {'DDP MB':>8} {'unison MB':>10}"
    )
    for name, e in report["workloads"].items():
        print(
            f"{name:10} {e['params']:>10} {e['ddp_ms_per_step']:>8} {e['unison_ms_per_step']:>10} {e['ratio']:>6}"
            f" {e.get('ddp_peak_rss_mb', '-'):>8} {e.get('unison_peak_rss_mb', '-'):>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
