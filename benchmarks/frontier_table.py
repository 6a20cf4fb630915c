"""One table from several ``bench_charlm.py --seeds`` runs: each contender with the settings its
run trained it with, its validation loss over the seeds (mean, standard deviation, range), its
bytes a step, and both against a baseline contender (the best fp32 DiLoCo, say).

Each run may train its contenders with its own inner loop (a paper's AdamW betas, weight decay,
clipping and schedule, or a tuned learning rate), so contenders each at their own paper's
settings sit in one table. Prints a Markdown table (docs/benchmarks.md shows it); writes the
merged figures with ``--json``.

    python benchmarks/frontier_table.py benchmarks/results/frontier_small_*.json \\
        --baseline 'diloco:fragments=1,delay=0' --json benchmarks/results/frontier_small.json
"""

from __future__ import annotations

import argparse
import json
import sys


def settings(config: dict) -> str:
    """The inner loop a run trained with, in a few words."""
    betas = config.get("betas", [0.9, 0.999])
    clip = config.get("clip") or 0
    words = f"AdamW lr {config['lr']:g} betas {betas[0]:g}/{betas[1]:g} wd {config['weight_decay']:g}"
    words += f", {config['schedule']}" + (f" (warm-up {config['warmup']})" if config["schedule"] == "cosine" else "")
    return words + (f", clip {clip:g}" if clip else "")


def rows(paths: list[str]) -> list[dict]:
    """Every contender of every run, with its run's settings (an ``@sgd:LR`` contender names its own optimizer)."""
    out = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        config = run["config"]
        for name, r in run["results"].items():
            inner = name.partition("@")[2]
            out.append(
                {
                    "contender": name,
                    "file": path,
                    "settings": f"{inner.replace(':', ' lr ')} (SGD)" if inner.startswith("sgd") else settings(config),
                    "seeds": config.get("seeds") or [config["seed"]],
                    "epochs": config["epochs"],
                    "val_loss": r["val_loss"],
                    "val_loss_std": r.get("val_loss_std", 0.0),
                    "val_loss_min": r.get("val_loss_min", r["val_loss"]),
                    "val_loss_max": r.get("val_loss_max", r["val_loss"]),
                    "bytes_per_step": r["bytes_per_step"],
                }
            )
    return out


def share(ratio: float) -> str:
    """``ratio`` as "1/55" below one, "16.2x" above."""
    return f"1/{1 / ratio:.0f}" if ratio < 1 else f"{ratio:.1f}x"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files of bench_charlm.py")
    parser.add_argument("--baseline", required=True, help="the contender the ratios are to (the first run holding it)")
    parser.add_argument("--json", help="write the merged table here")
    args = parser.parse_args(argv)
    table = rows(args.runs)
    base = next((r for r in table if r["contender"] == args.baseline), None)
    if base is None:
        raise SystemExit(f"no run holds the baseline {args.baseline!r}: {sorted({r['contender'] for r in table})}")
    for r in table:
        r["loss_ratio"] = r["val_loss"] / base["val_loss"]
        r["bytes_ratio"] = r["bytes_per_step"] / base["bytes_per_step"]
    print(f"against {args.baseline} ({base['settings']}): val loss {base['val_loss']:.4f}")
    print("| contender | inner loop | seeds | val loss (mean +- sd, range) | / baseline | bytes a step | / baseline |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['contender']} | {r['settings']} | {len(r['seeds'])} | {r['val_loss']:.4f} +- {r['val_loss_std']:.4f} "
            f"({r['val_loss_min']:.4f}-{r['val_loss_max']:.4f}) | {r['loss_ratio']:.3f} | "
            f"{r['bytes_per_step']:,.0f} | {share(r['bytes_ratio'])} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": args.baseline, "runs": args.runs, "rows": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
