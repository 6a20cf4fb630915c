"""The ``unison`` command line: ``unison train`` runs the digits training job on local processes.

Subcommands live in one argparse parser so more (``unison bench``) can be added
beside ``train``. ``main()`` is the console-script entry point and returns the exit code.

The core install (torch alone) runs ``unison launch`` and ``unison coordinator``:
nothing here imports rich unless a command that needs it runs (``train`` needs
the ``demo`` extra, ``bench`` the ``bench`` extra, and each says so when it is
missing). ``main`` shows the library's log records (``logs.install``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Optional, Sequence

from .. import algorithms
from ..runtime import ending
from . import logs
from .argtypes import algorithm, non_negative_int, positive_float, positive_int
from .tables import figures_table

#: What ``unison train`` imports beyond torch (module, package): the ``demo`` extra installs them.
TRAIN_NEEDS = (("sklearn", "scikit-learn"), ("rich", "rich"))


def add_train_parser(subparsers) -> None:
    """Declare ``unison train`` and its options; defaults come from TrainConfig."""
    from .train import TrainConfig

    defaults = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train an MLP on the UCI handwritten digits on local processes",
        description="Train a small MLP on scikit-learn's bundled UCI handwritten digits, "
        "data-parallel over local processes started by torch's elastic launcher "
        "(with --fault-tolerant: by unison's coordinator, and the survivors of a dead worker go on).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=positive_int, default=defaults.nproc, help="worker processes")
    p.add_argument(
        "--algorithm",
        type=algorithm,
        default=defaults.algorithm,
        metavar="NAME[:KEY=VALUE,...]",
        help="how replicas agree, with options if you like (powersgd:rank=2): " + ", ".join(algorithms.names()),
    )
    p.add_argument("--epochs", type=positive_int, default=defaults.epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=positive_int, default=defaults.batch_size, help="samples per step on each rank")
    p.add_argument(
        "--lr",
        type=positive_float,
        default=defaults.lr,
        help="SGD learning rate (demo, which steps on the sign, takes 1/25 of it)",
    )
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of the split, the model and the shuffling")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the summary as JSON to PATH")
    p.add_argument(
        "--checkpoint-dir", metavar="DIR", default=None, help="save DIR/checkpoint.pt and resume from it when it exists"
    )
    p.add_argument(
        "--checkpoint-every",
        metavar="N",
        type=positive_int,
        default=None,
        help="checkpoint every N steps (None: at every epoch's end)",
    )
    p.add_argument(
        "--max-restarts",
        metavar="N",
        type=non_negative_int,
        default=defaults.max_restarts,
        help="restart the workers up to N times after a failure (each resumes from the last checkpoint)",
    )
    ft = p.add_argument_group("fault tolerance (docs/fault-tolerance.md)")
    ft.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="run under unison's fault-tolerant coordinator: the survivors of a dead worker go on training",
    )
    ft.add_argument(
        "--kill",
        metavar="WORKER@STEP",
        type=kill_spec,
        action="append",
        default=[],
        help="worker WORKER SIGKILLs itself when the committed step reaches STEP (repeatable; a testing aid)",
    )
    ft.add_argument("--respawn", action="store_true", help="start a replacement for each worker that dies")
    ft.add_argument(
        "--min-replicas", metavar="K", type=positive_int, default=None, help="fewest members to train with (default 1)"
    )
    p.set_defaults(run=run_train, train_parser=p)


def kill_spec(text: str) -> tuple[int, int]:
    """An argparse type for ``--kill WORKER@STEP``."""
    from .train_ft import parse_kill

    try:
        return parse_kill(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="unison", description="Data-parallel training with unison.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(subparsers)
    from .bench.command import add_parser as add_bench_parser  # `unison bench`: its options live in unison/bench

    add_bench_parser(subparsers)
    from .launch_cmd import add_parsers as add_launch_parsers  # `unison launch`, `unison coordinator`

    add_launch_parsers(subparsers)
    return parser


def print_summary(summary: dict[str, Any]) -> None:
    """Show the run's figures as a rich table on stdout."""
    from rich.console import Console

    rows = [
        ("samples/s (all ranks)", f"{summary['samples_per_s']:,.0f}"),
        ("bytes communicated/step", f"{summary['bytes_per_step']:,.0f}"),
        ("world size", str(summary["world_size"])),
        ("epochs", str(summary["epochs"])),
    ]
    if summary.get("resumed_from_step") is not None:
        rows.append(("resumed from step", f"{summary['resumed_from_step']} (restarts: {summary['restarts']})"))
    Console().print(figures_table("unison train", summary, rows))


