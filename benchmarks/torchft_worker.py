"""The torchft side of ``benchmarks/bench_faults.py --against torchft``: the same MLP, batch and
optimizer as ``benchmarks/fault_worker.py``, trained under torchft (PyPI ``torchft``) instead.

Two roles:

``train``: one replica group of one process (``--replica ID``), as torchft's own
``train_ddp.py`` runs each group: its own ``TCPStore`` (started here, on a free
port), a ``torchft.Manager`` talking to the Lighthouse at ``--lighthouse``,
``torchft.ProcessGroupGloo``, ``torchft.DistributedDataParallel`` and
``torchft.Optimizer`` (its ``zero_grad`` starts the quorum, its ``step`` commits
only when every group agrees). The step is the Manager's: every committed step
is appended to ``OUT/steps-<id>.txt`` as ``time step participants``, the moment it
commits. The first commit under each new quorum is an event ``quorum`` and each
step the Manager refused to commit an event ``uncommitted``, both in
``OUT/timeline-<id>.json``, with the process's spawn time, script start,
imports, model built and Manager ready, as fault_worker.py writes them. Faults
as fault_worker.py's: ``--fault kill --victim ID --at STEP`` arms, at the first
step at or past STEP with 3 participants, a timer firing a random part of one
step later that writes ``OUT/fault.json`` and SIGKILLs its own process.

``ddp``: the baseline, under torchrun: the same model under plain
``torch.nn.parallel.DistributedDataParallel`` on gloo, its steps logged alike.

Both write ``OUT/pid-<pid>`` first thing and stop at the step in ``OUT/stop``
(or ``--steps``). torchft is needed only here, never by the library: install it
with ``pip install --no-deps torchft==0.2.0`` and its small pure-Python imports
(opentelemetry-api, -sdk, -semantic-conventions, -exporter-otlp-proto-http,
-proto-common, -common, -http-transport, -proto, protobuf, googleapis-common-protos),
each ``--no-deps`` so that no second torch is pulled in.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()

import os  # noqa: E402
import sys  # noqa: E402


def _spawn_time() -> float:
    """When this process was forked (``time.time()`` clock, 10 ms resolution), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return float("nan")


SPAWNED = _spawn_time()

if __name__ == "__main__" and "--out" in sys.argv:
    _out = sys.argv[sys.argv.index("--out") + 1]
    _tag = os.environ.get("REPLICA_GROUP_ID") or f"r{os.environ.get('RANK', '?')}"
    with open(os.path.join(_out, f"pid-{os.getpid()}"), "w") as _f:
        _f.write(_tag)

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

# The workload, as in fault_worker.py (copied, not imported: that module imports unison, and
# the torchft side's start-up must not pay for it).
INPUTS, CLASSES = 256, 10


