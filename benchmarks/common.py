"""Workloads and launching shared by the benchmarks."""

from __future__ import annotations

import datetime
import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def mlp() -> nn.Module:
    """About 21M parameters, as in the reference measurements."""
    dims = [1024, 3072, 3072, 3072, 10]
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def cnn() -> nn.Module:
    """A small CNN with BatchNorm for 32x32 RGB images."""

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        *block(64, 128),
        nn.Flatten(),
        nn.Linear(128 * 16, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


WORKLOADS = {
    "mlp": (mlp, lambda g, n: torch.randn(n, 1024, generator=g)),
    "cnn": (cnn, lambda g, n: torch.randn(n, 3, 32, 32, generator=g)),
}


def launch(fn, nproc: int, *args) -> dict:
    """Run ``fn(*args)`` on ``nproc`` local ranks with torch's elastic launcher."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # as torchrun --standalone: the launcher's store binds a port the OS picks
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)


def split_contenders(text: str) -> list[str]:
    """ "compute,diloco:fragments=4,delay=2,ddp" -> ["compute", "diloco:fragments=4,delay=2", "ddp"]:
    an item with "=" and no ":" (before an "@", which bench_charlm's inner optimizer follows) is one
    more option of the contender before it."""
    out: list[str] = []
    for item in filter(None, text.split(",")):
        head = item.partition("@")[0]
        if "=" in head and ":" not in head and out:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def run_capped(cmd: list[str], timeout: float, **popen: Any) -> tuple[Optional[int], str, str, bool]:
    """Run ``cmd`` (a launcher) for at most ``timeout`` seconds: then SIGTERM (a launcher stops its
    workers), then SIGKILL, to that process only. Returns its exit code, stdout, stderr (text,
    where ``popen`` pipes them) and whether it had to be stopped."""
    proc = subprocess.Popen(cmd, text=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or "", False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return proc.returncode, out or "", err or "", True


def write_report(script: str, argv: Optional[list[str]], began: float, found: dict, path: Optional[str]) -> None:
    """A stress run's report: its command, the unison the jobs imported and its commit, the date and
    seconds, and ``found`` (its counts and runs); printed counts, written to ``path`` as JSON."""
    unison_file = subprocess.run(
        [sys.executable, "-c", "import unison; print(unison.__file__)"], capture_output=True, text=True
    ).stdout.strip()
    commit = subprocess.run(
        ["git", "-C", str(Path(unison_file).parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "command": " ".join(["python", f"benchmarks/{script}", *(argv if argv is not None else sys.argv[1:])]),
        "unison": unison_file,
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - began, 1),
        **found,
    }
    print(json.dumps(found["counts"]))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
