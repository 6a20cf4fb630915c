"""Bytes per step on a node's link, flat and hierarchical, against the two-level optimum.

Reads the JSON of a ``unison bench`` run on emulated nodes (``--nodes M --procs-per-node P``,
each contender's ``link_bytes_per_step`` read from its node's link) and prints, for every
unison contender, what it put on a node's link per step, its flat twin's, and the optimum
of its scheme written as a formula of M and P (docs/algorithms.md#hierarchical-reduction):
what one process per node would send with the algorithm's own cross-node scheme.

    unison bench --workload digits --bandwidth 100mbit --nodes 2 --procs-per-node 2 \\
        --json benchmarks/results/bench-digits-100mbit-2x2.json
    python benchmarks/hierarchy_bytes.py benchmarks/results/bench-digits-100mbit-2x2.json \
        --out benchmarks/results/hierarchy_bytes.json

The optimum assumes every option at its default (period 16, PowerSGD rank 4 after 10
steps, QAdam's 100 warm-up steps); a contender with other options gets none. Headers of
TCP/IP on the link add a few percent to the measured figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

import torch

from unison.apps.bench import workloads
from unison.apps.bench.contenders import _powersgd_bytes

CHUNK = 1024  # 8-bit codes: one float32 min and scale per chunk of values
PERIOD = 16  # the model-averaging algorithms' default sync period


def codes(values: float) -> float:
    """Bytes of ``values`` values as 8-bit min-max codes (a code each, 8 bytes per chunk)."""
    return values + 8 * math.ceil(values / CHUNK)


def optimum(name: str, params: int, steps: int, m: int, powersgd_bytes: float) -> Optional[float]:
    """Bytes per step a node's link carries when one process per node runs ``name``'s scheme."""
    s, ring = 4.0 * params, 2 * (m - 1) / m
    if name in ("allreduce", "nonblocking"):
        return ring * s
    if name in ("fp16", "bf16"):
        return ring * s / 2
    if name == "bytegrad":
        return ring * codes(params)
    if name == "qadam":  # full precision for its warm-up, then 8-bit momenta
        warm = min(steps, 100)
        return (warm * ring * s + (steps - warm) * ring * codes(params)) / steps
    if name == "powersgd":  # plain allreduce until start_iter, then the factors
        warm = min(steps, 10)
        return (warm * ring * s + (steps - warm) * ring * powersgd_bytes) / steps
    if name in ("local_sgd", "diloco", "decentralized"):  # decentralized: peer_selection "all"
        return ring * s / PERIOD
    if name == "low_precision_decentralized":  # a ring of nodes: k neighbour nodes
        k = 1 if m == 2 else 2
        return k * codes(params) / PERIOD
    return None  # async: per round of its thread, not per step


def fmt(value: Optional[float], scale: float = 1e6, digits: int = 2) -> str:
    """``value / scale`` for the table, "-" for none."""
    return "-" if value is None else f"{value / scale:.{digits}f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", help="a unison bench JSON (emulated links, several processes per node)")
    parser.add_argument("--out", help="also write the table as JSON here")
    args = parser.parse_args(argv)
    doc = json.load(open(args.json))
    m, p = doc["world"]["nodes"], doc["world"]["procs_per_node"]
    results = [r for r in doc["contenders"] if r.get("status") == "ok" and r.get("link_bytes_per_step")]
    by_spec = {r["spec"]: r for r in results}
    params = next(r["params"] for r in results if r.get("params"))
    psgd = 0.0
    if any(r["spec"].startswith("powersgd") for r in results):  # its factors' bytes depend on the shapes
        psgd = _powersgd_bytes(workloads.load(doc["workload"]["name"]).model, rank=4)
    print(f"{m} nodes x {p} processes, {params:,} parameters; MB per step on a node's link")
    print(f"{'contender':<44} {'measured':>9} {'flat':>9} {'vs flat':>8} {'optimum':>9} {'vs opt':>7}")
    rows = []
    for r in results:
        spec = r["spec"]
        name, _, opts = spec.partition(":")
        hier = opts == "hierarchical=true"
        if r.get("kind") != "unison" or (opts and not hier):
            continue
        flat = by_spec.get(name) if hier else None
        opt = optimum(name, params, r["steps"], m, psgd) if hier or p == 1 else None  # flat at P = 1: two levels
        measured = r["link_bytes_per_step"]
        row = {
            "spec": spec,
            "measured": measured,
            "flat": flat["link_bytes_per_step"] if flat else None,
            "vs_flat": measured / flat["link_bytes_per_step"] if flat else None,
            "optimum": opt,
            "vs_optimum": measured / opt if opt else None,
        }
        rows.append(row)
        print(
            f"{spec:<44} {fmt(measured):>9} {fmt(row['flat']):>9} {fmt(row['vs_flat'], 1):>8} "
            f"{fmt(opt):>9} {fmt(row['vs_optimum'], 1):>7}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"source": args.json, "nodes": m, "procs_per_node": p, "params": params, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
