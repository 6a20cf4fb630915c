"""How much sooner, on your hardware at your bandwidth: a time-to-target model from measured quantities.

For each contender of ``bench_charlm.py --curve --seeds`` runs (the fair comparison of
docs/benchmarks.md), from what was measured only:

- its steps to a target validation loss (the first step its seed-mean curve reaches it,
  interpolated between evaluations);
- its bytes a step (unison's own counter, on the ranks of those runs), carried to ``N`` nodes by the
  collective it uses: a ring all-reduce sends ``2 (N - 1) / N`` times its payload, an all-gather
  ``N - 1`` times its message; per parameter, so that it carries to a model of ``P`` parameters;
- its syncs a step (1, or ``1 / period``), each costing the collective's latency hops
  (``2 (N - 1)`` for a ring all-reduce, ``N - 1`` for an all-gather);
- the compute of a step, on this machine (measured here: charlm small's forward, backward and
  AdamW on one thread, batch 32 x 64, ``bench_codecs.charlm_step_seconds``; or ``--cpu-ms``) and
  on a GPU (``--gpu-ms`` for a model of ``--gpu-params``: REFERENCE.md's GPT-2 small on an H200,
  26-31 ms: 28).

A step takes ``compute + bytes * 8 / bandwidth + syncs * hops * latency`` (the syncs block; torch
DDP's, allreduce's and demo's collectives overlap backward, so theirs take ``max(compute, comm)``), and
the time to target is the steps to target times that. The steps to target are those measured
on the runs' ranks (4 on 2 x 2) for every ``N``: how they change with ``N`` is not measured here.

``--validate EMULATED --compute-run LOOPBACK`` checks the step model against a measured
emulated-network run of ``unison bench`` (the same contenders at a limited bandwidth, nodes of
one process): each contender's predicted time to target there (its own steps to target times
the compute the loopback run measured plus its bytes over the link) against the measured one.

    python benchmarks/time_to_target.py benchmarks/results/frontier_small_*.json --target 1.6 \\
        --json benchmarks/results/time_to_target.json --plot benchmarks/results/time_to_target.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from common import split_contenders

import unison

NODES = [2, 4, 8, 16, 32, 64]
BANDWIDTHS = {"10 Mbit/s": 1e7, "100 Mbit/s": 1e8, "1 Gbit/s": 1e9, "10 Gbit/s": 1e10, "100 Gbit/s": 1e11}
#: The collective each family sends with; every other step-synchronous algorithm is refused.
GATHER = {"sparseloco", "demo"}
RING = {"allreduce", "ddp", "diloco", "local_sgd"}
#: Whose collectives overlap backward (bucket by bucket): a step takes the longer of compute and comm.
OVERLAPPED = {"allreduce", "ddp", "demo"}


def family(spec: str) -> str:
    return spec.partition("@")[0].partition(":")[0]


def syncs_per_step(spec: str) -> float:
    """1 for a gradient algorithm, ``1 / period`` for a model-averaging one (its own default period)."""
    name = spec.partition("@")[0]
    if family(name) in {"allreduce", "ddp", "demo"}:
        return 1.0
    return 1.0 / unison.algorithms.create(name).period


def scale(kind: str, ranks: int, nodes: int) -> float:
    """What a rank sends on ``nodes`` over what it sent on ``ranks``, for the collective ``kind``."""
    if kind == "ring":
        return (2 * (nodes - 1) / nodes) / (2 * (ranks - 1) / ranks)
    return (nodes - 1) / (ranks - 1)


def hops(kind: str, nodes: int) -> int:
    return 2 * (nodes - 1) if kind == "ring" else nodes - 1


def kind_of(spec: str) -> str:
    f = family(spec)
    if f in GATHER:
        return "gather"
    if f in RING:
        return "ring"
    raise SystemExit(f"{spec}: the model knows the collectives of {sorted(GATHER | RING)} only")


def steps_to(curve: list[list[float]], target: float) -> Optional[float]:
    """The step a ``[[step, loss], ...]`` curve first reaches ``target``, interpolated; None if never."""
    prev_step, prev_loss = 0.0, math.inf
    for step, loss in curve:
        if loss <= target:
            if math.isinf(prev_loss):
                return step
            return prev_step + (step - prev_step) * (prev_loss - target) / (prev_loss - loss)
        prev_step, prev_loss = step, loss
    return None


def mean_curve(runs: list[dict]) -> list[list[float]]:
    """The seeds' curves averaged point by point (they share their evaluation steps)."""
    curves = [r["curve"] for r in runs]
    return [[points[0][0], sum(p[1] for p in points) / len(points)] for points in zip(*curves)]


