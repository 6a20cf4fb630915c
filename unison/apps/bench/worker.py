"""One rank of one contender: ``python -m unison.apps.bench.worker CONFIG.json``.

Started by the runner with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), inside the node's namespace when
the network is emulated. Trains the workload for ``steps`` steps or
``time_budget_s`` seconds of training time, whichever comes first. Every
``eval_every`` steps the clock stops and rank 0 measures its replica's quality
on held-out data (so model-averaging contenders are judged by what one replica
knows); at the end the replicas are made identical and measured once more.
Rank 0 writes the result as JSON to the config's ``result_path``.

With ``measure_link`` set, each node's first process reads its link's sent-bytes
counter around the training loop, so the bytes that really crossed the
emulated links are known for every contender alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import unison

from . import contenders, workloads


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

    def evaluate(step: int, clock: float) -> bool:
        """Rank 0 measures; every rank learns whether the time budget is spent."""
        prepared.flush()
        if is_main:
            curve.append([round(clock, 4), step, workload.evaluate(workload.model)])
        stop = torch.tensor([1.0 if clock >= cfg["time_budget_s"] else 0.0])
        dist.broadcast(stop, src=0)
        return bool(stop.item())

    evaluate(0, 0.0)
    dist.barrier()
    tx_start = link_tx_bytes(ifname)
    bytes_start = prepared.bytes_total()
    clock, steps, epoch, done, loss = Clock(), 0, 0, False, None
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
                done = evaluate(steps, clock.total) or steps >= cfg["steps"]
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
