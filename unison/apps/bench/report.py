"""What ``unison bench`` reports: figures per contender, a table, JSON, PNG plots and one recommendation.

``summarize`` turns the contenders' raw results into the report: the target
(given, within 2% of one contender's final quality with ``--target-from``, the
workload's default, or within 2% of the best final quality when the workload
has none), each contender's time and steps to reach it (the
first evaluation at or past it, in training time: evaluations pause the
clock), and speed-ups against torch DDP (DDP's step time or time to target
over the contender's: above 1 is faster). A hierarchical contender whose flat
twin ran too (``allreduce:hierarchical=true`` and ``allreduce``) is compared
with it: the bytes on each node's link and the speed-ups over the twin. The
gradient allreduces (allreduce, nonblocking, fp16, bf16) also get the bytes a
node's link carries per step at best, flat and with two levels.
``print_table``, ``write_json`` and ``write_plots`` present it; ``recommend``
names the fastest contender that reached the target.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional

from . import contenders
from .workloads import Settings, reached

BASELINE = "ddp"
RELATIVE_TARGET = 0.02
#: Bytes per parameter on the wire of the gradient allreduces (whose link bytes are simple to state).
WIRE_BYTES = {"allreduce": 4, "nonblocking": 4, "fp16": 2, "bf16": 2}


def pick_target(
    results: list[dict], settings: Settings, given: Optional[float], target_from: Optional[str] = None
) -> tuple[Optional[float], str]:
    """The target quality and where it came from: ``given``; within 2% of the final quality of the
    contender ``target_from``; the workload's default; or within 2% of the best final quality."""
    if given is not None:
        return given, "--target"
    if target_from is not None:
        ref = next((r for r in results if r.get("spec") == target_from), None)
        label = ref["label"] if ref else target_from
        if ref is None or ref.get("status") != "ok" or not _finite(ref.get("final_quality")):
            return None, f"none ({label}, the reference, did not finish)"
        return _near(
            ref["final_quality"], settings
        ), f"within {RELATIVE_TARGET:.0%} of {label}'s final {settings.metric}"
    if settings.target is not None:
        return settings.target, "workload default"
    finals = [r["final_quality"] for r in results if r.get("status") == "ok" and _finite(r.get("final_quality"))]
    if not finals:
        return None, "none (no contender finished)"
    best = max(finals) if settings.higher_is_better else min(finals)
    return _near(best, settings), f"within {RELATIVE_TARGET:.0%} of the best final {settings.metric}"


def _near(quality: float, settings: Settings) -> float:
    """The quality 2% worse than ``quality``: a target just short of it."""
    return (
        quality - RELATIVE_TARGET * abs(quality)
        if settings.higher_is_better
        else quality + RELATIVE_TARGET * abs(quality)
    )


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def time_to_target(
    curve: list[list[float]], target: Optional[float], higher_is_better: bool
) -> tuple[Optional[float], Optional[int]]:
    """(training seconds, steps) at the first evaluation that reached ``target``; (None, None) if none did."""
    if target is None:
        return None, None
    for t, step, q in curve:
        if _finite(q) and reached(q, target, higher_is_better):
            return t, int(step)
    return None, None


def summarize(
    results: list[dict],
    settings: Settings,
    given_target: Optional[float],
    target_from: Optional[str] = None,
    nodes: int = 1,
    procs_per_node: int = 1,
) -> dict[str, Any]:
    """Add time to target, speed-ups vs DDP, the flat/hierarchical comparison and the ideal link bytes
    to each result; return the target and recommendation."""
    target, source = pick_target(results, settings, given_target, target_from)
    for r in results:
        if r.get("status") == "ok":
            r["time_to_target_s"], r["steps_to_target"] = time_to_target(r["curve"], target, settings.higher_is_better)
    base = next((r for r in results if r["spec"] == BASELINE and r.get("status") == "ok"), None)
    for r in results:
        if r.get("status") != "ok":
            continue
        r["speedup_vs_ddp"] = {
            "step": _ratio(base["step_ms"] if base else None, r["step_ms"]),
            "target": _ratio(base.get("time_to_target_s") if base else None, r.get("time_to_target_s")),
        }
        r["link_bytes_flat_ring"], r["link_bytes_two_level"] = ideal_link_bytes(r, nodes, procs_per_node)
    compare_twins(results)
    return {
        "target": {
            "value": target,
            "source": source,
            "metric": settings.metric,
            "higher_is_better": settings.higher_is_better,
        },
        "recommendation": recommend(results, settings, target),
    }


