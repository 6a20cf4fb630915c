"""Hierarchical reduction: a node leader carrying everything against the two levels (issue 19).

Runs 2 nodes x 2 processes on the emulated network of ``unison bench`` (root and
iproute2; otherwise plain loopback), reduces one buffer with each scheme and
reports the time per reduction and the bytes that crossed each node's link
(its veth's counter) against the formula ``2(M-1)/M * S`` per node:

    python benchmarks/bench_hierarchy.py --mb 4 --bandwidth 100mbit --latency 1ms

The leader scheme is the one unison's hierarchical allreduce used before issue 19
(reduce onto local rank 0, allreduce among leaders, broadcast inside the node).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def leader(flat, topo, intra, inter) -> None:
    dist.reduce(flat, dst=topo.node_ranks()[0], group=intra)
    if topo.local_rank == 0:
        dist.all_reduce(flat, group=inter)
    dist.broadcast(flat, src=topo.node_ranks()[0], group=intra)


def worker(mb: float, reps: int) -> None:
    import unison
    from unison.apps.bench.worker import link_tx_bytes
    from unison.engine.exchange import Exchange
    from unison.engine.hierarchy import TwoLevel

    topo = unison.init(backend="gloo")
    intra = topo.intra_node_group
    inter = topo.inter_node_group
    two = TwoLevel(intra, inter, topo.local_rank, topo.local_world_size, topo.num_nodes)
    flat = torch.ones(int(mb * 2**20 / 4))
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if topo.local_rank == 0 else None
    flat_ex = Exchange(flat.numel(), topo.world_size, 1024, flat.device)
    shard = two.bounds(flat.numel())
    shard_ex = Exchange(shard[topo.local_rank + 1] - shard[topo.local_rank], topo.num_nodes, 1024, flat.device)
    world = dist.new_group()
    out = {}
    for name, fn in (
        ("leader", lambda: leader(flat, topo, intra, inter)),
        ("two_level", lambda: two.run(flat, lambda s, _: dist.all_reduce(s, group=inter))),
        ("flat", lambda: dist.all_reduce(flat)),
        ("8bit_two_level", lambda: two.run(flat, lambda s, _: shard_ex.run(s, inter))),
        ("8bit_flat", lambda: flat_ex.run(flat, world)),
    ):
        fn()  # warm up (connections)
        dist.barrier()
        tx, start = link_tx_bytes(ifname), time.perf_counter()
        for _ in range(reps):
            fn()
        dist.barrier()
        seconds = (time.perf_counter() - start) / reps
        link = torch.tensor([link_tx_bytes(ifname) - tx], dtype=torch.float64)
        dist.all_reduce(link)
        out[name] = {"ms": 1000 * seconds, "link_mb_per_node": link.item() / topo.num_nodes / reps / 1e6}
    if topo.rank == 0:
        s = flat.numel() * 4
        m = topo.num_nodes
        n, p = topo.world_size, topo.local_world_size
        out["formula_mb_per_node"] = {
            "two_level": 2 * (m - 1) / m * s / 1e6,
            "flat": 2 * (n - 1) / n * s / 1e6,
            "8bit_two_level": 2 * (m - 1) / m * s / 4e6,
            "8bit_flat": (p * (m - 1) / m + (n - 1) / n) * s / 4e6,
        }
        print(json.dumps(out))
    unison.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--latency", default="1ms")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.mb, args.reps)
    from unison.apps.bench import netem

    nodes, per_node = 2, 2
    with netem.Network(nodes, args.bandwidth, args.latency) as net:
        # Rank 0 hosts the store in node 0's namespace, made by this run: nothing else listens there.
        port, procs = 29500, []
        for rank in range(nodes * per_node):
            node, local = divmod(rank, per_node)
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(nodes * per_node),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(per_node),
                "MASTER_ADDR": net.address(0),
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": net.ifname(node),
                "OMP_NUM_THREADS": "1",
            }
            argv = [sys.executable, __file__, "--worker", "--mb", str(args.mb), "--reps", str(args.reps)]
            procs.append(subprocess.Popen(net.exec_argv(node) + argv, env=env))
        for p in procs:
            p.wait(600)


if __name__ == "__main__":
    main()