def mlp(hidden: int) -> nn.Module:
    """256 -> hidden -> hidden -> 10, as fault_worker.mlp."""
    return nn.Sequential(
        nn.Linear(INPUTS, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
    )


def batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, INPUTS, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


class StopFile:
    """The step every worker stops at: ``--steps``, or the number in OUT/stop once it appears."""

    def __init__(self, out: str, steps: int) -> None:
        self.path, self.at = os.path.join(out, "stop"), steps

    def reached(self, step: int) -> bool:
        if os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    self.at = min(self.at, int(f.read()))
            except ValueError:  # being written
                pass
        return step >= self.at


def write_json(path: str, data: dict) -> None:
    """Atomically: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


class StepLog:
    """``time step world`` per committed step, one unbuffered write each."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.times: list[float] = []

    def commit(self, step: int, world: int) -> float:
        t = time.time()
        os.write(self.fd, f"{t:.6f} {step} {world}\n".encode())
        self.times.append(t)
        return t

    def step_time(self, last: int = 10) -> float:
        gaps = [b - a for a, b in zip(self.times[-last - 1 :], self.times[-last:])]
        return statistics.median(gaps) if gaps else 0.02


def train(args: argparse.Namespace) -> None:
    """One replica group of one process under torchft."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    imported = time.time()
    wid = args.replica
    timeline: dict = {"id": wid, "spawned": SPAWNED, "script_start": SCRIPT_START, "imported": imported}
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    x, y = batch(1000 + wid, args.batch)
    timeline["built"] = time.time()
    # The group's own store, as torchrun would start it for a group of one process.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state: dict) -> None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replicas,
        replica_id=f"bench_{wid}",
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timedelta(seconds=args.timeout),
    )
    # ddp: torchft's DistributedDataParallel (its comm hook allreduces each bucket through the Manager);
    # grads: the gradients flattened into one buffer, allreduced with manager.allreduce after backward.
    model = DistributedDataParallel(manager, net) if args.wrapper == "ddp" else net
    params = [p for p in net.parameters()]
    optimizer = Optimizer(manager, opt)
    timeline["manager_done"] = time.time()
    events: list = []
    log = StepLog(os.path.join(args.out, f"steps-{wid}.txt"))
    stop = StopFile(args.out, args.steps)
    rng = random.Random(args.seed * 1000 + wid)
    path = os.path.join(args.out, f"timeline-{wid}.json")
    armed = False
    mine = 0
    quorum = None
    world = 0  # the participants of this worker's last committed step

    def fire(sig: int) -> None:
        write_json(os.path.join(args.out, "fault.json"), {"time": time.time(), "worker": wid, "signal": int(sig)})
        os.kill(os.getpid(), sig)

    def dump() -> None:
        write_json(path, {**timeline, "step": manager.current_step(), "events": events})

    while not stop.reached(manager.current_step()):
        step = manager.current_step()
        if args.fault and wid == args.victim and step >= args.at and not armed and world == 3:
            armed = True
            threading.Timer(rng.uniform(0, log.step_time()), fire, (signal.SIGKILL,)).start()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if args.wrapper == "grads":
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        optimizer.step()
        if manager.current_step() == step:
            events.append([time.time(), "uncommitted", f"step {step + 1}: {manager.errored()}"])
            dump()
            continue
        world = manager.num_participants()
        t = log.commit(manager.current_step(), world)
        mine += 1
        changed = manager._quorum_id != quorum  # the bench's one private read: when the quorum changed
        if changed:
            quorum = manager._quorum_id
            events.append([t, "quorum", f"id {quorum}, {world} participants, step {manager.current_step()}"])
        if mine == 1:
            timeline["first_commit"] = t
            timeline["first_step"] = manager.current_step()
        if mine == 1 or changed:
            dump()
    dump()
    manager.shutdown(wait=False)
    os._exit(0)  # the Manager's threads and servers need not be waited for


def ddp(args: argparse.Namespace) -> None:
    """The baseline: plain torch DDP on gloo, under torchrun."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(args.hidden)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    x, y = batch(1000 + rank, args.batch)
    log = StepLog(os.path.join(args.out, f"steps-r{rank}.txt"))
    stop = StopFile(args.out, args.steps)
    step = 0
    while not stop.reached(step):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        log.commit(step, world)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["train", "ddp"])
    p.add_argument("--out", required=True)
    p.add_argument("--replica", type=int, default=int(os.environ.get("REPLICA_GROUP_ID", 0)))
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510"))
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--wrapper", choices=["ddp", "grads"], default="ddp", help="how gradients are averaged")
    p.add_argument("--pg-timeout", type=float, default=5.0, help="gloo's timeout, s (torchft's train_ddp.py: 5)")
    p.add_argument("--timeout", type=float, default=30.0, help="the Manager's timeout, s (train_ddp.py: 30)")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=10**9, help="stop here (or at the step in OUT/stop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", choices=["kill"], default=None)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--at", type=int, default=30)
    args = p.parse_args()
    {"train": train, "ddp": ddp}[args.role](args)


if __name__ == "__main__":
    main()