def run_train(args: argparse.Namespace) -> int:
    """Launch the training job, print its summary and write the JSON if asked."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .train import TrainConfig, launch

    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        print("unison train: --checkpoint-every needs --checkpoint-dir", file=sys.stderr)
        return 2
    missing = missing_packages(TRAIN_NEEDS)
    if missing:
        what = " and ".join(missing) + (" is" if len(missing) == 1 else " are")
        print(f'unison train: {what} not installed: pip install "unison[demo]"', file=sys.stderr)
        return 2
    if not args.fault_tolerant:
        used = [name for name, value in ft_options(args).items() if value]
        if used:
            verb = "needs" if len(used) == 1 else "need"
            args.train_parser.error(f"{' and '.join(used)} {verb} --fault-tolerant")
    config = TrainConfig(
        nproc=args.nproc,
        algorithm=args.algorithm,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        max_restarts=args.max_restarts,
    )
    if args.fault_tolerant:
        return run_train_fault_tolerant(args, config)
    try:
        summary = launch(config)
    except ChildFailedError as exc:
        print(f"unison train: a worker process failed\n{exc}\nunison train: {root_cause(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"unison train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return report(args, summary, print_summary)


def report(args: argparse.Namespace, summary: dict[str, Any], show: Any) -> int:
    """A finished run: its summary shown (``show``), and written as JSON with ``--json``."""
    show(summary)
    return write_json(args.json, summary) if args.json else 0


def ft_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options that belong to ``--fault-tolerant``, by their flags."""
    return {"--kill": args.kill, "--respawn": args.respawn, "--min-replicas": args.min_replicas is not None}


def run_train_fault_tolerant(args: argparse.Namespace, config: Any) -> int:
    """``unison train --fault-tolerant``: refuse bad combinations as argparse errors, run, print the summary."""
    from .train_ft import FaultPlan, check, launch, print_summary

    try:
        plan = FaultPlan(kills=tuple(args.kill), respawn=args.respawn, min_replicas=args.min_replicas or 1)
        check(config, plan)
    except ValueError as exc:
        args.train_parser.error(str(exc))
    try:
        summary = launch(config, plan)
    except Exception as exc:
        print(f"unison train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return report(args, summary, print_summary)


def missing_packages(needs: Sequence[tuple[str, str]]) -> list[str]:
    """The packages of ``needs`` ((module, package) pairs) whose module cannot be imported here."""
    missing = []
    for module, package in needs:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def root_cause(exc) -> str:
    """One line naming the first failed rank and its error, to end a long launcher report."""
    rank, failure = exc.get_first_failure()
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    lines = str(message or "").strip().splitlines()
    return f"rank {rank} failed: {lines[-1].strip() if lines else f'exit code {failure.exitcode}'}"


def write_json(path: str, summary: dict[str, Any]) -> int:
    """Write ``summary`` to ``path``; return the exit code (1 with a message if it cannot)."""
    try:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    except OSError as exc:
        print(f"unison train: cannot write the JSON summary to {path}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default: the command line), run the command and return its exit code.

    Run as the program (``argv`` None: the ``unison`` console script, ``python -m unison``), the
    process is unison's own and ends quickly (``ending.quick_exit``)."""
    if argv is None:
        ending.quick_exit()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    logs.install()
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("unison: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
