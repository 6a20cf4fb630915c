"""The ``unison bench`` command line: options, then network, contenders, report.

``add_parser(subparsers)`` declares the subcommand (``unison.cli`` registers
it); ``run(args)`` carries it out and returns the exit code. rich draws the
output, imported only when a bench runs (the ``bench`` extra installs it):
declaring the subcommand needs torch alone, as the rest of ``unison`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..argtypes import positive_float, positive_int
from . import contenders, deps, netem, report, runner, workloads

if TYPE_CHECKING:
    from rich.console import Console


def escape(text: str) -> str:
    """``text`` with rich's markup escaped (rich imported on first use)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _checked(parse):
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return check


def add_parser(subparsers) -> None:
    """Declare ``unison bench`` and its options."""
    p = subparsers.add_parser(
        "bench",
        help="which algorithm reaches a target quality fastest on a given network, against torch DDP and other peers",
        description="Train a workload with every contender (unison's algorithms, torch DDP and its hooks, "
        "pytorch-pfn-extras DDP) on an emulated network of NODES x PROCS-PER-NODE processes, and report "
        "step time, throughput, bytes per step, time to a target quality and final quality, as a table, "
        "JSON and PNG plots, with one recommendation. Network emulation (Linux namespaces and tc) needs root "
        "and iproute2; without them the processes talk over plain loopback.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    what = p.add_argument_group("what to train")
    what.add_argument("--workload", choices=workloads.NAMES, default="digits", help="built-in workload")
    what.add_argument(
        "--model",
        metavar="SIZE|PKG.MOD:FACTORY",
        default=None,
        help="the workload's size (charlm: small, medium (3.2M parameters), large (10.7M)), or your own model: "
        "factory() returns (model, dataset, loss_fn) and replaces --workload",
    )
    what.add_argument(
        "--contenders",
        default=None,
        metavar="LIST",
        help="comma list of unison algorithms (with options: powersgd:rank=2) and peers "
        f"({', '.join(contenders.PEERS)}); default: all (with --quick: {','.join(contenders.QUICK)}), and on "
        "several nodes of several processes each algorithm's hierarchical=true twin after it",
    )
    what.add_argument("--list", action="store_true", help="print every contender and exit")
    net = p.add_argument_group("the network")
    net.add_argument(
        "--network",
        choices=netem.PRESETS,
        default="lan",
        help="a named network, each node's link: "
        + ", ".join(f"{name} ({rate}, {delay})" for name, (rate, delay) in netem.PRESETS.items())
        + "; --bandwidth and --latency override its parts",
    )
    net.add_argument(
        "--bandwidth",
        type=_checked(netem.parse_rate),
        default=None,
        help="each node's link rate, tc syntax (100mbit, 10gbit) or 'unlimited' (default: the --network's)",
    )
    net.add_argument(
        "--latency",
        type=_checked(netem.parse_delay),
        default=None,
        help="one-way delay between nodes (500us, 2ms) or 0 (default: the --network's)",
    )
    net.add_argument("--nodes", type=positive_int, default=2, help="emulated machines")
    net.add_argument(
        "--procs-per-node", type=positive_int, default=1, help="processes per machine (they share its loopback)"
    )
    net.add_argument("--no-emulation", action="store_true", help="run on plain loopback even as root")
    net.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, and exit")
    how = p.add_argument_group("how long and how judged (defaults depend on the workload)")
    how.add_argument("--steps", type=positive_int, default=None, help="training steps per contender")
    how.add_argument(
        "--time-budget",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="training seconds per contender; one still short of a known target then trains on "
        "until it reaches it, its last step or --time-cap",
    )
    how.add_argument(
        "--time-cap",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help=f"most training seconds for a contender still short of the target after its time budget "
        f"(default: {runner.TIME_CAP_FACTOR:g} x the time budget; equal to it: a hard budget)",
    )
    how.add_argument("--target", type=float, default=None, help="target quality (accuracy as a fraction, or a loss)")
    how.add_argument(
        "--target-from",
        default=None,
        metavar="CONTENDER",
        help="target: within 2%% of this contender's final quality (e.g. allreduce); it runs first, "
        "for its whole step budget (up to --time-cap), and is added if not listed",
    )
    how.add_argument("--eval-every", type=positive_int, default=None, help="steps between evaluations")
    how.add_argument("--batch-size", type=positive_int, default=None, help="samples per step on each rank")
    how.add_argument("--lr", type=positive_float, default=None, help="learning rate")
    how.add_argument("--seed", type=int, default=0, help="seed of the data split and the model")
    how.add_argument(
        "--quick",
        action="store_true",
        help="5 contenders (and 4 hierarchical twins with --procs-per-node > 1), short runs: a few minutes at most",
    )
    how.add_argument(
        "--contender-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="fail a contender that runs longer (default: 180 + 3 x the time cap)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--out", default="bench-results", metavar="DIR", help="folder for the plots, JSON and logs")
    out.add_argument(
        "--json", default=None, metavar="PATH", help="write the JSON report here (default: DIR/bench.json)"
    )
    out.add_argument(
        "--no-plot",
        action="store_true",
        help="write no PNG plots (then matplotlib is not needed; without this flag a missing "
        "matplotlib stops the bench before it starts)",
    )
    p.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> runner.BenchConfig:
    rate, delay = netem.PRESETS[getattr(args, "network", None) or "lan"]
    return runner.BenchConfig(
        workload=args.workload,
        model=args.model,
        contenders=args.contenders,
        nodes=args.nodes,
        procs_per_node=args.procs_per_node,
        bandwidth=rate if args.bandwidth is None else args.bandwidth,
        latency=delay if args.latency is None else args.latency,
        emulate=not args.no_emulation,
        steps=args.steps,
        time_budget_s=args.time_budget,
        time_cap_s=args.time_cap,
        target=args.target,
        target_from=args.target_from,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        quick=args.quick,
        out_dir=args.out,
        plots=not args.no_plot,
        contender_timeout_s=args.contender_timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Carry out ``unison bench`` (or --cleanup, --list); the exit code."""
    if not deps.importable(deps.RICH.module):
        print(f"unison bench: {deps.message(deps.RICH)}", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120)
    if args.cleanup:
        removed = netem.cleanup_stale()
        console.print(
            f"removed {len(removed)} namespace(s) left by killed runs" + (f": {', '.join(removed)}" if removed else "")
        )
        return 0
    if args.list:
        for spec in contenders.all_specs():
            console.print(spec)
        return 0
    config = config_from(args)
    try:
        specs = validate(config)
    except ValueError as exc:
        print(f"unison bench: {exc}", file=sys.stderr)
        return 2
    return bench(config, specs, console, json_path=args.json, argv=sys.argv)


def workload_name(config: runner.BenchConfig) -> str:
    """The workload as the report names it: the user's factory, or the built-in one and its size."""
    if workloads.is_factory(config.model):
        return str(config.model)
    return f"{config.workload} ({config.model})" if config.model else config.workload


def validate(config: runner.BenchConfig) -> list[contenders.Spec]:
    """Check the options before anything starts; the contenders to run."""
    if config.nodes * config.procs_per_node < 2:
        raise ValueError("a bench needs at least 2 processes: raise --nodes or --procs-per-node")
    if workloads.is_factory(config.model):
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # the console script does not look in the current folder
        workloads.resolve_factory(str(config.model))
    elif config.model:
        workloads.check_size(config.workload, config.model)
    specs = contenders.parse_list(config.contenders, config.quick, config.nodes, config.procs_per_node)
    if config.target_from is not None:
        if config.target is not None:
            raise ValueError("give --target or --target-from, not both")
        ref = contenders.parse(config.target_from)
        config.target_from = ref.text
        specs = [ref] + [s for s in specs if s.text != ref.text]  # it runs first: the others learn the target
    deps.check(config)  # a missing matplotlib or scikit-learn stops the bench now, not after the training
    return specs


def open_network(config: runner.BenchConfig, console: Console) -> tuple[Optional[netem.Network], dict[str, Any]]:
    """The emulated network, or None and why not (then ranks run on loopback)."""
    nodes, procs = config.nodes, config.procs_per_node
    world = f"{nodes} node{'s' if nodes > 1 else ''} x {procs} process{'es' if procs > 1 else ''}"
    loopback = {"emulated": False, "nodes": config.nodes}
    if not config.emulate:
        return None, {**loopback, "summary": f"{world}, plain loopback", "note": None}
    reason = netem.unavailable_reason()
    net = None
    if reason is None:
        net = netem.Network(config.nodes, config.bandwidth, config.latency)
        try:
            net.up()
        except netem.NetworkError as exc:
            reason, net = str(exc), None
    if net is None:
        console.print(f"[yellow]network emulation unavailable ({escape(str(reason))}): running on plain loopback[/]")
        return None, {**loopback, "summary": f"{world}, plain loopback", "note": f"not emulated: {reason}"}
    info = net.describe()
    parts = [net.bandwidth or "unlimited bandwidth"]
    if net.latency:
        parts.append(net.latency + ("" if net.latency_emulated else " (not emulated)"))
    return net, {**info, "summary": f"{world}, {', '.join(parts)}"}


def bench(
    config: runner.BenchConfig,
    specs: list[contenders.Spec],
    console: Console,
    json_path: Optional[str] = None,
    argv: Optional[list[str]] = None,
) -> int:
    """Run the bench and write its report; the exit code (0 even when some contenders failed, 1 when the
    plots failed: the table and JSON are written before the plots, so a plotting error loses nothing else)."""
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        net, network = open_network(config, console)
        if net is not None:
            stack.callback(net.down)
        announce(config, specs, network, console)
        results = runner.run_all(config, specs, net, progress_printer(config.settings(), console))
    doc = report_doc(config, results, network, argv)
    doc["wall_time_s"] = time.perf_counter() - started
    json_path = json_path or os.path.join(config.out_dir, "bench.json")
    report.write_json(doc, json_path)
    report.print_table(doc, console)
    code = plot(doc, config.out_dir, json_path) if config.plots else 0
    plots = ", ".join(doc["plots"]) or ("none (--no-plot)" if not config.plots else "none")
    console.print(f"plots: {plots}; JSON: {json_path}; logs: {os.path.join(config.out_dir, 'logs')}")
    return code


def announce(
    config: runner.BenchConfig, specs: list[contenders.Spec], network: dict[str, Any], console: Console
) -> None:
    """The line that says what will run, and which contenders will not (not installed)."""
    settings, run = config.settings(), config.resolved()
    how_long = f"{run['steps']} steps or {run['time_budget_s']:g} s each"
    if run["time_cap_s"] > run["time_budget_s"] and (config.known_target() is not None or config.target_from):
        how_long += f" (up to {run['time_cap_s']:g} s to reach the target)"
    if config.target_from:
        how_long += f"; target: within 2% of {config.target_from}'s final {settings.metric}"
    twins = sum(1 for s in specs if s.options.get("hierarchical") is True)
    count = f"{len(specs)} contenders" + (f" ({twins} hierarchical)" if twins else "")
    console.print(f"unison bench: {workload_name(config)}, {count}, {network['summary']}; {how_long}")
    for line in deps.skipped(specs):
        console.print(f"[yellow]{escape(line)}[/]")
    if not config.plots:
        console.print("no plots (--no-plot): the table and JSON only")


def progress_printer(settings: workloads.Settings, console: Console) -> Callable[[int, int, dict[str, Any]], None]:
    """What ``runner.run_all`` calls after each contender: one line with its figures or its error."""

    def progress(i: int, n: int, r: dict[str, Any]) -> None:
        if r["status"] == "ok":
            console.print(
                f"[{i + 1}/{n}] {escape(r['label'])}: {r['step_ms']:.1f} ms/step, "
                f"{settings.metric} {r['final_quality']:.4f} ({r['wall_time_s']:.0f} s)"
            )
        else:
            console.print(f"[{i + 1}/{n}] {escape(r['label'])}: [red]{r['status']}[/]: {escape(r.get('error', ''))}")

    return progress


def report_doc(
    config: runner.BenchConfig, results: list[dict[str, Any]], network: dict[str, Any], argv: Optional[list[str]]
) -> dict[str, Any]:
    """The whole report, as the JSON holds it (``plots`` empty until they are drawn)."""
    settings = config.settings()
    summary = report.summarize(
        results, settings, config.target, config.target_from, nodes=config.nodes, procs_per_node=config.procs_per_node
    )
    world = config.nodes * config.procs_per_node
    return {
        "command": " ".join(argv or []),
        "workload": {
            "name": workload_name(config),
            "metric": settings.metric,
            "higher_is_better": settings.higher_is_better,
            "params": next((r["params"] for r in results if r.get("params")), None),
            **config.resolved(),
        },
        "network": network,
        "world": {"nodes": config.nodes, "procs_per_node": config.procs_per_node, "world_size": world},
        **summary,
        "wall_time_s": None,
        "contenders": results,
        "plots": [],
    }


def plot(doc: dict[str, Any], out_dir: str, json_path: str) -> int:
    """Draw the PNGs and add their paths to the JSON; 1 with a message if plotting fails, else 0."""
    try:
        doc["plots"] = report.write_plots(doc, out_dir)
    except Exception as exc:  # an optional output: the results are on disk already
        print(
            f"unison bench: the plots failed ({type(exc).__name__}: {exc}); the table and {json_path} are written",
            file=sys.stderr,
        )
        return 1
    report.write_json(doc, json_path)
    return 0
