"""``unison train --fault-tolerant``: the digits job under the fault-tolerant coordinator.

``launch(config, plan)`` runs a coordinator (``unison.fault.launcher.coordinator``) in
this process; it spawns ``config.nproc`` workers running ``python -m
unison.apps.train_ft JOB.json`` and, with ``plan.respawn``, a replacement for
each one that dies. A worker named in ``plan.kills`` SIGKILLs itself once, when
``model.ft.step`` reaches the given step (replacements get new ids, so never
they). The survivors regroup and go on; at the end every member averages the
replicas and measures the test accuracy, and rank 0 of the final membership
writes the summary into the job's directory, which ``launch`` reads back,
adding what the coordinator saw. See docs/fault-tolerance.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Optional

import torch
from torch import nn

import unison
from unison import algorithms
from unison.algorithms import support
from unison.fault.launcher import Coordinator, Settings
from unison.runtime import ending

from . import logs
from .tables import figures_table
from .train import TrainConfig, accuracy, build_model, build_optimizer
from .workloads.digits import load_data

log = logging.getLogger("unison.train")

#: What the coordinator's log adds to the workers' events (its regroups are the workers' too).
COORDINATOR_KINDS = ("failure", "leave", "respawn", "abort")
#: Seconds the members wait at the end for replacements still starting (``--respawn``).
REPLACEMENT_WAIT_S = 60.0
SUMMARY_FILE = "summary.json"
JOB_FILE = "job.json"


def parse_kill(text: str) -> tuple[int, int]:
    """``WORKER@STEP`` as (worker id, step); a ValueError names the expected form."""
    who, at, step = text.partition("@")
    try:
        if not at:
            raise ValueError
        worker, when = int(who), int(step)
    except ValueError:
        raise ValueError(f"write WORKER@STEP (two integers, e.g. 1@15), got {text!r}") from None
    if worker < 0 or when < 0:
        raise ValueError(f"the worker id and the step must be at least 0, got {text!r}")
    return worker, when


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    """What the fault-tolerant run does besides training: whom it kills, whether it replaces them.

    Args:
        kills: (worker id, step) pairs: that original worker SIGKILLs itself when
            ``model.ft.step`` reaches the step.
        respawn: start a replacement for each worker that dies (at most
            ``nproc + len(kills)``, so a worker that crashes at start cannot loop).
        min_replicas: fewest members the job may train with.
    """

    kills: tuple[tuple[int, int], ...] = ()
    respawn: bool = False
    min_replicas: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kills", tuple((int(w), int(s)) for w, s in self.kills))
        workers = [w for w, _ in self.kills]
        if len(set(workers)) != len(workers):
            raise ValueError(f"--kill names worker {_first_repeat(workers)} twice: a worker dies once")
        if self.min_replicas < 1:
            raise ValueError(f"--min-replicas must be at least 1, got {self.min_replicas}")

    def kill_step(self, worker_id: int) -> Optional[int]:
        """The step at which worker ``worker_id`` kills itself, or None."""
        return next((step for w, step in self.kills if w == worker_id), None)


def _first_repeat(items: list[int]) -> int:
    return next(x for i, x in enumerate(items) if x in items[:i])


def steps_per_epoch(config: TrainConfig, n_train: int, world: int) -> int:
    """Steps of one epoch on ``world`` members (ShardSampler pads every shard to the same length)."""
    shard = -(-n_train // world)
    return -(-shard // config.batch_size)


def check(config: TrainConfig, plan: FaultPlan) -> None:
    """Refuse, before any process starts, what the fault-tolerant run cannot do (ValueError)."""
    support.check(algorithms.as_algorithm(config.algorithm), support.Context(fault_tolerant=True))
    if config.checkpoint_dir is not None or config.max_restarts:
        raise ValueError("--fault-tolerant keeps the job alive itself: leave out --checkpoint-dir and --max-restarts")
    if plan.min_replicas > config.nproc:
        raise ValueError(f"--min-replicas {plan.min_replicas} is more than --nproc {config.nproc}")
    for worker, _ in plan.kills:
        if worker >= config.nproc:
            raise ValueError(f"--kill {worker}@...: the workers are 0 to {config.nproc - 1}")
    if not plan.respawn and config.nproc - len(plan.kills) < plan.min_replicas:
        raise ValueError(
            f"{len(plan.kills)} kill(s) leave {config.nproc - len(plan.kills)} of {config.nproc} workers, fewer "
            f"than --min-replicas {plan.min_replicas}: add --respawn or kill fewer"
        )
    if plan.kills:
        total = config.epochs * steps_per_epoch(
            config, len(load_data(config.seed, config.test_fraction).train), config.nproc
        )
        late = [f"{w}@{s}" for w, s in plan.kills if s >= total]
        if late:
            raise ValueError(
                f"--kill {', '.join(late)}: the run has {total} steps on {config.nproc} workers (steps 0 to {total - 1})"
            )


# ---- the launching process -------------------------------------------------------------------
def launch(config: TrainConfig, plan: FaultPlan) -> dict[str, Any]:
    """Run the job under a coordinator; return the summary of rank 0 of the final membership.

    Adds ``wall_time_s``, the coordinator's ``exit_code`` and ``respawns``,
    ``joined_at_step`` (replacement id: the step it healed at), and merges the
    coordinator's failures and respawns into ``events`` (times in seconds since
    the launch). Raises RuntimeError when no summary came back, or when the
    final members did not all finish with the same steps and model.
    """
    check(config, plan)
    out = tempfile.mkdtemp(prefix="unison-train-ft-")
    try:
        job = os.path.join(out, JOB_FILE)
        with open(job, "w") as f:
            json.dump({"config": dataclasses.asdict(config), "plan": dataclasses.asdict(plan), "out": out}, f)
        settings = Settings(
            nproc=config.nproc,
            min_replicas=plan.min_replicas,
            respawn=plan.respawn,
            max_respawns=config.nproc + len(plan.kills),
        )
        command = [sys.executable, "-m", "unison.apps.train_ft", job]
        start = time.time()
        boss = Coordinator(settings, command)  # its store binds a port the OS picks
        code = boss.run()
        wall = time.time() - start
        path = os.path.join(out, SUMMARY_FILE)
        if not os.path.exists(path):
            raise RuntimeError(
                f"the job ended (coordinator exit code {code}) without a summary: see the workers' errors above"
            )
        with open(path) as f:
            summary = json.load(f)
        finished = read_workers(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    check_members_agree(summary, finished)
    events = [{**e, "time": e["time"] - start} for e in summary["events"]]
    events += [
        {"time": t - start, "source": "coordinator", "kind": kind, "detail": detail}
        for t, kind, detail in boss.log
        if kind in COORDINATOR_KINDS
    ]
    events.sort(key=lambda e: e["time"])
    joined = {w["worker_id"]: w["first_step"] for w in finished.values() if w["first_step"] > 0}
    return {
        **summary,
        "events": events,
        "joined_at_step": joined,
        "wall_time_s": wall,
        "exit_code": code,
        "respawns": boss.respawns,
    }


def read_workers(out: str) -> dict[int, dict[str, Any]]:
    """What each worker that finished wrote (``worker-<id>.json``), by worker id."""
    found = {}
    for name in os.listdir(out):
        if name.startswith("worker-") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                result = json.load(f)
            found[result["worker_id"]] = result
    return found


def check_members_agree(summary: dict[str, Any], finished: dict[int, dict[str, Any]]) -> None:
    """Every member of the final membership finished with the same steps and the same model
    (its test accuracy); RuntimeError otherwise: the run did not carry on as one job."""
    missing = [m for m in summary["members"] if m not in finished]
    if missing:
        raise RuntimeError(f"worker(s) {missing} of the final membership did not finish: see their errors above")
    seen = {m: (finished[m]["steps"], finished[m]["test_accuracy"]) for m in summary["members"]}
    if len(set(seen.values())) > 1:
        raise RuntimeError(f"the final members disagree on (steps, test accuracy): {seen}")


def print_summary(summary: dict[str, Any]) -> None:
    """The run's figures, then its events, as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = [
        ("steps", str(summary["steps"])),
        ("epochs", str(summary["epochs"])),
        ("world size", f"{summary['world_size']} (started with {summary['nproc']})"),
        ("members (worker ids)", ", ".join(map(str, summary["members"]))),
        ("kills", ", ".join(f"{w}@{s}" for w, s in summary["kills"]) or "none"),
        ("respawns", str(summary["respawns"])),
    ]
    rows += [(f"worker {worker} joined", f"at step {step}") for worker, step in summary["joined_at_step"].items()]
    table = figures_table("unison train --fault-tolerant", summary, rows)
    console = Console()
    console.print(table)
    events = Table(title="events")
    events.add_column("time", justify="right")
    events.add_column("seen by")
    events.add_column("kind", style="bold")
    events.add_column("detail")
    for e in summary["events"]:
        detail = re.sub(r"^\[[^\]]*\]\s*", "", e["detail"])  # gloo's messages start with [file:line]
        events.add_row(f"{e['time']:.2f} s", e["source"], e["kind"], Text(detail))
    console.print(events)


