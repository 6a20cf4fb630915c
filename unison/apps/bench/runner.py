"""Runs every contender of a bench, one after another, each on fresh rank processes.

Each contender gets its own processes (so one that crashes or hangs cannot
take the others down): ``python -m unison.apps.bench.worker`` per rank, inside its
node's namespace (``ip netns exec``) when the network is emulated, on plain
loopback otherwise. A contender whose ranks fail or overrun their time limit
is recorded as failed with the first failing rank's error, and the bench goes
on. Rank processes die with the bench (each asks for PR_SET_PDEATHSIG as it starts), even when it is killed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from ...runtime import client_env, serve_store
from . import contenders, netem, workloads
from .worker import WorkerConfig

log = logging.getLogger("unison.bench")

#: The default time cap, in time budgets: how long a contender still short of a known target may train.
TIME_CAP_FACTOR = 10.0


@dataclass
class BenchConfig:
    """Everything a bench run needs; None means the workload's default."""

    workload: str = "digits"
    model: Optional[str] = None
    contenders: Optional[str] = None  # comma list; None: all (the quick set with ``quick``)
    nodes: int = 2
    procs_per_node: int = 1
    bandwidth: Optional[str] = "1gbit"
    latency: Optional[str] = "2ms"
    emulate: bool = True
    steps: Optional[int] = None
    time_budget_s: Optional[float] = None
    time_cap_s: Optional[float] = None  # None: TIME_CAP_FACTOR x the time budget
    target: Optional[float] = None
    target_from: Optional[str] = None  # a contender spec: the target is within 2% of its final quality
    eval_every: Optional[int] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    seed: int = 0
    quick: bool = False
    out_dir: str = "bench-results"
    plots: bool = True  # False: --no-plot (no matplotlib needed)
    pg_timeout_s: float = 300.0
    contender_timeout_s: Optional[float] = None

    def known_target(self) -> Optional[float]:
        """The target before anything runs (--target or the workload's default), None when it is
        decided from results (--target-from, or within 2% of the best final quality)."""
        if self.target is not None:
            return self.target
        return None if self.target_from else self.settings().target

    def settings(self) -> workloads.Settings:
        return workloads.settings_for(self.workload, self.model)

    def resolved(self) -> dict:
        """The per-contender run settings with the workload's defaults (and --quick's) filled in."""
        s = self.settings()
        steps = self.steps or (max(20, s.steps // 2) if self.quick else s.steps)
        budget = self.time_budget_s or (min(15.0, s.time_budget_s) if self.quick else s.time_budget_s)
        return {
            "steps": steps,
            "time_budget_s": budget,
            "time_cap_s": max(budget, self.time_cap_s or TIME_CAP_FACTOR * budget),
            "eval_every": self.eval_every or s.eval_every,
            "batch_size": self.batch_size or s.batch_size,
            "lr": self.lr if self.lr is not None else s.lr,
        }


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|terminate called|RuntimeError)\b.*")


def error_line(log: str) -> str:
    """The most telling line of a failed rank's output: its last exception line, else its last line."""
    lines = [_RANK_PREFIX.sub("", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


@dataclass
class RankGroup:
    """The processes of one contender and where their output goes."""

    procs: list[subprocess.Popen]
    logs: list[str]
    files: list = field(default_factory=list)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for f in self.files:
            f.close()


def launch(
    cfg_path: str, world: int, per_node: int, net: Optional[netem.Network], log_prefix: str, rendezvous: dict[str, str]
) -> RankGroup:
    """Start the ranks of one contender; ``rendezvous``: the variables that say where their store is
    (``rendezvous_env``)."""
    procs, logs, files = [], [], []
    drop = ("UNISON_NODES", "GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    path = os.pathsep.join(p for p in (os.getcwd(), base.get("PYTHONPATH")) if p)
    for rank in range(world):
        node, local = divmod(rank, per_node)
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per_node),
            **rendezvous,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": path,
            "UNISON_BENCH_PARENT": str(os.getpid()),  # the worker asks for SIGKILL when this process dies
        }
        if net:
            env["GLOO_SOCKET_IFNAME"] = net.ifname(node)
        argv = [sys.executable, "-m", "unison.apps.bench.worker", cfg_path]
        if net:
            argv = net.exec_argv(node) + argv
        log = f"{log_prefix}-rank{rank}.log"
        f = open(log, "w")
        files.append(f)
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        )  # no preexec_fn: unsafe in a process with threads
        logs.append(log)
    return RankGroup(procs, logs, files)


def wait(
    group: RankGroup,
    timeout: float,
    heartbeat: Optional[str] = None,
    grace: float = 5.0,
    first_step_s: float = 180.0,
    stall_s: float = 60.0,
) -> Optional[str]:
    """Wait for every rank; None on success, else why the contender failed (ranks killed).

    A contender fails when a rank fails, when it runs past ``timeout``, or when
    rank 0 stops finishing steps (its ``heartbeat`` file is touched after each):
    no first step within ``first_step_s``, or a pause longer than ``stall_s`` and
    ten times the slowest step so far (the first counted from the start: a contender whose
    every step is slow, torch DDP on a 1 Mbit/s link, is not taken for a hung one after
    its first step). Some failures hang rather than crash (torch's PowerSGD hook on gloo
    sometimes does), and gloo's own timeout does not catch them all.
    """
    start, started_at = time.monotonic(), time.time()  # the heartbeat's mtime is wall-clock time
    deadline = start + timeout
    failed_at = None
    last_beat, slowest = None, 0.0
    try:
        while True:
            codes = [p.poll() for p in group.procs]
            if all(c == 0 for c in codes):
                return None
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed_at = failed_at or time.monotonic()
                if all(c is not None for c in codes) or time.monotonic() - failed_at > grace:
                    return _describe_failure(group, bad[0], codes[bad[0]] or 0)
            now = time.monotonic()
            if now > deadline:
                return f"timed out after {timeout:.0f} s"
            beat = _mtime(heartbeat)
            if beat is not None and beat != last_beat:
                slowest = max(slowest, beat - (last_beat if last_beat is not None else started_at))
                last_beat = beat
            if heartbeat and not bad:
                if last_beat is None and now - start > first_step_s:
                    return f"no training step finished within {first_step_s:.0f} s (a hang?)"
                if last_beat is not None and time.time() - last_beat > max(stall_s, 10 * slowest):
                    return f"hung: no training step finished for {time.time() - last_beat:.0f} s"
            time.sleep(0.1)
    finally:
        group.kill()


def _mtime(path: Optional[str]) -> Optional[float]:
    """When rank 0 last finished a step (None before its first one)."""
    try:
        return os.stat(path).st_mtime if path else None
    except FileNotFoundError:
        return None


def _describe_failure(group: RankGroup, rank: int, code: int) -> str:
    for f in group.files:
        f.flush()
    with open(group.logs[rank], errors="replace") as f:
        line = error_line(f.read())
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"rank {rank} failed ({how}): {line}"


def contender_timeout(config: BenchConfig, run: dict) -> float:
    if config.contender_timeout_s:
        return config.contender_timeout_s
    return 180.0 + 3 * max(run["time_budget_s"], run.get("time_cap_s") or 0.0)


def worker_config(
    spec: contenders.Spec, config: BenchConfig, run: dict[str, Any], prefix: str, measure_link: bool
) -> WorkerConfig:
    """What the ranks of one contender read (``run``: ``BenchConfig.resolved()``, the target and whether it
    is the reference); their files are named from ``prefix``."""
    world = config.nodes * config.procs_per_node
    return WorkerConfig(
        spec=spec.text,
        workload=config.workload,
        model=config.model,
        seed=config.seed,
        lr=run["lr"],
        batch_size=run["batch_size"],
        steps=run["steps"],
        time_budget_s=run["time_budget_s"],
        time_cap_s=run["time_cap_s"],
        eval_every=run["eval_every"],
        target=run.get("target"),
        higher_is_better=run.get("higher_is_better", True),
        reference=run.get("reference", False),
        result_path=os.path.abspath(prefix + ".json"),
        heartbeat_path=os.path.abspath(prefix + ".heartbeat"),
        threads=max(1, (os.cpu_count() or 1) // world),
        pg_timeout_s=config.pg_timeout_s,
        measure_link=measure_link,
    )


def rendezvous_env(index: int, net: Optional[netem.Network], store: Optional[dist.TCPStore]) -> dict[str, str]:
    """Where contender ``index``'s ranks find their store. On loopback: ``store``, served by this
    process on the port it bound (``client_env``). On the emulated network rank 0 hosts it in node 0's
    namespace, which this run created and nothing else listens in: a fixed port there is free (one
    per contender, clear of the last one's closing connections)."""
    if net is None:
        assert store is not None
        return client_env(store)
    return {"MASTER_ADDR": net.address(0), "MASTER_PORT": str(29500 + index)}


def run_contender(
    index: int,
    spec: contenders.Spec,
    config: BenchConfig,
    run: dict[str, Any],
    net: Optional[netem.Network],
    log_dir: str,
) -> dict[str, Any]:
    """Train one contender on fresh ranks; its result, or its failure."""
    entry = {"spec": spec.text, "label": spec.label, "kind": spec.kind}
    reason = contenders.unavailable(spec)
    if reason:
        return {**entry, "status": "not installed", "error": reason}
    safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.text)
    prefix = os.path.join(log_dir, f"{index:02d}-{safe}")
    cfg = worker_config(spec, config, run, prefix, measure_link=net is not None)
    for stale in (cfg.result_path, cfg.heartbeat_path):
        if stale and os.path.exists(stale):
            os.remove(stale)
    cfg_path = os.path.abspath(prefix + "-config.json")
    cfg.write(cfg_path)
    world = config.nodes * config.procs_per_node
    store = None if net else serve_store()  # on loopback the ranks' store lives here, bound before they start
    log.debug("contender %d (%s): %d ranks, log files %s-rank*.log", index, spec.text, world, prefix)
    start = time.perf_counter()
    try:
        group = launch(cfg_path, world, config.procs_per_node, net, prefix, rendezvous_env(index, net, store))
        error = wait(group, contender_timeout(config, run), cfg.heartbeat_path)
    finally:
        del store  # the ranks have exited (wait kills any left)
    wall = time.perf_counter() - start
    if error is None and not os.path.exists(cfg.result_path):
        error = "rank 0 finished without writing its result"
    if error:
        return {**entry, "status": "failed", "error": error, "wall_time_s": wall, "logs": group.logs}
    with open(cfg.result_path) as f:
        result = json.load(f)
    return {**entry, "status": "ok", "wall_time_s": wall, **result}


def run_all(
    config: BenchConfig,
    specs: list[contenders.Spec],
    net: Optional[netem.Network],
    progress: Callable[[int, int, dict], None] = lambda i, n, r: None,
) -> list[dict]:
    """Run ``specs`` in order; ``progress(i, n, result)`` after each.

    Each contender's ranks learn the target when it is known before they start
    (so one still short of it when its time budget is spent trains on, up to the
    time cap). With ``config.target_from`` that contender, which must come first
    in ``specs``, trains its whole step budget (up to the time cap) without a
    target, and the target it sets is given to every contender after it.
    """
    from . import report

    settings = config.settings()
    run = {**config.resolved(), "target": config.known_target(), "higher_is_better": settings.higher_is_better}
    log_dir = os.path.join(config.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    results = []
    for i, spec in enumerate(specs):
        this = run
        if config.target_from and i == 0:
            if spec.text != config.target_from:
                raise ValueError(f"the reference contender {config.target_from!r} must run first")
            this = {**run, "reference": True}  # its final quality after the whole step budget, not the time budget
        result = run_contender(i, spec, config, this, net, log_dir)
        results.append(result)
        if config.target_from and i == 0:
            run = {**run, "target": report.pick_target(results, settings, config.target, config.target_from)[0]}
        progress(i, len(specs), result)
    return results


def config_dict(config: BenchConfig) -> dict:
    return asdict(config)
