"""One rank of one contender: ``python -m unison.apps.bench.worker CONFIG.json``.

Started by the runner with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), inside the node's namespace when
the network is emulated. The runner writes a ``WorkerConfig`` as JSON; this
module reads it back with the same dataclass, trains, and rank 0 writes a
``WorkerResult`` as JSON to ``result_path``.

When training stops (``Stop``): after ``steps`` steps or ``time_budget_s``
seconds of training time, whichever comes first; but a contender still short
of a known ``target`` when its time budget is spent trains on until the first
evaluation at or past the target, the last step, or ``time_cap_s`` seconds, so
a contender slowed by a slow network still gets its time to the target
measured. The ``reference`` contender, whose final quality sets the target,
trains for all its steps (up to the time cap). Every ``eval_every`` steps the
clock stops and rank 0 measures its replica's quality on held-out data (so
model-averaging contenders are judged by what one replica knows); at the end
the replicas are made identical and measured once more.

With ``measure_link`` set, each node's first process reads its link's sent-bytes
counter around the training loop, so the bytes that really crossed the
emulated links are known for every contender alike.
"""

from __future__ import annotations

import ctypes
import enum
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

import unison

from . import contenders, workloads


@dataclass(frozen=True)
class WorkerConfig:
    """What every rank of one contender needs; the runner writes it and the worker reads it back.

    Written and read by the same class (``write``, ``read``), so the two sides
    cannot drift: a missing or unknown key is refused with its name.
    """

    # what to train
    spec: str  # the contender, as ``contenders.parse`` reads it
    workload: str
    model: Optional[str]  # the user's ``package.module:factory``, or None for the built-in workload
    seed: int
    lr: Optional[float]  # None: the workload's
    batch_size: int
    # how long
    steps: int
    time_budget_s: float
    time_cap_s: Optional[float]  # None: the time budget
    eval_every: int
    # how judged
    target: Optional[float]
    higher_is_better: bool
    reference: bool  # it sets the target: trains its whole step budget (up to the time cap)
    # where and how to run
    result_path: str
    heartbeat_path: Optional[str]
    threads: int
    pg_timeout_s: float
    measure_link: bool  # read the node's veth (GLOO_SOCKET_IFNAME) around training

    def __post_init__(self) -> None:
        for name in ("batch_size", "steps", "eval_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"worker config: {name} must be at least 1, got {getattr(self, name)}")
        if not self.time_budget_s > 0:
            raise ValueError(f"worker config: time_budget_s must be positive, got {self.time_budget_s}")

    @property
    def cap_s(self) -> float:
        """The most training seconds: the time cap, never below the time budget."""
        return max(self.time_cap_s or self.time_budget_s, self.time_budget_s)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerConfig:
        """The config in ``data``; ValueError naming any missing or unknown key."""
        names = {f.name for f in fields(cls)}
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        problems = []
        if missing:
            problems.append(f"missing key(s) {', '.join(missing)}")
        if unknown:
            problems.append(f"unknown key(s) {', '.join(unknown)}")
        if problems:
            raise ValueError(f"worker config: {'; '.join(problems)}")
        return cls(**data)

    @classmethod
    def read(cls, path: str) -> WorkerConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)


class Stop(enum.IntEnum):
    """Why training stopped; rank 0 broadcasts the value, ``GOING_ON`` (0) while it goes on."""

    GOING_ON = 0
    STEPS = 1
    TIME_BUDGET = 2
    TIME_CAP = 3
    TARGET = 4

    @property
    def text(self) -> str:
        """The word in the result's ``stopped``: "steps", "time budget", "time cap" or "target"."""
        return self.name.lower().replace("_", " ")


