"""``unison launch --fault-tolerant`` and ``unison coordinator``: run a job that survives its workers.

``unison launch --fault-tolerant --nproc N script.py ARGS`` starts a
coordinator that hosts the store and spawns N workers running ``python
script.py ARGS``; ``unison coordinator --port P`` serves workers started
elsewhere (each with ``UNISON_FT_ADDR`` and ``UNISON_FT_PORT`` set). See
docs/fault-tolerance.md. Both need torch alone: the coordinator's lines are log
records (the ``unison.launch`` logger), plain text without rich.
"""

from __future__ import annotations

import argparse
import sys

from ..runtime import coordinator
from .argtypes import non_negative_int, positive_float, positive_int


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-replicas", type=positive_int, default=1, help="fewest members the job may train with")
    p.add_argument(
        "--join-timeout",
        type=positive_float,
        default=30.0,
        help="seconds the members may stay below --min-replicas before every worker stops with RankFailure",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=positive_float,
        default=coordinator.STALE_S,
        help="seconds of heartbeat silence after which a worker is evicted (a stopped or hung process)",
    )


def add_parsers(subparsers) -> None:
    """Declare ``unison launch`` and ``unison coordinator``."""
    p = subparsers.add_parser(
        "launch",
        help="run a script on local worker processes under a fault-tolerant coordinator",
        description="Start a coordinator that hosts the store and spawns the workers; survivors keep "
        "training when a worker dies (the model needs DataParallel(..., fault_tolerant=True)).",
    )
    p.add_argument("--fault-tolerant", action="store_true", required=True, help="required: the launcher's one mode")
    p.add_argument("--nproc", type=positive_int, required=True, help="worker processes to start")
    p.add_argument("--respawn", action="store_true", help="start a replacement for each worker that dies")
    p.add_argument("--max-respawns", type=non_negative_int, default=None, help="most replacements (default: no limit)")
    p.add_argument(
        "--port",
        type=positive_int,
        default=None,
        help="the store's port (default: one the OS picks as the store binds it)",
    )
    _common(p)
    p.add_argument("script", help="the training script, run as `python script ARGS`")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(run=run_launch)

    c = subparsers.add_parser(
        "coordinator",
        help="serve fault-tolerant workers started elsewhere (one per host or per torchrun)",
        description="Host the store and the memberships for workers started with UNISON_FT_ADDR and "
        "UNISON_FT_PORT pointing here.",
    )
    c.add_argument("--port", type=positive_int, required=True, help="the port the store listens on")
    c.add_argument("--nproc", type=positive_int, required=True, help="workers to wait for before training starts")
    _common(c)
    c.set_defaults(run=run_coordinator)


def _settings(args: argparse.Namespace, nproc: int, **extra) -> coordinator.Settings:
    return coordinator.Settings(
        nproc=nproc,
        min_replicas=args.min_replicas,
        join_timeout=args.join_timeout,
        stale_s=args.heartbeat_timeout,
        **extra,
    )


def run_launch(args: argparse.Namespace) -> int:
    if args.min_replicas > args.nproc:
        print(f"unison launch: --min-replicas {args.min_replicas} is more than --nproc {args.nproc}", file=sys.stderr)
        return 2
    settings = _settings(args, args.nproc, respawn=args.respawn, max_respawns=args.max_respawns)
    command = [sys.executable, args.script, *args.args]
    return coordinator.main(settings, command, args.port or 0)


def run_coordinator(args: argparse.Namespace) -> int:
    return coordinator.main(_settings(args, 0, expected=args.nproc), None, args.port)
