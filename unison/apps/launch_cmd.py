"""``unison launch --fault-tolerant`` and ``unison coordinator``: run a job that survives its workers.

``unison launch --fault-tolerant --nproc N script.py ARGS`` starts a
coordinator that hosts the store and spawns N workers running ``python
script.py ARGS``; ``unison coordinator --port P`` serves workers started
elsewhere (each with ``UNISON_FT_ADDR`` and ``UNISON_FT_PORT`` set). See
docs/fault-tolerance.md. Both need torch alone: the coordinator's lines are log
records (the ``unison.launch`` logger), plain text without rich. Both serve a
read-only status page unless ``--no-status``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from ..runtime import coordinator
from .argtypes import non_negative_int, positive_float, positive_int

LAUNCH_EPILOG = """\
stopping: SIGTERM, SIGINT (Ctrl-C) or SIGHUP to the launcher stops every worker (SIGTERM, then
SIGKILL after 5 s; a second signal: at once) and exits 128 + the signal (143, 130, 129).

start-up failures: a worker that exits by itself before it joins (the script fails before
unison.init()) is not restarted for ever: after --max-start-failures of them in a row, or at once
when the first membership waits for it and no replacement comes, the launcher stops the others,
shows that worker's last lines of stderr and exits 1.

status page: the launcher logs "status: http://127.0.0.1:PORT/" at start; /status.json has the
same data as JSON (docs/fault-tolerance.md, "The status page").
"""


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
    s = p.add_argument_group("status page (read-only HTML at /, JSON at /status.json)")
    s.add_argument(
        "--status-port",
        type=non_negative_int,
        default=0,
        help="the status page's port (default 0: one the OS picks; the launcher logs its URL)",
    )
    s.add_argument(
        "--status-host",
        default="127.0.0.1",
        help="the address the status page listens on (default 127.0.0.1: this machine only; "
        "0.0.0.0 shows it to the network, with no authentication)",
    )
    s.add_argument("--no-status", action="store_true", help="serve no status page")


def add_parsers(subparsers) -> None:
    """Declare ``unison launch`` and ``unison coordinator``."""
    p = subparsers.add_parser(
        "launch",
        help="run a script on local worker processes under a fault-tolerant coordinator",
        description="Start a coordinator that hosts the store and spawns the workers; survivors keep "
        "training when a worker dies (the model needs DataParallel(..., fault_tolerant=True)).",
        epilog=LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--fault-tolerant", action="store_true", required=True, help="required: the launcher's one mode")
    p.add_argument("--nproc", type=positive_int, required=True, help="worker processes to start")
    p.add_argument("--respawn", action="store_true", help="start a replacement for each worker that dies")
    p.add_argument("--max-respawns", type=non_negative_int, default=None, help="most replacements (default: no limit)")
    p.add_argument(
        "--max-start-failures",
        type=positive_int,
        default=coordinator.Settings.max_start_failures,
        help="stop the job after this many workers in a row exited before joining (default: %(default)s)",
    )
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
        status_port=None if args.no_status else args.status_port,
        status_host=args.status_host,
        **extra,
    )


def _serve(name: str, settings: coordinator.Settings, command: Optional[list[str]], port: int) -> int:
    """Run the coordinator; a setting it refuses (a status port in use) is a usage error (2)."""
    try:
        boss = coordinator.Coordinator(settings, command, port)
    except ValueError as exc:
        print(f"unison {name}: {exc}", file=sys.stderr)
        return 2
    return boss.run()


def run_launch(args: argparse.Namespace) -> int:
    if args.min_replicas > args.nproc:
        print(f"unison launch: --min-replicas {args.min_replicas} is more than --nproc {args.nproc}", file=sys.stderr)
        return 2
    settings = _settings(
        args,
        args.nproc,
        respawn=args.respawn,
        max_respawns=args.max_respawns,
        max_start_failures=args.max_start_failures,
    )
    command = [sys.executable, args.script, *args.args]
    return _serve("launch", settings, command, args.port or 0)


def run_coordinator(args: argparse.Namespace) -> int:
    return _serve("coordinator", _settings(args, 0, expected=args.nproc), None, args.port)