def _ratio(base: Optional[float], value: Optional[float]) -> Optional[float]:
    return base / value if base and value else None


def ideal_link_bytes(result: dict, nodes: int, procs_per_node: int) -> tuple[Optional[float], Optional[float]]:
    """Bytes per step on a node's link for a gradient allreduce of S bytes on M nodes of P processes:
    2(N-1)/N x S for a flat ring of N = M x P processes, 2(M-1)/M x S with two levels; (None, None) for
    the other contenders, and on one node (no link)."""
    name = result["spec"].partition(":")[0]
    if name not in WIRE_BYTES or not result.get("params") or nodes < 2:
        return None, None
    size, world = WIRE_BYTES[name] * result["params"], nodes * procs_per_node
    return 2 * (world - 1) / world * size, 2 * (nodes - 1) / nodes * size


def compare_twins(results: list[dict]) -> None:
    """Pair each hierarchical result with its flat twin (same algorithm and other options) when both ran:
    the flat one gets ``hierarchical_twin``; the hierarchical one ``flat_twin``, ``link_bytes_vs_flat``
    (its link bytes per step over the twin's; None without an emulated network) and ``step_vs_flat`` and
    ``target_vs_flat`` (the twin's step time and time to target over its own: above 1 is faster)."""
    ok = [r for r in results if r.get("status") == "ok"]
    forms = {r["spec"]: contenders.flat_form(r["spec"]) for r in ok}
    flat: dict[str, dict] = {}
    for r in ok:
        form = forms[r["spec"]]
        if form is not None and not form[1]:
            flat.setdefault(form[0], r)
    for r in ok:
        form = forms[r["spec"]]
        twin = flat.get(form[0]) if form is not None and form[1] else None
        if twin is None:
            continue
        twin["hierarchical_twin"] = r["spec"]
        r["flat_twin"] = twin["spec"]
        r["link_bytes_vs_flat"] = _ratio(r.get("link_bytes_per_step"), twin.get("link_bytes_per_step"))
        r["step_vs_flat"] = _ratio(twin["step_ms"], r["step_ms"])
        r["target_vs_flat"] = _ratio(twin.get("time_to_target_s"), r.get("time_to_target_s"))


def recommend(results: list[dict], settings: Settings, target: Optional[float]) -> dict[str, Any]:
    """The fastest contender to the target (or, if none reached it, the highest throughput), in one line."""
    ok = [r for r in results if r.get("status") == "ok"]
    hit = [r for r in ok if r.get("time_to_target_s") is not None]
    if hit:
        best = min(hit, key=lambda r: r["time_to_target_s"])
        vs = best.get("speedup_vs_ddp", {}).get("target")
        versus = f", {vs:.1f}x as fast as torch DDP" if vs and best["spec"] != BASELINE else ""
        text = (
            f"Use {best['label']}: it reached {settings.metric} {_fmt_q(target)} first, "
            f"in {best['time_to_target_s']:.1f} s of training{versus}."
        )
        form = contenders.flat_form(best["spec"])
        if form is None or not form[1]:
            return {"contender": best["spec"], "text": text}
        return {"contender": best["spec"], "text": text + _hierarchical_note(best, ok), "hierarchical": True}
    if ok:
        best = max(ok, key=lambda r: r.get("samples_per_s") or 0)
        text = (
            f"No contender reached {settings.metric} {_fmt_q(target)}; the highest throughput was "
            f"{best['label']} ({best['samples_per_s']:,.0f} samples/s). Train longer (--steps, --time-budget) or lower --target."
        )
        return {"contender": None, "text": text}
    return {"contender": None, "text": "Every contender failed; see the errors above and the logs."}


def _hierarchical_note(best: dict, ok: list[dict]) -> str:
    """What the winner's two levels gained over its flat twin, in a sentence."""
    twin = next((r for r in ok if r["spec"] == best.get("flat_twin")), None)
    if twin is None:
        return " It is hierarchical (its flat twin did not run or failed)."
    if twin.get("time_to_target_s") is None:
        return f" It is hierarchical; its flat twin {twin['label']} did not reach the target."
    if best.get("target_vs_flat") is None:  # it reached the target at the first evaluation
        return f" It is hierarchical; its flat twin {twin['label']} took {twin['time_to_target_s']:.1f} s."
    return (
        f" It is hierarchical: {best['target_vs_flat']:.2f}x as fast to the target as its flat twin "
        f"{twin['label']} ({twin['time_to_target_s']:.1f} s)."
    )


