"""The `unison train` job: a small MLP learns the UCI handwritten digits on N local processes.

``launch(config)`` starts ``config.nproc`` workers with torch's elastic launcher
and returns rank 0's summary. ``worker(config)`` is what each process runs: it
is a module-level function taking a plain dataclass so the launcher can pickle it.
The data is scikit-learn's bundled copy of the digits, so nothing is downloaded.

With ``checkpoint_dir`` the job saves ``DIR/checkpoint.pt`` (``unison.save``)
every ``checkpoint_every`` steps (default: at every epoch's end) and at the
end, and a worker resumes from it when it exists: after a crash, restarted by
the launcher (``max_restarts``) or by hand, training goes on from the last
checkpoint along the same trajectory.

Testing aid: ``UNISON_TEST_KILL="RANK:STEP"`` makes rank RANK kill itself
(SIGKILL) right after global step STEP, on the launcher's first attempt only
(``TORCHELASTIC_RESTART_COUNT`` is 0), so tests can crash a run for real.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

import unison
from unison import algorithms
from unison.runtime import ending

from .workloads.digits import Digits, load_data  # noqa: F401  (the job's data)

#: The rendezvous of one machine, as ``torchrun --standalone`` makes it: port 0 asks the c10d
#: backend's store, hosted by the launcher in this process, to bind a port the OS picks (the
#: workers learn it from the launcher), so no port is chosen before it is bound.
STANDALONE_ENDPOINT = "127.0.0.1:0"

# The qadam run's Adam step size and full-precision warm-up (in steps; an epoch is 23 on 2 ranks).
QADAM_LR = 0.003
#: demo (with ``sign=True``, its default) steps on the sign of its direction, every coordinate
#: +-1: its SGD step is this share of ``--lr`` (0.05 -> 0.002: 96.4% test accuracy in 14 epochs,
#: where the full lr diverges).
DEMO_SIGN_LR_SCALE = 0.04
QADAM_WARMUP_STEPS = 50


@dataclass(frozen=True)
class TrainConfig:
    """What a worker needs to train; plain values only, so it pickles."""

    nproc: int = 2
    algorithm: str = "allreduce"  # a name, or name:key=value,... (``unison.algorithms.parse``)
    epochs: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    test_fraction: float = 0.2
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None  # steps; None: at the end of every epoch
    max_restarts: int = 0


#: The file ``unison train`` keeps in its checkpoint directory (overwritten atomically).
CHECKPOINT_FILE = "checkpoint.pt"

#: Options a run resumed from a checkpoint must share with the run that wrote it.
RESUME_MUST_MATCH = ("algorithm", "batch_size", "lr", "momentum", "seed", "test_fraction")


def build_model(seed: int, n_in: int = 64, hidden: int = 128, n_out: int = 10) -> nn.Module:
    """A two-hidden-layer MLP, initialized from ``seed`` so every rank starts alike."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_out)
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` classified as ``y``, in eval mode without gradients; leaves the model training."""
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)


def epoch_sums(total: float, count: int) -> tuple[float, int]:
    """``total`` and ``count`` summed over all ranks."""
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([total, float(count)], dtype=torch.float64)
        dist.all_reduce(t)
        total, count = t[0].item(), int(t[1].item())
    return total, count


def global_mean(total: float, count: int) -> float:
    """``total / count`` summed over all ranks, so every rank reports the same epoch loss."""
    total, count = epoch_sums(total, count)
    return total / max(count, 1)


def progress_bar():
    """A rich Progress showing, per epoch, steps done, the running loss and samples/s."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:>8.0f} samples/s"),
        TimeElapsedColumn(),
    )


class NoProgress:
    """Stands in for the progress bar on ranks other than 0, which print nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return None

    def update(self, *args, **kwargs):
        pass


def train_epoch(model, loader, optimizer, loss_fn, bar, task, world_size: int, after_step=None) -> tuple[float, int]:
    """One pass over this rank's shard; returns (summed loss, samples seen) on this rank.
    ``after_step(total, seen)`` runs after every optimizer step."""
    total, seen = 0.0, 0
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(y)
        seen += len(y)
        rate = seen * world_size / max(time.perf_counter() - start, 1e-9)
        bar.update(task, advance=1, loss=total / seen, rate=rate)
        if after_step is not None:
            after_step(total, seen)
    return total, seen


class Checkpoints:
    """The run's position (epoch, global step) and its checkpoints in ``config.checkpoint_dir``.

    A checkpoint taken mid-epoch also keeps the epoch's loss so far (summed over
    ranks), so the resumed run reports the same epoch loss. Without a directory
    it only counts steps.
    """

    def __init__(self, config: TrainConfig, rank: int, model, optimizer, sampler) -> None:
        self.config, self.rank = config, rank
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.path = os.path.join(config.checkpoint_dir, CHECKPOINT_FILE) if config.checkpoint_dir else None
        self.epoch = self.step = 0
        self.carried = (0.0, 0)  # this epoch's (loss sum, samples) from before the resume, on rank 0
        self.last_loss = float("nan")  # the last finished epoch's mean loss
        self.resumed_from: Optional[int] = None
        self.kill_at = kill_step(rank)

    def resume(self) -> None:
        """Load the checkpoint if there is one: every rank, from the same file."""
        if self.path is None:
            return
        state = unison.load(self.path, self.model, self.optimizer, self.sampler, missing_ok=True)
        if state is None:
            return
        saved = state["extra"]["config"]
        for key in RESUME_MUST_MATCH:
            if saved[key] != getattr(self.config, key):
                raise ValueError(
                    f"{self.path} was written by a run with {key}={saved[key]!r}, but this one has {key}={getattr(self.config, key)!r}: "
                    "give the same options to resume, or another --checkpoint-dir to start afresh"
                )
        self.epoch, self.step = state["epoch"], state["step"]
        self.resumed_from = self.step
        self.last_loss = state["extra"]["last_loss"]
        if self.rank == 0:
            self.carried = tuple(state["extra"]["epoch_loss"])

    def after_step(self, total: float, seen: int) -> None:
        """Count the step; save every ``checkpoint_every`` steps (mid-epoch: the loss so far too)."""
        self.step += 1
        if self.step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        every = self.config.checkpoint_every
        if every and self.step % every == 0:
            self.save(self.epoch, epoch_sums(total + self.carried[0], seen + self.carried[1]))

    def epoch_loss(self, total: float, seen: int) -> float:
        """The finished epoch's mean loss over all ranks, counting what came before a resume."""
        total, seen = epoch_sums(total + self.carried[0], seen + self.carried[1])
        self.carried = (0.0, 0)
        self.last_loss = total / max(seen, 1)
        return self.last_loss

    def save(self, epoch: int, epoch_loss: tuple[float, int] = (0.0, 0)) -> None:
        if self.path is None:
            return
        extra = {
            "config": {key: getattr(self.config, key) for key in RESUME_MUST_MATCH},
            "epoch_loss": list(epoch_loss),
            "last_loss": self.last_loss,
        }
        unison.save(self.path, self.model, self.optimizer, self.sampler, epoch=epoch, step=self.step, extra=extra)


def kill_step(rank: int) -> Optional[int]:
    """The step after which this rank kills itself, from ``UNISON_TEST_KILL="RANK:STEP"`` (a testing
    aid), on the launcher's first attempt only; None otherwise."""
    spec = os.environ.get("UNISON_TEST_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    try:
        kill_rank, step = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"UNISON_TEST_KILL must be RANK:STEP (two integers), got {spec!r}") from None
    return step if kill_rank == rank else None


def worker(config: TrainConfig) -> Optional[dict[str, Any]]:
    """Train on this process's shard; rank 0 returns the run's summary, other ranks None.

    Started by ``launch`` through torch's elastic launcher, whose environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) ``unison.init`` reads.
    """
    ending.quick_exit()  # the process is unison's own
    topo = unison.init()
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.nproc))
        return run_training(config, topo)
    finally:
        unison.shutdown()


def build_optimizer(config: TrainConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum; "qadam" (with or without options) runs only with its own optimizer, with its
    own step size and warm-up (``config.lr`` is SGD's); "demo" stepping on the sign (its default)
    takes ``DEMO_SIGN_LR_SCALE`` of ``config.lr``."""
    name = algorithms.parse(config.algorithm)[0]
    if name == "qadam":
        return unison.QAdamOptimizer(params, lr=QADAM_LR, warmup_steps=QADAM_WARMUP_STEPS)
    lr = config.lr
    if name == "demo" and getattr(algorithms.create(config.algorithm), "sign", False):
        lr *= DEMO_SIGN_LR_SCALE
    return torch.optim.SGD(params, lr=lr, momentum=config.momentum)


def run_training(config: TrainConfig, topo: unison.Topology) -> Optional[dict[str, Any]]:
    """The training loop proper, on an already initialized process group."""
    data = load_data(config.seed, config.test_fraction)
    net = build_model(config.seed)
    optimizer = build_optimizer(config, net.parameters())
    model = unison.DataParallel(net, optimizer, algorithm=config.algorithm)
    loader = unison.sharded_loader(data.train, batch_size=config.batch_size, seed=config.seed)
    sampler = loader.sampler
    assert isinstance(sampler, unison.ShardSampler)  # sharded_loader's
    loss_fn = nn.CrossEntropyLoss()
    is_main = topo.rank == 0
    run = Checkpoints(config, topo.rank, model, optimizer, loader.sampler)
    run.resume()

    samples = 0
    start = time.perf_counter()
    with progress_bar() if is_main else NoProgress() as bar:
        for epoch in range(run.epoch, config.epochs):
            run.epoch = epoch
            sampler.set_epoch(epoch)  # the resumed epoch goes on where the checkpoint left it
            task = bar.add_task(f"epoch {epoch + 1}/{config.epochs}", total=len(loader), loss=0.0, rate=0.0)
            total, seen = train_epoch(model, loader, optimizer, loss_fn, bar, task, topo.world_size, run.after_step)
            model.end_epoch(run.epoch_loss(total, seen))
            samples += seen * topo.world_size
            if not config.checkpoint_every:
                run.save(epoch + 1)
    model.average()  # every rank ends with the same model (model-averaging algorithms drift between syncs)
    train_time = time.perf_counter() - start
    run.save(max(config.epochs, run.epoch))

    test_accuracy = accuracy(model, data.test_x, data.test_y)
    if not is_main:
        return None
    return {
        "test_accuracy": test_accuracy,
        "final_loss": run.last_loss,
        "train_time_s": train_time,
        "samples_per_s": samples / train_time,
        "bytes_per_step": float(model.comm_stats["bytes_per_step"]),
        "algorithm": config.algorithm,
        "world_size": topo.world_size,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": optimizer.param_groups[0]["lr"],
        "seed": config.seed,
        "steps": run.step,
        "resumed_from_step": run.resumed_from,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "checkpoint": run.path,
    }


def launch(config: TrainConfig) -> dict[str, Any]:
    """Run ``worker`` on ``config.nproc`` local processes with torch's elastic launcher.

    Returns rank 0's summary with ``wall_time_s`` (the whole run, process start
    included) added. A failing worker raises torch's ChildFailedError, which
    carries the worker's traceback, once ``config.max_restarts`` restarts of
    the whole group (each resuming from the last checkpoint) are spent.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"unison-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=STANDALONE_ENDPOINT,
        max_restarts=config.max_restarts,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    start = time.perf_counter()
    results = elastic_launch(launch_config, worker)(config)
    wall_time = time.perf_counter() - start
    summary = results.get(0)
    if summary is None:
        raise RuntimeError("rank 0 finished without returning a summary")
    return {**summary, "wall_time_s": wall_time}
