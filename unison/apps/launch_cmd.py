"""``unison launch --fault-tolerant`` and ``unison coordinator``: run a job that survives its workers.

``unison launch --fault-tolerant --nproc N script.py ARGS`` starts a
coordinator that hosts the store and spawns N workers running ``python
script.py ARGS``; ``--nodes N --procs-per-node P`` starts N nodes of P
processes each (a node fails, leaves and comes back whole).
``unison coordinator`` serves nodes started elsewhere: on each machine,
``unison launch --fault-tolerant --procs-per-node P --coordinator HOST:PORT
script.py`` is that node's agent (``unison.fault.launcher.Agent``). See
docs/fault-tolerance.md. Both need torch alone: the coordinator's lines are log
records (the ``unison.launch`` logger), plain text without rich. Both serve a
read-only status page unless ``--no-status``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

from ..fault.launcher import STALE_S, Agent, Coordinator, Settings, TemplateError
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

nodes: --nodes N --procs-per-node P starts N nodes of P processes (LOCAL_RANK 0..P-1, consecutive
ranks); any process's failure takes its node out, and --respawn starts the node again whole. With
--coordinator HOST:PORT (a `unison coordinator` running elsewhere) this command is one node's agent:
it starts the node's P processes, stops them all when one fails, and starts them again under
--respawn; SIGTERM or SIGINT to it stops them and exits 128 + the signal.
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
        default=STALE_S,
        help="seconds of heartbeat silence after which a worker is evicted (a stopped or hung process; "
        "one on this machine whose process still runs is slow, and kept up to 30 s)",
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


def module_list(text: str) -> tuple[str, ...]:
    """``--preload``: a comma list of modules that can be found here (not imported yet)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("give at least one module, e.g. torch,unison")
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise argparse.ArgumentTypeError(f"no module named {name!r} here (a comma list of modules: torch,unison)")
    return names


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
    p.add_argument("--nproc", type=positive_int, default=None, help="worker processes to start (nodes of one)")
    p.add_argument("--nodes", type=positive_int, default=None, help="nodes to start on this machine (simulated)")
    p.add_argument(
        "--procs-per-node",
        type=positive_int,
        default=1,
        help="processes per node: a replica group that fails and comes back whole (default: %(default)s)",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        default=None,
        help="run as one node's agent for the `unison coordinator` at HOST:PORT (instead of --nproc/--nodes)",
    )
    p.add_argument("--respawn", action="store_true", help="start a new node for each node that fails")
    p.add_argument(
        "--max-respawns", type=non_negative_int, default=None, help="most nodes started again (default: no limit)"
    )
    p.add_argument(
        "--max-start-failures",
        type=positive_int,
        default=Settings.max_start_failures,
        help="stop the job after this many workers in a row exited before joining (default: %(default)s)",
    )
    p.add_argument(
        "--port",
        type=positive_int,
        default=None,
        help="the store's port (default: one the OS picks as the store binds it)",
    )
    p.add_argument(
        "--preload",
        metavar="MODULES",
        type=module_list,
        default=(),
        help="comma list of modules (torch,unison) a template process imports once; each worker, and "
        "each replacement, is forked from it and runs the script without importing them again",
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
    c.add_argument(
        "--port", type=non_negative_int, default=0, help="the port the store listens on (default 0: one the OS picks)"
    )
    first = c.add_mutually_exclusive_group(required=True)
    first.add_argument("--nproc", type=positive_int, help="workers to wait for before training starts")
    first.add_argument("--nodes", type=positive_int, help="nodes (agents) to wait for before training starts")
    _common(c)
    c.set_defaults(run=run_coordinator)


def _settings(args: argparse.Namespace, nproc: int, **extra) -> Settings:
    return Settings(
        nproc=nproc,
        procs_per_node=getattr(args, "procs_per_node", 1) if nproc else 1,
        min_replicas=args.min_replicas,
        join_timeout=args.join_timeout,
        stale_s=args.heartbeat_timeout,
        status_port=None if args.no_status else args.status_port,
        status_host=args.status_host,
        preload=getattr(args, "preload", ()),
        **extra,
    )


def _serve(name: str, settings: Settings, command: Optional[list[str]], port: int) -> int:
    """Run the coordinator; a setting it refuses (a status port in use) is a usage error (2)."""
    try:
        boss = Coordinator(settings, command, port)
    except ValueError as exc:
        print(f"unison {name}: {exc}", file=sys.stderr)
        return 2
    try:
        return boss.run()
    except TemplateError as exc:
        print(f"unison {name}: {exc}", file=sys.stderr)
        return 1


def run_launch(args: argparse.Namespace) -> int:
    if args.coordinator is not None:
        return run_agent(args)
    if (args.nproc is None) == (args.nodes is None):
        return _usage("give --nproc N (processes, nodes of one) or --nodes N [--procs-per-node P], not both")
    if args.nproc is not None and args.procs_per_node != 1:
        return _usage("--nproc counts one-process nodes: use --nodes N --procs-per-node P")
    nproc = args.nproc or args.nodes * args.procs_per_node
    if args.preload and not os.path.isfile(args.script):
        return _usage(f"--preload runs a script file, and {args.script!r} is not one")
    if args.min_replicas > nproc:
        return _usage(f"--min-replicas {args.min_replicas} is more than the {nproc} worker processes")
    settings = _settings(
        args, nproc, respawn=args.respawn, max_respawns=args.max_respawns, max_start_failures=args.max_start_failures
    )
    command = [sys.executable, args.script, *args.args]
    return _serve("launch", settings, command, args.port or 0)


def _usage(message: str) -> int:
    print(f"unison launch: {message}", file=sys.stderr)
    return 2


#: The coordinator's options, refused with --coordinator (the agent does not run the membership).
COORDINATOR_ONLY = {
    "--nproc": "nproc",
    "--nodes": "nodes",
    "--port": "port",
    "--min-replicas": "min_replicas",
    "--join-timeout": "join_timeout",
    "--heartbeat-timeout": "heartbeat_timeout",
    "--status-port": "status_port",
    "--status-host": "status_host",
    "--no-status": "no_status",
}


def run_agent(args: argparse.Namespace) -> int:
    """``unison launch --fault-tolerant --procs-per-node P --coordinator HOST:PORT script.py``."""
    defaults = build_defaults()
    given = [flag for flag, name in COORDINATOR_ONLY.items() if getattr(args, name) != defaults[name]]
    if given:
        return _usage(f"{', '.join(given)} belong to `unison coordinator`, not to a node's agent (--coordinator)")
    if args.preload:
        return _usage(
            "--preload forks the workers of --nproc or --nodes; a node's agent (--coordinator) starts them as python script"
        )
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        return _usage(f"--coordinator {args.coordinator!r} is not HOST:PORT (e.g. node0:29400)")
    command = [sys.executable, args.script, *args.args]
    try:
        node_agent = Agent(
            host,
            int(port),
            args.procs_per_node,
            command,
            respawn=args.respawn,
            max_respawns=args.max_respawns,
            max_start_failures=args.max_start_failures,
        )
    except (ValueError, RuntimeError) as exc:
        print(f"unison launch: {exc}", file=sys.stderr)
        return 2
    return node_agent.run()


def build_defaults() -> dict:
    """The launch parser's defaults, by option name."""
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers())
    launch = parser.parse_args(["launch", "--fault-tolerant", "script.py"])
    return vars(launch)


def run_coordinator(args: argparse.Namespace) -> int:
    nodes = args.nodes
    return _serve("coordinator", _settings(args, 0, expected=args.nproc, expected_nodes=nodes), None, args.port)