def _fmt_q(q: Optional[float]) -> str:
    return "n/a" if q is None else f"{q:.4g}"


# ---- the terminal table ------------------------------------------------------------
def _mb(r: dict) -> Optional[float]:
    """MB per step: on the emulated links when measured, else this rank's own count."""
    value = r.get("link_bytes_per_step")
    if value is None:
        value = r.get("bytes_per_step")
    return None if value is None else value / 1e6


def print_table(report: dict, console=None) -> None:
    """The rich table of every contender, and the recommendation under it."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 120)
    target = report["target"]
    linked = any(r.get("link_bytes_per_step") is not None for r in report["contenders"])
    twins = any(r.get("link_bytes_vs_flat") is not None for r in report["contenders"])
    table = Table(
        title=f"unison bench: {report['workload']['name']} on {report['network']['summary']}",
        caption=f"target: {target['metric']} {_fmt_q(target['value'])} ({target['source']}); "
        "xDDP: torch DDP's time over the contender's (above 1: faster)"
        + ("; MB/step measured on each node's link" if linked else "; MB/step sent by one rank")
        + ("; vs flat: a hierarchical contender's MB/step over its flat twin's" if twins else ""),
    )
    table.add_column("contender", style="bold")
    headers = ["ms/step", "samples/s", "MB/step"] + (["vs flat"] if twins else [])
    for header in headers + ["to target", "final", "xDDP step", "xDDP target"]:
        table.add_column(header, justify="right", no_wrap=True)
    for r in report["contenders"]:
        if r.get("status") != "ok":
            style = "dim" if r.get("status") == "not installed" else "red"
            table.add_row(escape(r["label"]), f"[{style}]{r['status']}[/]", *[""] * (len(headers) + 3))
            continue
        tt = r.get("time_to_target_s")
        sp = r.get("speedup_vs_ddp", {})
        label = r["label"]
        if r.get("autotune"):
            label += f" [{_fmt_mb(r['autotune']['chosen_mb'])}]"
        table.add_row(
            escape(label),
            f"{r['step_ms']:.1f}",
            f"{r['samples_per_s']:,.0f}",
            f"{_mb(r):.2f}",
            *([_fmt_x(r.get("link_bytes_vs_flat"))] if twins else []),
            "never" if tt is None else f"{tt:.1f} s",
            f"{r['final_quality']:.4f}",
            _fmt_x(sp.get("step")),
            _fmt_x(sp.get("target")),
        )
    console.print(table)
    for r in report["contenders"]:
        if r.get("status") in ("failed", "not installed"):
            console.print(f"[red]{escape(r['label'])}: {r['status']}: {escape(r.get('error', ''))}[/]")
        if r.get("autotune"):
            a = r["autotune"]
            console.print(
                f"{escape(r['label'])}: autotune chose {_fmt_mb(a['chosen_mb'])} buckets "
                f"({a['gain']:.2f}x the step time at the default {_fmt_mb(a['default_mb'])}; "
                f"measured {', '.join(f'{_fmt_mb(float(k))}: {v:.1f} ms' for k, v in a['step_ms'].items())})"
            )
    for line in stop_notes(report):
        console.print(escape(line))
    if report["network"].get("note"):
        console.print(f"[yellow]note: {escape(report['network']['note'])}[/]")
    console.print(f"[bold green]{escape(report['recommendation']['text'])}[/]")


def stop_notes(report: dict) -> list[str]:
    """One line per contender that trained past its time budget to reach the target, or that the
    time cap stopped (the others stopped at their last step or at the time budget, as asked)."""
    w, lines = report["workload"], []
    for r in report["contenders"]:
        if r.get("status") != "ok":
            continue
        if r.get("stopped") == "target":
            lines.append(
                f"{r['label']}: still short of the target when its {w['time_budget_s']:g} s time budget was spent, "
                f"it trained on until it reached it ({r['time_to_target_s']:.1f} s, step {r['steps_to_target']} of {w['steps']})."
            )
        elif r.get("stopped") == "time cap":
            why = "" if r.get("time_to_target_s") is not None else ", short of the target"
            lines.append(
                f"{r['label']}: stopped at the {w.get('time_cap_s', 0):g} s time cap{why}, after {r['steps']} of {w['steps']} steps."
            )
    return lines


def _fmt_x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _fmt_mb(mb: float) -> str:
    return f"{mb:g} MiB"


# ---- JSON ----------------------------------------------------------------------
def write_json(report: dict, path: str) -> None:
    """The whole report (settings, network, every contender with its curve) as JSON."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=_plain)
        f.write("\n")


