"""Wall-clock time to a target test accuracy on the digits, per algorithm, against torch DDP.

Two gloo ranks (one thread each) train a wide MLP (64-2048-2048-10, 4.3M
parameters, so communication matters) on scikit-learn's handwritten digits
until rank 0's test accuracy reaches ``--target``. Evaluation pauses the clock.
Run it over a slow link to see what fewer or smaller syncs buy:

    bash ../shared/tools/slow-loopback.sh 2gbit
    ip netns exec lonet python benchmarks/bench_time_to_accuracy.py

Prints a table; writes benchmarks/results/time_to_accuracy.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unison
from common import launch
from unison.apps.workloads.digits import load_data

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "ddp,allreduce,fp16,bytegrad,powersgd,local_sgd,decentralized,low_precision_decentralized,async,diloco,daso"


def wide_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def wrap(name: str, net: nn.Module, optimizer):
    if name == "ddp":
        return DDP(net)
    return unison.DataParallel(net, optimizer=optimizer, algorithm=name)


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def race(name: str, target: float, batch: int, lr: float, eval_every: int, max_seconds: float) -> dict:
    """Train one contender until rank 0 sees ``target`` test accuracy; time training only."""
    world = dist.get_world_size()
    data = load_data(seed=0, test_fraction=0.2)
    net = wide_mlp(0)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    model = wrap(name, net, optimizer)
    loader = unison.sharded_loader(data.train, batch_size=batch, seed=0, drop_last=True)
    clock, steps, epoch, reached, acc = 0.0, 0, 0, False, 0.0
    while not reached and clock < max_seconds:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            clock += time.perf_counter() - start
            steps += 1
            if steps % eval_every == 0:
                acc = accuracy(model, data.test_x, data.test_y)
                flag = torch.tensor([1.0 if acc >= target else 0.0])
                dist.broadcast(flag, src=0)  # rank 0 decides for everyone
                reached = bool(flag.item())
                if reached or clock >= max_seconds:
                    break
        epoch += 1
        if isinstance(model, unison.DataParallel):
            model.end_epoch(loss.item())  # DASO's schedule advances by epochs
    sent = model.comm_stats["bytes_per_step"] if isinstance(model, unison.DataParallel) else 2 * (world - 1) * 4 * sum(p.numel() for p in net.parameters()) / world
    if isinstance(model, unison.DataParallel):
        model.switch_to("allreduce")  # stop background threads
    return {"seconds": clock if reached else None, "steps": steps, "accuracy": acc, "bytes_per_step": sent, "ms_per_step": 1000 * clock / max(steps, 1)}


def worker(contenders, target, batch, lr, eval_every, max_seconds) -> dict:
    unison.init()
    torch.set_num_threads(1)
    out = {name: race(name, target, batch, lr, eval_every, max_seconds) for name in contenders}
    unison.shutdown()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="training-time cap per contender")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "time_to_accuracy.json"))
    args = parser.parse_args(argv)
    contenders = args.contenders.split(",")
    results = launch(worker, 2, contenders, args.target, args.batch, args.lr, args.eval_every, args.max_seconds)[0]
    base = results.get("ddp", {}).get("seconds")
    print(f"time to {args.target:.0%} test accuracy on digits, wide MLP, 2 ranks")
    print(f"{'contender':14} {'seconds':>8} {'steps':>6} {'ms/step':>8} {'MB/step':>8} {'speed-up vs DDP':>16}")
    for name, r in results.items():
        r["speedup"] = round(base / r["seconds"], 2) if base and r["seconds"] else None
        seconds = f"{r['seconds']:.1f}" if r["seconds"] else "never"
        print(f"{name:14} {seconds:>8} {r['steps']:>6} {r['ms_per_step']:>8.1f} {r['bytes_per_step'] / 1e6:>8.2f} {r['speedup'] or '-':>16}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"target": args.target, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