@dataclass
class WorkerResult:
    """What rank 0 measured; ``to_json`` gives the dict the runner and the report read."""

    spec: str
    steps: int
    stopped: Stop
    train_time_s: float
    step_ms: float
    samples_per_s: Optional[float]
    bytes_per_step: float
    link_bytes_per_step: Optional[float]  # None: not measured (no emulated links)
    final_quality: float
    curve: list[list[float]]  # [training seconds, step, quality] per evaluation
    params: int
    extra: dict[str, Any] = field(default_factory=dict)  # the contender's own figures (autotuning)

    def to_json(self) -> dict[str, Any]:
        data = {**asdict(self), "stopped": self.stopped.text}
        extra = data.pop("extra")
        return {**data, **extra}

    def write(self, path: str) -> None:
        """Write atomically: the runner takes a present file as a finished run."""
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f)
        os.replace(tmp, path)


def link_tx_bytes(ifname: Optional[str]) -> float:
    """Bytes sent so far on ``ifname`` (this namespace's view of /sys), 0 without one."""
    if not ifname:
        return 0.0
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return float(f.read())
    except OSError:
        return 0.0


def beat(path: str) -> None:
    """Tell the runner a step finished (it fails contenders that stop making progress)."""
    with open(path, "a"):
        os.utime(path)


class Clock:
    """Training time: runs only between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.total = 0.0
        self._since: Optional[float] = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None


class Judge:
    """Rank 0's view of the run: the quality curve, and whether training must stop."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.curve: list[list[float]] = []
        self.hit = False  # the target was reached
        self.overtime = False  # training went on past the time budget, short of the target

    def record(self, step: int, clock: float, quality: float) -> Stop:
        """Add an evaluation to the curve; why training stops now, or ``GOING_ON``."""
        cfg = self.cfg
        self.curve.append([round(clock, 4), step, quality])
        if cfg.target is not None and math.isfinite(quality):
            self.hit = self.hit or workloads.reached(quality, cfg.target, cfg.higher_is_better)
        stop = self.decide(step, clock)
        if stop is Stop.GOING_ON and not cfg.reference and clock >= cfg.time_budget_s:
            self.overtime = True  # short of the target: on to it, the last step or the cap
        return stop

    def decide(self, step: int, clock: float) -> Stop:
        cfg = self.cfg
        if step >= cfg.steps:
            return Stop.STEPS
        if cfg.reference:  # it sets the target: its final quality after the whole step budget
            return Stop.TIME_CAP if clock >= cfg.cap_s else Stop.GOING_ON
        if clock >= cfg.time_budget_s and (cfg.target is None or self.hit):
            return Stop.TARGET if self.overtime else Stop.TIME_BUDGET
        return Stop.TIME_CAP if clock >= cfg.cap_s else Stop.GOING_ON


def broadcast_stop(stop: Stop) -> Stop:
    """Rank 0's decision, on every rank."""
    code = torch.tensor([float(stop)])
    dist.broadcast(code, src=0)
    return Stop(int(code.item()))