def _plain(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


# ---- plots ---------------------------------------------------------------------
def write_plots(report: dict, out_dir: str) -> list[str]:
    """The PNGs of a report, in ``out_dir``; returns their paths.

    quality.png: quality against training time (log scale, so fast and slow
    contenders both show), zoomed on the target, a star where each contender
    first reached it. time_to_target.png, throughput.png and bytes.png: bars.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in report["contenders"] if r.get("status") == "ok"]
    if not ok:
        return []
    title = f"{report['workload']['name']}, {report['network']['summary']}"
    paths = [_quality_plot(ok, report["target"], title, os.path.join(out_dir, "quality.png"))]
    reached_it = sorted((r for r in ok if r.get("time_to_target_s") is not None), key=lambda r: r["time_to_target_s"])
    if reached_it:
        target = report["target"]
        paths.append(
            _bars(
                [r["label"] for r in reached_it],
                [r["time_to_target_s"] for r in reached_it],
                f"training seconds to {target['metric']} {_fmt_q(target['value'])} (shorter is better)",
                f"time to target: {title}",
                os.path.join(out_dir, "time_to_target.png"),
                reached_it,
            )
        )
    paths.append(
        _bars(
            [r["label"] for r in ok],
            [r["samples_per_s"] for r in ok],
            "samples/s (all ranks)",
            f"throughput: {title}",
            os.path.join(out_dir, "throughput.png"),
            ok,
        )
    )
    linked = all(r.get("link_bytes_per_step") is not None for r in ok)
    values = [(r["link_bytes_per_step"] if linked else r["bytes_per_step"]) / 1e6 for r in ok]
    what = "MB per step on each node's link (measured)" if linked else "MB sent per step by one rank"
    paths.append(
        _bars(
            [r["label"] for r in ok],
            values,
            what,
            f"communication: {title}",
            os.path.join(out_dir, "bytes.png"),
            ok,
            log=True,
        )
    )
    plt.close("all")
    return paths


def _quality_plot(ok: list[dict], target: dict, title: str, path: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    if len(ok) > 10:
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # type: ignore[attr-defined]  # a ListedColormap
    for r in ok:
        points = [p for p in r["curve"] if p[0] > 0 and _finite(p[2])]  # log time axis: the start is left out
        baseline = r["spec"] == BASELINE
        (line,) = ax.plot(
            [p[0] for p in points],
            [p[2] for p in points],
            marker=".",
            markersize=4,
            linewidth=2.6 if baseline else 1.3,
            label=r["label"],
            color="black" if baseline else None,
            zorder=3 if baseline else 2,
        )
        hit = r.get("time_to_target_s")
        if hit:
            q = next(p[2] for p in r["curve"] if p[0] == hit)
            ax.plot([hit], [q], marker="*", markersize=13, color=line.get_color(), markeredgecolor="black", zorder=4)
    ax.set_xscale("log")
    value, higher = target["value"], target["higher_is_better"]
    if value is not None:
        ax.axhline(value, color="grey", linestyle="--", linewidth=1, label=f"target {_fmt_q(value)}")
        finals = [r["final_quality"] for r in ok if _finite(r.get("final_quality"))]
        best = max(finals) if higher else min(finals)
        margin = 4 * max(abs(best - value), 1e-3 * abs(value) or 1e-3)
        lo, hi = (value - margin, best + margin / 4) if higher else (best - margin / 4, value + margin)
        ax.set_ylim(lo, hi)
    ax.set_xlabel("training time, s (log scale; evaluations excluded); star: target first reached")
    ax.set_ylabel(target["metric"] + (" (higher is better)" if higher else " (lower is better)"))
    ax.set_title(f"{target['metric']} against training time\n{title}", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def _bars(labels, values, xlabel, title, path, results, log=False) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 1.6))
    colors = ["black" if r["spec"] == BASELINE else "tab:blue" for r in results]
    shown = [max(v, 1e-6) if log else v for v in values]
    ax.barh(labels, shown, color=colors)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    for y, v in enumerate(values):
        ax.text(shown[y], y, f" {v:,.3g}", va="center", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
