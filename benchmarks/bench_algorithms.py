"""Step time and bytes on the wire of every gradient algorithm against torch DDP.

Two gloo ranks (one thread each) train the ~21M-parameter MLP; all contenders
live in one process group and take turns, so they see the same link and load.
Run it over a slow link to see what compression buys:

    bash ../shared/tools/slow-loopback.sh 2gbit          # a ~1 Gbit/s loopback in namespace lonet
    ip netns exec lonet python benchmarks/bench_algorithms.py

Contenders are "ddp", "ddp:fp16_hook" and unison algorithms as NAME or
NAME:opt=value,opt=value (e.g. "powersgd:rank=4"). Every contender first takes
``--settle`` untimed steps (past PowerSGD's start_iter, QAdam's, async's and
DASO's warm-ups); ``model.end_epoch(loss)`` is called every ``--epoch-steps``
steps. Time a multiple of the averaging periods (local SGD and DiLoCo sync
every 16 steps by default). Bytes are counted over the timed steps.
Prints a table; writes benchmarks/results/algorithms.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import unison
from common import WORKLOADS, launch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "ddp,ddp:fp16_hook,allreduce,fp16,bf16,bytegrad,powersgd:rank=4,nonblocking,qadam"


def parse(spec: str) -> tuple[str, dict]:
    """"powersgd:rank=4,start_iter=2" -> ("powersgd", {"rank": 4, "start_iter": 2})."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value not in ("", "fp16_hook") else value
    return name, options


def build(spec: str, module: torch.nn.Module):
    """A wrapped model and its optimizer for one contender."""
    name, options = parse(spec)
    if name == "ddp":
        model = DDP(module)
        if spec == "ddp:fp16_hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return model, torch.optim.SGD(module.parameters(), lr=0.01)
    algorithm = unison.algorithms.create(name, **options)
    if name == "qadam":  # runs only with its own optimizer; warm up within the settle steps
        optimizer = unison.QAdamOptimizer(module.parameters(), lr=1e-3, warmup_steps=5)
    else:
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    return unison.DataParallel(module, optimizer=optimizer, algorithm=algorithm), optimizer


def ddp_wire_bytes(spec: str, params: int, world: int) -> float:
    """Bytes one rank sends per DDP step: a ring allreduce of every gradient."""
    itemsize = 2 if spec == "ddp:fp16_hook" else 4
    return 2 * (world - 1) * params * itemsize / world


def bytes_so_far(model) -> int:
    return model.comm_stats["bytes_total"] if isinstance(model, unison.DataParallel) else 0


def worker(workload: str, contenders: list[str], batch: int, rounds: int, steps_per_round: int, settle: int, epoch_steps: int) -> dict:
    unison.init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    make, data = WORKLOADS[workload]
    torch.manual_seed(0)
    base = make()
    params = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(rank)
    x, y = data(g, batch), torch.randint(0, 10, (batch,), generator=g)
    models = {c: build(c, copy.deepcopy(base)) for c in contenders}

    taken = {c: 0 for c in contenders}

    def train(spec, steps):
        model, opt = models[spec]
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            taken[spec] += 1
            if isinstance(model, unison.DataParallel) and taken[spec] % epoch_steps == 0:
                model.end_epoch(loss.item())  # DASO's schedule advances by epochs

    def pause(spec):
        """Stop background averaging (async) so it does not load the link while others are timed."""
        model = models[spec][0]
        if isinstance(model, unison.DataParallel):
            model.average()

    for spec in contenders:
        train(spec, settle)
        pause(spec)
    times = {c: [] for c in contenders}
    sent = {c: 0 for c in contenders}
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for spec in order:
            dist.barrier()
            before = bytes_so_far(models[spec][0])
            start = time.perf_counter()
            train(spec, steps_per_round)
            times[spec].append((time.perf_counter() - start) / steps_per_round)
            sent[spec] += bytes_so_far(models[spec][0]) - before
            pause(spec)
    timed = rounds * steps_per_round
    result = {
        c: {"ms": statistics.median(times[c]) * 1000, "bytes": ddp_wire_bytes(c, params, world) if c.startswith("ddp") else sent[c] / timed}
        for c in contenders
    }
    for model, _ in models.values():
        if isinstance(model, unison.DataParallel):
            model.switch_to("allreduce")  # stop background threads before shutdown
    unison.shutdown()
    return {"params": params, "results": result}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT)
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--settle", type=int, default=12)
    parser.add_argument("--epoch-steps", type=int, default=8, help="call model.end_epoch() every this many steps")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "algorithms.json"))
    args = parser.parse_args(argv)
    contenders = args.contenders.split(",")
    out = launch(worker, 2, args.workload, contenders, args.batch, args.rounds, args.steps_per_round, args.settle, args.epoch_steps)[0]
    results = out["results"]
    base = results.get("ddp")
    print(f"{args.workload}, {out['params']} parameters, 2 ranks")
    print(f"{'contender':18} {'ms/step':>9} {'vs DDP':>7} {'MB/step':>9} {'vs DDP':>7}")
    for spec, r in results.items():
        r["time_ratio"] = round(r["ms"] / base["ms"], 3) if base else None
        r["bytes_ratio"] = round(r["bytes"] / base["bytes"], 4) if base else None
        print(f"{spec:18} {r['ms']:9.1f} {r['time_ratio'] or '-':>7} {r['bytes'] / 1e6:9.2f} {r['bytes_ratio'] or '-':>7}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"workload": args.workload, "params": out["params"], "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