def contenders(paths: list[str], keep: Optional[list[str]] = None) -> list[dict]:
    """Every contender of every run (or those named in ``keep``, each from the first run holding
    it): its mean curve, its bytes a step per parameter, its ranks, its collective and syncs."""
    out: list[dict] = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        ranks = run["config"]["nodes"] * run["config"]["procs_per_node"]
        params = run["info"]["params"]
        for name, r in run["results"].items():
            if (keep is not None and name not in keep) or any(c["spec"] == name for c in out):
                continue
            runs = r.get("runs", [r])
            if "curve" not in runs[0]:
                raise SystemExit(f"{path}: {name} has no curve (run bench_charlm.py with --curve)")
            out.append(
                {
                    "spec": name,
                    "curve": [list(p) for p in mean_curve(runs)],
                    "bytes_per_param": r["bytes_per_step"] / params,
                    "ranks": ranks,
                    "kind": kind_of(name),
                    "syncs_per_step": syncs_per_step(name),
                }
            )
    return out


def step_seconds(c: dict, compute_s: float, params: float, nodes: int, bandwidth: float, latency: float) -> float:
    """One step of contender ``c`` on ``nodes`` nodes at ``bandwidth`` bits/s and ``latency`` s."""
    sent = c["bytes_per_param"] * params * scale(c["kind"], c["ranks"], nodes)
    comm = sent * 8 / bandwidth + c["syncs_per_step"] * hops(c["kind"], nodes) * latency
    if family(c["spec"]) in OVERLAPPED:
        return max(compute_s, comm)
    return compute_s + comm


def table(cs: list[dict], target: float, compute_s: float, params: float, latency: float) -> dict:
    """Predicted seconds to target for every contender, bandwidth and node count (None: never reached)."""
    out: dict = {}
    for c in cs:
        steps = steps_to(c["curve"], target)
        c["steps_to_target"] = steps
        out[c["spec"]] = {
            label: {
                str(n): None if steps is None else steps * step_seconds(c, compute_s, params, n, bw, latency)
                for n in NODES
            }
            for label, bw in BANDWIDTHS.items()
        }
    return out


def print_table(title: str, predicted: dict, baseline: Optional[str]) -> None:
    print(f"\n{title}: predicted seconds to target (x sooner than {baseline})")
    for label in BANDWIDTHS:
        print(f"| {label} | " + " | ".join(f"{n} nodes" for n in NODES) + " |")
        print("|---" * (len(NODES) + 1) + "|")
        for spec, by_bw in predicted.items():
            cells = []
            for n in NODES:
                t = by_bw[label][str(n)]
                base = predicted.get(baseline, {}).get(label, {}).get(str(n)) if baseline else None
                if t is None:
                    cells.append("not reached")
                else:
                    cells.append(f"{t:,.0f} s" + (f" ({base / t:.1f}x)" if base else ""))
            print(f"| {spec} | " + " | ".join(cells) + " |")


def reached_at(curve: list[list[float]], target: float) -> tuple[Optional[float], Optional[int]]:
    """``(training seconds, step)`` of the first evaluation of a ``unison bench`` curve
    (``[seconds, step, loss]``) at or below ``target``; ``(None, None)`` if none is."""
    for seconds, step, loss in curve:
        if loss <= target:
            return seconds, int(step)
    return None, None


def validate(emulated_path: str, loopback_path: str, target: Optional[float] = None) -> list[dict]:
    """Predicted against measured time to target of an emulated ``unison bench`` run: its own
    steps to target (to ``target``, else the run's) times the loopback run's step time (compute
    and little else) plus its bytes over the emulated link."""
    with open(emulated_path) as f:
        emulated = json.load(f)
    with open(loopback_path) as f:
        loopback = {c["spec"]: c for c in json.load(f)["contenders"]}
    bandwidth = emulated["network"]["bandwidth_bits_per_s"]
    latency = emulated["network"]["latency_s"] if emulated["network"].get("latency_emulated") else 0.0
    nodes = emulated["world"]["nodes"]
    out = []
    for c in emulated["contenders"]:
        measured, steps = c.get("time_to_target_s"), c.get("steps_to_target")
        if target is not None:
            measured, steps = reached_at(c["curve"], target)
        base = loopback.get(c["spec"])
        if measured is None or steps is None or base is None:
            continue
        spec = c["spec"]
        kind = kind_of(spec)
        comm = c["bytes_per_step"] * 8 / bandwidth + syncs_per_step(spec) * hops(kind, nodes) * latency
        compute = base["step_ms"] / 1000
        step = max(compute, comm) if family(spec) in OVERLAPPED else compute + comm
        predicted = steps * step
        error = predicted / measured - 1
        out.append(
            {"spec": spec, "steps_to_target": steps, "measured_s": measured, "predicted_s": predicted, "error": error}
        )
    return out