# ---- a worker ------------------------------------------------------------------------------------
def run_worker(config: TrainConfig, plan: FaultPlan, out: str) -> None:
    """Train until the last epoch's end as a member of the job; rank 0 at the end writes the summary.

    The sampler is attached to ``model.ft``: a replacement takes the members'
    epoch and position in it, and the rest of an epoch is dealt again over the
    members after each membership change, so all members take the same number
    of steps.
    """
    unison.init()
    torch.set_num_threads(1)
    data = load_data(config.seed, config.test_fraction)
    net = build_model(config.seed)
    optimizer = build_optimizer(config, net.parameters())
    model = unison.DataParallel(net, optimizer=optimizer, algorithm=config.algorithm, fault_tolerant=True)
    ft = model.ft
    assert ft is not None
    loader = unison.sharded_loader(data.train, batch_size=config.batch_size, seed=config.seed)
    sampler = loader.sampler
    assert isinstance(sampler, unison.ShardSampler)
    ft.attach(sampler=sampler)
    kill_at = plan.kill_step(ft.worker_id)
    loss_fn = nn.CrossEntropyLoss()
    first_step, start = ft.step, time.time()
    for epoch in range(sampler.epoch, config.epochs):
        sampler.set_epoch(epoch)  # the healed epoch goes on where the members are
        total, seen = 0.0, 0
        for x, y in loader:
            if kill_at is not None and ft.step >= kill_at:  # >=: a heal may carry the step past it
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(y), seen + len(y)
        if ft.rank == 0:
            log.info(
                "epoch %d/%d: step %d, members %s, loss %.4f (rank 0)",
                epoch + 1,
                config.epochs,
                ft.step,
                ft.members,
                total / max(seen, 1),
            )
    if plan.respawn:
        wait_for_replacements(ft, config.nproc)
    model.average()  # drifting algorithms' replicas become one model
    train_time = time.time() - start
    train_x, train_y = data.train.tensors
    net.eval()
    with torch.no_grad():
        final_loss = loss_fn(net(train_x), train_y).item()
    test_accuracy = accuracy(net, data.test_x, data.test_y)
    mine = {
        "worker_id": ft.worker_id,
        "test_accuracy": test_accuracy,
        "final_loss": final_loss,
        "steps": ft.step,
        "first_step": first_step,
        "events": [
            {"time": e.time, "source": f"worker {ft.worker_id}", "kind": e.kind, "detail": e.detail} for e in ft.events
        ],
    }
    _write(os.path.join(out, f"worker-{ft.worker_id}.json"), mine)
    if ft.rank != 0:
        return
    summary = {
        **mine,
        "train_time_s": train_time,
        "algorithm": config.algorithm,
        "nproc": config.nproc,
        "world_size": ft.world_size,
        "members": ft.members,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": optimizer.param_groups[0]["lr"],
        "seed": config.seed,
        "kills": [list(k) for k in plan.kills],
        "respawn": plan.respawn,
        "bytes_per_step": float(model.comm_stats["bytes_per_step"]),
    }
    _write(os.path.join(out, SUMMARY_FILE), summary)


def wait_for_replacements(ft: Any, nproc: int, timeout: float = REPLACEMENT_WAIT_S) -> None:
    """Hold the job's end until replacements started during the run have joined (they heal from
    the members, then average and evaluate with them); a run shorter than a process's start-up
    would otherwise end before them. Gives up after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while ft.world_size < nproc and time.time() < deadline:
        time.sleep(0.05)
        ft.at_boundary()  # regroups as soon as the coordinator admits the replacement


def _write(path: str, data: dict[str, Any]) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def main(argv: Optional[list[str]] = None) -> None:
    """A worker's entry point: ``python -m unison.apps.train_ft JOB.json``; its log records (the
    epochs on rank 0, the library's) go to stderr as ``unison``'s do (``logs.install``)."""
    (path,) = sys.argv[1:] if argv is None else argv
    ending.quick_exit()  # the process is unison's own
    logs.install()
    with open(path) as f:
        job = json.load(f)
    run_worker(TrainConfig(**job["config"]), FaultPlan(**job["plan"]), job["out"])


if __name__ == "__main__":
    main()