class Training:
    """One contender's measured run on this rank: the loop, the training clock, the evaluations."""

    def __init__(self, cfg: WorkerConfig, topo: unison.Topology) -> None:
        self.cfg, self.topo = cfg, topo
        self.spec = contenders.parse(cfg.spec)
        self.workload = workloads.load(cfg.workload, cfg.seed, cfg.model)
        self.prepared = contenders.prepare(self.spec, self.workload, cfg.lr, topo)
        self.loader = unison.sharded_loader(
            self.workload.train, batch_size=cfg.batch_size, seed=cfg.seed, drop_last=True
        )
        self.sampler = cast(unison.ShardSampler, self.loader.sampler)
        if len(self.loader) == 0:
            raise ValueError(
                f"the training set has too few samples for batches of {cfg.batch_size} on {topo.world_size} ranks"
            )
        self.is_main = topo.rank == 0
        self.judge = Judge(cfg)  # used on rank 0 only
        self.clock = Clock()
        self.steps = 0
        self.loss: Optional[torch.Tensor] = None

    def run(self) -> Optional[WorkerResult]:
        """Train until rank 0 says stop; rank 0 returns the result, other ranks None."""
        self.evaluate()  # the starting point of the curve
        dist.barrier()
        ifname = os.environ.get("GLOO_SOCKET_IFNAME") if self.cfg.measure_link and self.topo.local_rank == 0 else None
        tx_start, bytes_start = link_tx_bytes(ifname), self.prepared.bytes_total()
        stop, epoch = Stop.GOING_ON, 0
        while stop is Stop.GOING_ON:
            stop = self.epoch(epoch)
            epoch += 1
        link = torch.tensor([link_tx_bytes(ifname) - tx_start], dtype=torch.float64)
        sent = self.prepared.bytes_total() - bytes_start
        dist.all_reduce(link)  # only node leaders contribute
        self.prepared.finish()
        if not self.is_main:
            return None
        return self.result(stop, sent, link.item())

    def epoch(self, epoch: int) -> Stop:
        """One pass over this rank's shard, or less when training stops in it."""
        self.sampler.set_epoch(epoch)
        stop = Stop.GOING_ON
        self.clock.start()
        for x, y in self.loader:
            self.step(x, y)
            if self.steps % self.cfg.eval_every == 0 or self.steps >= self.cfg.steps:
                self.clock.stop()
                stop = self.evaluate()
                if stop is not Stop.GOING_ON:
                    break
                self.clock.start()
        self.clock.stop()
        assert self.loss is not None  # the loader is not empty
        self.prepared.end_epoch(float(self.loss.item()))
        return stop

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer = self.prepared.optimizer
        optimizer.zero_grad(set_to_none=True)
        self.loss = self.workload.loss_fn(self.prepared.model(x), y)
        self.loss.backward()
        optimizer.step()
        self.prepared.after_step()
        self.steps += 1
        if self.is_main and self.cfg.heartbeat_path:
            beat(self.cfg.heartbeat_path)

    def evaluate(self) -> Stop:
        """Rank 0 measures and decides (the clock stopped); every rank learns whether training stops."""
        self.prepared.flush()
        stop = Stop.GOING_ON
        if self.is_main:
            stop = self.judge.record(self.steps, self.clock.total, self.workload.evaluate(self.workload.model))
        return broadcast_stop(stop)

    def result(self, stop: Stop, sent: float, link_bytes: float) -> WorkerResult:
        """Rank 0's figures, with the quality of the replicas made identical."""
        final = self.workload.evaluate(self.workload.model)
        train_time, steps, world = self.clock.total, self.steps, self.topo.world_size
        curve = self.judge.curve + [[round(train_time, 4), steps, final]]
        samples = steps * self.cfg.batch_size * world
        link = link_bytes / self.topo.num_nodes / max(steps, 1) if self.cfg.measure_link else None
        return WorkerResult(
            spec=self.spec.text,
            steps=steps,
            stopped=stop,
            train_time_s=train_time,
            step_ms=1000 * train_time / max(steps, 1),
            samples_per_s=samples / train_time if train_time > 0 else None,
            bytes_per_step=sent / max(steps, 1),
            link_bytes_per_step=link,
            final_quality=final,
            curve=curve,
            params=self.workload.params,
            extra=self.prepared.info(),
        )


def die_with_parent() -> None:
    """Get SIGKILL when the bench process dies (Linux PR_SET_PDEATHSIG), even when it is killed outright.

    Done here rather than in a ``preexec_fn``, which can deadlock between fork and
    exec in a parent that runs threads (the bench's progress display does); if the
    bench is already gone, exit at once."""
    parent = os.environ.get("UNISON_BENCH_PARENT")
    if parent is None:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):
        os._exit(1)


def main(argv: Optional[list[str]] = None) -> int:
    """Read the config named on the command line, train, and (rank 0) write the result."""
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    cfg = WorkerConfig.read(argv[0])
    topo = unison.init(timeout=cfg.pg_timeout_s)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    try:
        result = Training(cfg, topo).run()
        if result is not None:
            result.write(cfg.result_path)
    finally:
        unison.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