def plot(path: str, hardware: dict, nodes: int = 8) -> None:
    """Seconds to target against bandwidth at ``nodes`` nodes, one panel per hardware."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(hardware), figsize=(6 * len(hardware), 4.5), squeeze=False)
    xs = list(BANDWIDTHS.values())
    for ax, (title, predicted) in zip(axes[0], hardware.items()):
        for spec, by_bw in predicted.items():
            ys = [by_bw[label][str(nodes)] for label in BANDWIDTHS]
            if all(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", label=spec)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth (bit/s)")
        ax.set_ylabel("seconds to target")
        ax.set_title(f"{title}, {nodes} nodes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="bench_charlm.py JSON files (with --curve)")
    parser.add_argument("--target", type=float, help="the validation loss to reach")
    parser.add_argument("--contenders", help="the contenders to keep, comma-separated (default: every one)")
    parser.add_argument("--baseline", default="allreduce", help="the contender the speed-ups are against")
    parser.add_argument("--cpu-ms", type=float, help="compute of one step on this machine, ms (default: measured)")
    parser.add_argument("--gpu-ms", type=float, default=28.0, help="compute of one step on the GPU, ms")
    parser.add_argument("--gpu-params", type=float, default=124e6, help="parameters of the GPU's model")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one hop's latency, ms")
    parser.add_argument("--validate", help="an emulated-network unison bench JSON to check the step model against")
    parser.add_argument("--compute-run", help="with --validate: the same contenders' unison bench JSON on loopback")
    parser.add_argument("--validate-target", type=float, help="with --validate: this loss instead of the run's target")
    parser.add_argument("--json", help="write the predictions (and the validation) here")
    parser.add_argument("--plot", help="draw seconds to target against bandwidth here (PNG)")
    args = parser.parse_args(argv)
    out: dict = {}
    if args.runs:
        if args.target is None:
            raise SystemExit("give --target with the runs")
        if args.cpu_ms is None:
            from bench_codecs import charlm_step_seconds

            args.cpu_ms = 1000 * charlm_step_seconds("small", 20)[0]
        out["cpu_ms"] = args.cpu_ms
        cs = contenders(args.runs, split_contenders(args.contenders) if args.contenders else None)
        with open(args.runs[0]) as f:
            params = json.load(f)["info"]["params"]
        latency = args.latency_ms / 1000
        hardware = {
            f"this machine ({params:,} parameters, {args.cpu_ms:g} ms a step)": table(
                cs, args.target, args.cpu_ms / 1000, params, latency
            ),
            f"GPU ({args.gpu_params:,.0f} parameters, {args.gpu_ms:g} ms a step)": table(
                cs, args.target, args.gpu_ms / 1000, args.gpu_params, latency
            ),
        }
        for title, predicted in hardware.items():
            print_table(title, predicted, args.baseline)
        print("\nsteps to target: " + ", ".join(f"{c['spec']} {c['steps_to_target']}" for c in cs))
        out.update({"target": args.target, "steps_to_target": {c["spec"]: c["steps_to_target"] for c in cs}})
        out["predicted"] = hardware
        if args.plot:
            plot(args.plot, hardware)
    if args.validate:
        if not args.compute_run:
            raise SystemExit("--validate needs --compute-run (the same contenders on loopback)")
        checks = validate(args.validate, args.compute_run, args.validate_target)
        print("\nstep model against the emulated run:")
        for c in checks:
            print(
                f"  {c['spec']:40} {c['steps_to_target']:>5} steps: predicted {c['predicted_s']:7.1f} s, "
                f"measured {c['measured_s']:7.1f} s ({c['error']:+.0%})"
            )
        out["validation"] = checks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
