"""A model sharded with FSDP2 inside each node: every algorithm across the nodes against torch's HSDP.

2 nodes x 2 processes, each node in a network namespace of its own whose link to the other is
limited to ``--bandwidth`` (default 1gbit; ``unison.apps.bench.netem``: root and iproute2; the
kernel here has no netem, so no latency). Inside a node FSDP2 shards the model (``fully_shard``
on each layer and the root over the node's 2 ranks); across the nodes run:

* ``compute``: FSDP2 inside each node and nothing across (each node trains alone): the limit;
* ``hsdp``: torch's own HSDP, ``fully_shard`` over the 2-D mesh (reduce-scatter inside, then an
  all-reduce of each shard across the nodes, every step);
* unison's algorithms as ``NAME`` or ``NAME:opt=value,...``, wrapped with
  ``DataParallel(model, device_mesh=mesh["replicate"])``.

How it measures (as ``bench_step_time.py``): every contender is built afresh in every round from
the same seed; it first takes untimed warm-up steps (a whole number of its sync periods, at
least one, then ``flush()``); the timed window is a whole number of its periods (at least two)
and ends with ``flush()``, so everything it launched in the window landed inside; the window's
time is the slower rank's; rounds (at least 3) alternate the contenders' order, and a
contender's figure is the median over rounds of its time over HSDP's and over compute's in the
same round. Bytes: what left each node through its link during the
window (its veth's counter, per step, the nodes' mean), and unison's own counter
(``comm_stats``, the node's ranks summed). Memory: the tensors live on a rank after the window
(``unison.memory.live_tensor_bytes``, a DTensor as its local shard) over compute's.

    python benchmarks/bench_sharded.py                          # about 30 minutes here
    python benchmarks/bench_sharded.py --contenders compute,hsdp,diloco --rounds 3 --bandwidth 100mbit

Prints a table; writes benchmarks/results/sharded.json (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import WORKLOADS, split_contenders
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unison
from unison.apps.bench import netem
from unison.apps.bench.worker import link_tx_bytes
from unison.memory import live_tensor_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "compute,hsdp,allreduce,local_sgd,diloco,sparseloco,decentralized,low_precision_decentralized,async"
TORCH = ("compute", "hsdp")
NODES, PER_NODE = 2, 2


class Contender:
    """One contender's sharded model, optimizer, wrapper and sync period."""

    def __init__(self, spec: str, mesh, lr: float, window: int) -> None:
        self.spec = spec
        torch.manual_seed(0)
        self.module = WORKLOADS["mlp"][0]()
        where = mesh if spec == "hsdp" else mesh["shard"]
        for layer in self.module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=where)
        fully_shard(self.module, mesh=where)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=lr, momentum=0.9)
        self.model = self.module
        self.period = 1
        if spec not in TORCH:
            self.model = unison.DataParallel(
                self.module, optimizer=self.optimizer, algorithm=spec, device_mesh=mesh["replicate"]
            )
            self.period = int(getattr(self.model.algorithm, "period", 1) or 1)
        if window % self.period or window < 2 * self.period:
            raise SystemExit(
                f"{spec}: the timed window ({window} steps) must be a whole number of its sync periods "
                f"({self.period}), at least two"
            )
        self.warmup = self.period * max(1, math.ceil(2 / self.period))

    def train(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()

    def bytes_sent(self) -> int:
        return 0 if self.spec in TORCH else int(self.model.comm_stats["bytes_total"])

    def close(self) -> None:
        if self.spec not in TORCH:
            self.model.close()


def total(value: float, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def worker(args: dict) -> None:
    topo = unison.init(backend="gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if topo.local_rank == 0 else None
    g = torch.Generator().manual_seed(1000 + topo.rank)
    x = WORKLOADS["mlp"][1](g, args["batch"])
    y = torch.randint(0, 10, (args["batch"],), generator=g)
    rounds = []
    for r in range(args["rounds"]):
        order = args["contenders"] if r % 2 == 0 else args["contenders"][::-1]
        measured = {}
        for spec in order:
            gc.collect()
            before_memory = live_tensor_bytes()
            c = Contender(spec, mesh, args["lr"], args["window"])
            c.train(x, y, c.warmup)
            if spec not in TORCH:
                c.model.flush()
            dist.barrier()
            sent, link = c.bytes_sent(), link_tx_bytes(ifname)
            start = time.perf_counter()
            c.train(x, y, args["window"])
            if spec not in TORCH:
                c.model.flush()  # the window ends with the syncs it launched landed
            elapsed = total(time.perf_counter() - start, dist.ReduceOp.MAX)
            link = total(link_tx_bytes(ifname) - link) / NODES
            sent = total(c.bytes_sent() - sent) / NODES
            memory = total(live_tensor_bytes([c.module], [c.optimizer]) - before_memory, dist.ReduceOp.MAX)
            c.close()
            measured[spec] = {
                "ms": 1000 * elapsed / args["window"],
                "link_bytes_per_step": link / args["window"],
                "counted_bytes_per_step": sent / args["window"],
                "memory_bytes": memory,
                "period": c.period,
                "warmup_steps": c.warmup,
            }
            del c
            gc.collect()
        rounds.append(measured)
        if topo.rank == 0:
            print(f"[sharded] round {r + 1}/{args['rounds']} done", flush=True)
    if topo.rank == 0:
        params = sum(p.numel() for p in WORKLOADS["mlp"][0]().parameters())
        with open(args["out"], "w") as f:
            json.dump({"rounds": rounds, "params": params}, f)
    unison.shutdown()


def summarize(rounds: list[dict], contenders: list[str]) -> dict:
    """Per contender: medians of ms, bytes and memory; the medians of its per-round ratios to hsdp and compute."""
    out = {}
    for spec in contenders:
        entry = {
            key: statistics.median(r[spec][key] for r in rounds)
            for key in ("ms", "link_bytes_per_step", "counted_bytes_per_step", "memory_bytes")
        }
        entry["period"] = rounds[0][spec]["period"]
        for base in TORCH:
            if base in contenders:
                ratios = [r[spec]["ms"] / r[base]["ms"] for r in rounds]
                entry[f"vs_{base}"] = statistics.median(ratios)
                entry[f"vs_{base}_rounds"] = ratios
        if "compute" in contenders:
            entry["memory_vs_compute"] = entry["memory_bytes"] / statistics.median(
                r["compute"]["memory_bytes"] for r in rounds
            )
        out[spec] = entry
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default=DEFAULT, help="comma list (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3, help="at least 3")
    parser.add_argument("--window", type=int, default=32, help="timed steps per contender and round")
    parser.add_argument("--bandwidth", default="1gbit", help="each node's link (tc syntax)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "sharded.json"))
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            worker(json.load(f))
        return 0
    contenders = split_contenders(args.contenders)
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3 (medians of paired ratios)")
    if "hsdp" not in contenders or "compute" not in contenders:
        raise SystemExit("the contenders must include compute and hsdp: every figure is a ratio to them")
    with tempfile.TemporaryDirectory() as tmp, netem.Network(NODES, args.bandwidth, None) as net:
        out = os.path.join(tmp, "out.json")
        spec = os.path.join(tmp, "args.json")
        with open(spec, "w") as f:
            json.dump(
                {
                    "contenders": contenders,
                    "batch": args.batch,
                    "lr": args.lr,
                    "rounds": args.rounds,
                    "window": args.window,
                    "out": out,
                },
                f,
            )
        procs = []
        for rank in range(NODES * PER_NODE):
            node, local = divmod(rank, PER_NODE)
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(NODES * PER_NODE),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(PER_NODE),
                "MASTER_ADDR": net.address(0),  # node 0's namespace, made by this run: nothing else listens there
                "MASTER_PORT": "29500",
                "GLOO_SOCKET_IFNAME": net.ifname(node),
                "OMP_NUM_THREADS": "1",
            }
            argv = [sys.executable, os.path.abspath(__file__), "--worker", spec]
            procs.append(subprocess.Popen(net.exec_argv(node) + argv, env=env))
        codes = [p.wait(3600) for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed (exit codes {codes})")
        with open(out) as f:
            raw = json.load(f)
        network = net.describe()
    results = summarize(raw["rounds"], contenders)
    print(
        f"MLP of {raw['params']:,} parameters (fp32: {raw['params'] * 4 / 1e6:.1f} MB), {NODES} nodes x {PER_NODE} "
        f"processes, FSDP2 inside each node, {args.bandwidth} between them, batch {args.batch} per rank, "
        f"{args.rounds} rounds of {args.window} steps"
    )
    print(
        f"{'contender':32} {'ms/step':>8} {'/ hsdp':>7} {'/ compute':>9} {'link MB/step':>12} "
        f"{'counted MB':>10} {'memory MB':>9} {'/ compute':>9}"
    )
    for spec, r in results.items():
        print(
            f"{spec:32} {r['ms']:>8.1f} {r['vs_hsdp']:>7.3f} {r['vs_compute']:>9.3f} "
            f"{r['link_bytes_per_step'] / 1e6:>12.3f} {r['counted_bytes_per_step'] / 1e6:>10.3f} "
            f"{r['memory_bytes'] / 1e6:>9.1f} {r['memory_vs_compute']:>9.2f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "config": {**vars(args), "contenders": contenders, "nodes": NODES, "procs_per_node": PER_NODE},
                "network": network,
                "params": raw["params"],
                "results": results,
                "rounds": raw["rounds"],
            },
            f,
            indent=2,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
