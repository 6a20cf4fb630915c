"""Step time of every contender against torch DDP and against compute alone: the one
step-time harness behind the README's tables.

Two gloo ranks (one torch thread each) train the ~22M-parameter MLP of
``common.py`` at batch 64 per rank with SGD (momentum 0.9). How it measures:

* every contender is built afresh in every round, from the same seed;
* ``compute`` is the same loop with no communication at all (each rank steps
  its own copy), run beside the others: the limit nothing can beat;
* each contender first takes untimed warm-up steps, past its own warm-up
  (PowerSGD's ``start_iter``, ``warmup_steps``, DASO's warm-up epochs) and a
  whole number of its sync periods, so the timed window starts at the same
  phase of the period as it ends;
* the timed window is a whole number of sync periods (at least two) and holds
  everything the algorithm does in those steps: every launch and every wait of
  its syncs. The window's time is the slower rank's;
* afterwards ``model.flush()`` (what ``eval()`` or ``state_dict()`` waits for)
  is timed as ``drain_ms``, outside the window, and the contender is closed.
  Streamed syncs stay on their schedule through ``flush()`` (their drain is 0):
  the window starts with one sync in flight and ends with one, so it holds as
  many landings as launches;
* rounds (at least 3) alternate the order of the contenders; a contender's
  figure is the median over rounds of its time divided by torch DDP's (and by
  compute's) in the same round: ratios measured side by side, because absolute
  times drift on a shared machine;
* bytes per step are unison's own counters (``model.comm_stats``); torch DDP's
  are the ring all-reduce of every gradient.

Contenders: ``compute``, ``ddp``, ``ddp_fp16`` (torch DDP with its fp16 hook),
``ddp_post_local_sgd`` (torch's PeriodicModelAverager every 16 steps after no
warm-up), and unison algorithms as ``NAME`` or ``NAME:opt=value,...``.
The ranks pretend to be ``--nodes`` nodes (default 2) so DASO syncs across them.

Over a ~1 Gbit/s link (the issue's setting)::

    ip netns add lonet && ip -n lonet link set lo up     # docs/benchmarks.md: "The slow links"
    tc -n lonet qdisc replace dev lo root tbf rate 2gbit burst 256kb latency 50ms
    ip netns exec lonet python benchmarks/bench_step_time.py            # about 10 minutes
    ip netns exec lonet python benchmarks/bench_step_time.py --contenders compute,ddp,diloco --rounds 3

Prints a table; writes benchmarks/results/step_time.json (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import WORKLOADS, launch, split_contenders
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = (
    "compute,ddp,ddp_fp16,ddp_post_local_sgd,allreduce,bf16,fp16,bytegrad,powersgd:rank=4,"
    "local_sgd,diloco,decentralized,low_precision_decentralized,async,daso:warmup_epochs=0"
)
PEER_PERIOD = 16  # ddp_post_local_sgd's averaging period, as local_sgd's default


class Contender:
    """One contender's model, optimizer and schedule (sync period, warm-up, drain)."""

    def __init__(self, spec: str, module: torch.nn.Module, lr: float, window: int, warmup: int, epoch_steps: int):
        self.spec, self.module, self.averager = spec, module, None
        name, _, _ = spec.partition(":")
        self.unison = name not in ("compute", "ddp", "ddp_fp16", "ddp_post_local_sgd")
        period, own_warmup = 1, 0
        if name == "compute":
            self.model = module
        elif not self.unison:
            self.model = DDP(module)
            if name == "ddp_fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            if name == "ddp_post_local_sgd":
                from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
                from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

                subgroup = unison.topology().intra_node_group
                self.model.register_comm_hook(
                    pl.PostLocalSGDState(None, subgroup, start_localSGD_iter=1), pl.post_localSGD_hook
                )
                self.averager = PeriodicModelAverager(period=PEER_PERIOD, warmup_steps=1)
                period, own_warmup = PEER_PERIOD, 1
        else:
            algorithm = unison.algorithms.create(*unison.algorithms.parse(spec)[:1], **unison.algorithms.parse(spec)[1])
            period = int(getattr(algorithm, "period", 1) or 1)
            if name == "daso":
                period = algorithm.max_global_skips
                own_warmup = algorithm.warmup_epochs * epoch_steps
            own_warmup = max(
                own_warmup, getattr(algorithm, "warmup_steps", 0) or 0, getattr(algorithm, "start_iter", 0) or 0
            )
        if name == "qadam":
            self.optimizer = unison.QAdamOptimizer(module.parameters(), lr=1e-3, warmup_steps=5)
            own_warmup = max(own_warmup, 5)
        else:
            self.optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        if self.unison:
            self.model = unison.DataParallel(module, optimizer=self.optimizer, algorithm=algorithm)
        if window % period or window < 2 * period:
            raise SystemExit(
                f"{spec}: the timed window ({window} steps) must be a whole number of its sync periods ({period}), at least two"
            )
        self.period = period
        self.warmup = period * math.ceil(max(warmup, own_warmup + 1) / period)
        self.epoch_steps, self.steps = epoch_steps, 0

    def train(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            if self.averager is not None:
                self.averager.average_parameters(self.module.parameters())
            self.steps += 1
            if self.unison and self.steps % self.epoch_steps == 0:
                self.model.end_epoch(loss.item())  # DASO's schedule advances by epochs

    def bytes_sent(self) -> int:
        return self.model.comm_stats["bytes_total"] if self.unison else 0

    def drain(self) -> float:
        """Finish what is in flight (untimed by the window); returns its seconds."""
        start = time.perf_counter()
        if self.unison:
            self.model.flush()
        return time.perf_counter() - start

    def close(self) -> None:
        if self.unison:
            self.model.close()


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def peer_bytes(spec: str, params: int, world: int) -> float:
    """Bytes one rank sends per step for torch's contenders (ring all-reduce)."""
    ring = 2 * (world - 1) / world
    if spec == "ddp":
        return ring * params * 4
    if spec == "ddp_fp16":
        return ring * params * 2
    if spec == "ddp_post_local_sgd":
        return ring * params * 4 / PEER_PERIOD
    return 0.0


def worker(args: dict) -> dict:
    unison.init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    make, data = WORKLOADS[args["workload"]]
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = data(g, args["batch"]), torch.randint(0, 10, (args["batch"],), generator=g)
    rounds = []
    for r in range(args["rounds"]):
        order = args["contenders"] if r % 2 == 0 else args["contenders"][::-1]
        measured = {}
        for spec in order:
            torch.manual_seed(0)
            c = Contender(spec, make(), args["lr"], args["window"], args["warmup"], args["epoch_steps"])
            c.train(x, y, c.warmup)
            dist.barrier()
            before = c.bytes_sent()
            start = time.perf_counter()
            c.train(x, y, args["window"])
            elapsed = slowest(time.perf_counter() - start)
            sent = c.bytes_sent() - before
            drain = slowest(c.drain())
            params = sum(p.numel() for p in c.module.parameters())
            c.close()
            measured[spec] = {
                "ms": 1000 * elapsed / args["window"],
                "bytes_per_step": sent / args["window"] if c.unison else peer_bytes(spec, params, world),
                "drain_ms": 1000 * drain,
                "warmup_steps": c.warmup,
                "period": c.period,
            }
            del c
            gc.collect()
        rounds.append(measured)
    unison.shutdown()
    return {"rounds": rounds}


def summarize(rounds: list[dict], contenders: list[str]) -> dict:
    """Per contender: median ms, and the medians of its per-round ratios to ddp and to compute."""
    out = {}
    for spec in contenders:
        entry = {
            "ms": statistics.median(r[spec]["ms"] for r in rounds),
            "mb_per_step": statistics.median(r[spec]["bytes_per_step"] for r in rounds) / 1e6,
            "drain_ms": statistics.median(r[spec]["drain_ms"] for r in rounds),
        }
        for base in ("ddp", "compute"):
            if base in contenders:
                ratios = [r[spec]["ms"] / r[base]["ms"] for r in rounds]
                entry[f"vs_{base}"] = statistics.median(ratios)
                entry[f"vs_{base}_rounds"] = ratios
        out[spec] = entry
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT, help="comma list (default: %(default)s)")
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3, help="at least 3")
    parser.add_argument("--window", type=int, default=32, help="timed steps per contender and round")
    parser.add_argument("--warmup", type=int, default=16, help="least untimed steps before the window")
    parser.add_argument("--epoch-steps", type=int, default=32, help="call model.end_epoch() every this many steps")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (UNISON_NODES) the 2 ranks form")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "step_time.json"))
    args = parser.parse_args(argv)
    contenders = split_contenders(args.contenders)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: the figure is a median of paired ratios")
    os.environ["UNISON_NODES"] = str(args.nodes)
    config = {
        k: getattr(args, k) for k in ("workload", "batch", "lr", "rounds", "window", "warmup", "epoch_steps", "nodes")
    }
    config["contenders"] = contenders
    rounds = launch(worker, 2, config)[0]["rounds"]
    summary = summarize(rounds, contenders)
    print(
        f"{args.workload}, 2 ranks, batch {args.batch}, {args.window} timed steps x {args.rounds} rounds (median of paired ratios)"
    )
    print(f"{'contender':34} {'ms/step':>8} {'/ DDP':>6} {'/ compute':>9} {'MB/step':>8} {'drain ms':>8}")
    for spec, e in summary.items():
        print(
            f"{spec:34} {e['ms']:8.1f} {e.get('vs_ddp', float('nan')):6.2f} {e.get('vs_compute', float('nan')):9.2f} "
            f"{e['mb_per_step']:8.2f} {e['drain_ms']:8.1f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": config, "torch": torch.__version__, "summary": summary, "rounds": rounds}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
