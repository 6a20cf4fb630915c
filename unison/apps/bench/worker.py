"""One rank of one contender: ``python -m unison.apps.bench.worker CONFIG.json``.

Started by the runner with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), inside the node's namespace when
the network is emulated. Trains the workload for ``steps`` steps or
``time_budget_s`` seconds of training time, whichever comes first; but when the
config names a ``target`` quality that the replica has not reached yet when the
time budget is spent, training goes on until the first evaluation at or past
the target, the last step, or ``time_cap_s`` seconds (so a contender slowed by
a slow network still gets its time to the target measured). The ``reference``
contender, whose final quality sets the target, trains for all its steps (up
to the time cap). Every
``eval_every`` steps the clock stops and rank 0 measures its replica's quality
on held-out data (so model-averaging contenders are judged by what one replica
knows); at the end the replicas are made identical and measured once more.
Rank 0 writes the result, with why training stopped (``stopped``), as JSON to
the config's ``result_path``.

With ``measure_link`` set, each node's first process reads its link's sent-bytes
counter around the training loop, so the bytes that really crossed the
emulated links are known for every contender alike.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import unison

from . import contenders, workloads

#: Why a contender stopped training, by the code rank 0 broadcasts (0: it goes on).
STOPS = {0: None, 1: "steps", 2: "time budget", 3: "time cap", 4: "target"}


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
        self.total, self._since = 0.0, None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None


def train(cfg: dict, topo) -> Optional[dict]:
    """The measured run; rank 0 returns the result, other ranks None."""
    spec = contenders.parse(cfg["spec"])
    workload = workloads.load(cfg["workload"], cfg["seed"], cfg.get("model"))
    prepared = contenders.prepare(spec, workload, cfg.get("lr"), topo)
    model, optimizer = prepared.model, prepared.optimizer
    batch = cfg["batch_size"]
    loader = unison.sharded_loader(workload.train, batch_size=batch, seed=cfg["seed"], drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"the training set has too few samples for batches of {batch} on {topo.world_size} ranks")
    is_main = topo.rank == 0
    heartbeat = cfg.get("heartbeat_path") if is_main else None
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if cfg.get("measure_link") and topo.local_rank == 0 else None

    curve: list[list[float]] = []
    target, higher = cfg.get("target"), cfg.get("higher_is_better", True)
    cap = max(cfg.get("time_cap_s") or cfg["time_budget_s"], cfg["time_budget_s"])
    hit, overtime = [False], [False]  # rank 0: the target was reached; training went on past the time budget

    def evaluate(step: int, clock: float) -> Optional[str]:
        """Rank 0 measures and decides; every rank learns whether (and why) training stops."""
        prepared.flush()
        reason = 0.0
        if is_main:
            quality = workload.evaluate(workload.model)
            curve.append([round(clock, 4), step, quality])
            hit[0] = hit[0] or (target is not None and math.isfinite(quality) and workloads.reached(quality, target, higher))
            if step >= cfg["steps"]:
                reason = 1.0
            elif cfg.get("reference"):  # it sets the target: its final quality after the whole step budget
                reason = 3.0 if clock >= cap else 0.0
            elif clock >= cfg["time_budget_s"] and (target is None or hit[0]):
                reason = 4.0 if overtime[0] else 2.0
            elif clock >= cap:
                reason = 3.0
            elif clock >= cfg["time_budget_s"]:
                overtime[0] = True  # short of the target: on to it, the last step or the cap
        stop = torch.tensor([reason])
        dist.broadcast(stop, src=0)
        return STOPS[int(stop.item())]

    evaluate(0, 0.0)
    dist.barrier()
    tx_start = link_tx_bytes(ifname)
    bytes_start = prepared.bytes_total()
    clock, steps, epoch, done, loss = Clock(), 0, 0, None, None
    while not done:
        loader.sampler.set_epoch(epoch)
        clock.start()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            prepared.after_step()
            steps += 1
            if heartbeat:
                beat(heartbeat)
            if steps % cfg["eval_every"] == 0 or steps >= cfg["steps"]:
                clock.stop()
                done = evaluate(steps, clock.total)
                if done:
                    break
                clock.start()
        clock.stop()
        epoch += 1
        prepared.end_epoch(float(loss.item()))
    tx_end = link_tx_bytes(ifname)
    sent = prepared.bytes_total() - bytes_start
    train_time = clock.total

    link = torch.tensor([tx_end - tx_start], dtype=torch.float64)
    dist.all_reduce(link)  # only node leaders contribute
    prepared.finish()
    final = workload.evaluate(workload.model) if is_main else None
    if not is_main:
        return None
    curve.append([round(train_time, 4), steps, final])
    samples = steps * batch * topo.world_size
    return {
        "spec": spec.text,
        "steps": steps,
        "stopped": done,
        "train_time_s": train_time,
        "step_ms": 1000 * train_time / max(steps, 1),
        "samples_per_s": samples / train_time if train_time > 0 else None,
        "bytes_per_step": sent / max(steps, 1),
        "link_bytes_per_step": link.item() / topo.num_nodes / max(steps, 1) if cfg.get("measure_link") else None,
        "final_quality": final,
        "curve": curve,
        "params": workload.params,
        **prepared.info(),
    }


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
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent()
    with open(argv[0]) as f:
        cfg = json.load(f)
    topo = unison.init(timeout=cfg["pg_timeout_s"])
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    try:
        result = train(cfg, topo)
        if result is not None:
            tmp = cfg["result_path"] + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, cfg["result_path"])
    finally:
        unison.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
