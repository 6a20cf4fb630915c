"""The worker of benchmarks/bench_faults.py: one script, three roles.

``train`` runs under ``unison launch --fault-tolerant``: a small MLP trained with
``DataParallel(..., fault_tolerant=True)``. Every committed step is appended to
``OUT/steps-<worker id>.txt`` as ``time step world`` the moment it commits, so
the record survives the worker's own death. Faults are injected by the victim
itself: ``--fault kill|stop --victim ID --at STEP`` arms a timer at the start of
step STEP that fires after a random part of one step; it writes
``OUT/fault.json`` (``time.time()`` just before the signal) and SIGKILLs or
SIGSTOPs its own process. ``--chain N --chain-after K``: worker 2 and the first
N-1 joiners SIGKILL themselves after K committed steps of their own (so, with
``--respawn``, replacements heal in one after the other; a joiner numbers itself
in ``OUT/joiners``); the N-th joiner (or a later one) ends the job after its K-th
step. Each worker writes its timeline (spawn, script start, imports, model built,
``unison.init``, ``DataParallel``, first committed step, events) to
``OUT/timeline-<id>.json`` after its first committed step, after each step that
follows new events, and at its end. A failure event that no fault explains is
noted in ``OUT/false-<id>-<time>.json`` (``FalseFailureWatch``).

``elastic`` runs under torchrun (``--max-restarts``): the same MLP without fault
tolerance, saving ``unison.save`` checkpoints every ``--checkpoint-every``
steps and resuming from them when restarted; its steps go to
``OUT/steps-e<restart>-r<rank>.txt``.

``overhead`` (2 workers, under either launcher): the step time of each
contender (``compute``, ``NAME``, ``NAME+ft``), each built afresh in every round,
rounds in alternating order; rank 0 writes ``OUT/overhead.json``.

Every role writes ``OUT/pid-<pid>`` (its worker id or restart) first thing, and
stops at the step written in ``OUT/stop`` (or ``--steps``).
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


def _out_dir() -> str:
    return sys.argv[sys.argv.index("--out") + 1]


if __name__ == "__main__" and "--out" in sys.argv:
    _tag = os.environ.get("UNISON_FT_ID") or f"e{os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')}"
    with open(os.path.join(_out_dir(), f"pid-{os.getpid()}"), "w") as _f:
        _f.write(_tag)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import unison  # noqa: E402

IMPORTED = time.time()
INPUTS, CLASSES = 256, 10


def mlp(hidden: int) -> nn.Module:
    """256 -> hidden -> hidden -> 10: (hidden^2 + 268 hidden + 10) parameters."""
    return nn.Sequential(
        nn.Linear(INPUTS, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES)
    )


def hidden_for_mb(mb: float) -> int:
    """The width whose MLP holds ``mb`` MB (1e6 bytes) of float32 parameters."""
    params = mb * 1e6 / 4
    return max(1, round((-(INPUTS + 2 + CLASSES) + math.sqrt((INPUTS + 2 + CLASSES) ** 2 + 4 * params)) / 2))


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


class FalseFailureWatch:
    """Notes, in OUT/false-<id>-<n>.json, each failure event that no fault explains: a wait slice
    that timed out ("Operation timed out!") taken for a failed collective. A thread, so the note
    is written while the worker waits (up to a minute) for a membership that never comes."""

    def __init__(self, out: str, wid: int) -> None:
        self.out, self.wid, self.ft = out, wid, None
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        current, seen = None, 0
        while True:
            ft = self.ft
            if ft is not current:
                current, seen = ft, 0
            events = list(getattr(ft, "events", []))
            for e in events[seen:]:
                if e.kind == "failure" and "Operation timed out" in e.detail:
                    note = {"time": e.time, "worker": self.wid, "pid": os.getpid(), "step": ft.step, "detail": e.detail}
                    write_json(os.path.join(self.out, f"false-{self.wid}-{int(e.time * 1e6)}.json"), note)
            seen = len(events)
            time.sleep(0.05)


def train(args: argparse.Namespace) -> None:
    """The fault-tolerant role (under ``unison launch --fault-tolerant``)."""
    wid = int(os.environ["UNISON_FT_ID"])
    timeline: dict = {"id": wid, "spawned": SPAWNED, "script_start": SCRIPT_START, "imported": IMPORTED}
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    x, y = batch(1000 + wid, args.batch)
    timeline["built"] = time.time()
    unison.init()
    timeline["init_done"] = time.time()
    timeline["before_dp"] = time.time()
    model = unison.DataParallel(net, optimizer=opt, algorithm=args.algorithm, fault_tolerant=True)
    ft = model.ft
    assert ft is not None
    timeline["after_dp"] = time.time()
    timeline["first_step"] = ft.step
    timeline["payload_mb"] = sum(p.numel() * p.element_size() for p in net.parameters()) / 1e6
    FalseFailureWatch(args.out, wid).ft = ft
    log = StepLog(os.path.join(args.out, f"steps-{wid}.txt"))
    stop = StopFile(args.out, args.steps)
    rng = random.Random(args.seed * 1000 + wid)
    armed = False
    mine = 0  # steps committed by this process
    ordinal = 0  # this joiner's place among the workers that healed in (1, 2, ...); 0: an original worker
    noted = 0  # events already in the last timeline written
    path = os.path.join(args.out, f"timeline-{wid}.json")

    def fire(sig: int) -> None:
        write_json(os.path.join(args.out, "fault.json"), {"time": time.time(), "worker": wid, "signal": int(sig)})
        os.kill(os.getpid(), sig)

    def dump() -> None:
        events = [[e.time, e.kind, e.detail] for e in ft.events]
        write_json(path, {**timeline, "step": ft.step, "world": ft.world_size, "events": events})

    while not stop.reached(ft.step):
        if args.chain and mine >= args.chain_after and (wid == 2 or 0 < ordinal < args.chain):
            os.kill(os.getpid(), signal.SIGKILL)  # the next replacement heals in
        if args.fault and wid == args.victim and ft.step == args.at and not armed:
            armed = True
            sig = signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP
            threading.Timer(rng.uniform(0, log.step_time()), fire, (sig,)).start()
        before = ft.step
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if ft.step != before:
            t = log.commit(ft.step, ft.world_size)
            mine += 1
            if mine == 1:
                timeline["first_commit"] = t
                if timeline["first_step"] > 0:  # healed in: count it
                    with open(os.path.join(args.out, "joiners"), "a") as f:
                        f.write(f"{wid}\n")
                    with open(os.path.join(args.out, "joiners")) as f:
                        ordinal = f.read().split().index(str(wid)) + 1
                    timeline["ordinal"] = ordinal
            if mine == 1 or len(ft.events) != noted:
                noted = len(ft.events)
                dump()
            if args.chain and ordinal >= args.chain and mine == args.chain_after:
                write_json(os.path.join(args.out, "stop.json"), {"at": ft.step + 10})
                with open(stop.path + ".tmp", "w") as f:
                    f.write(str(ft.step + 10))
                os.replace(stop.path + ".tmp", stop.path)
    dump()


def elastic(args: argparse.Namespace) -> None:
    """The checkpoint-restart role (under torchrun --max-restarts): resume, train, save every N steps."""
    topo = unison.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(args.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum)
    model = unison.DataParallel(net, optimizer=opt, algorithm=args.algorithm)
    x, y = batch(1000 + topo.rank, args.batch)
    state = unison.load(args.ckpt, model, opt, missing_ok=True)
    step = state["step"] if state else 0
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log = StepLog(os.path.join(args.out, f"steps-e{restart}-r{topo.rank}.txt"))
    stop = StopFile(args.out, args.steps)
    while not stop.reached(step):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        log.commit(step, topo.world_size)
        if step % args.checkpoint_every == 0:
            unison.save(args.ckpt, model, opt, step=step)
    model.close()
    unison.shutdown()


class Contender:
    """``compute`` (each rank steps its own copy, no communication), ``NAME`` or ``NAME+ft``."""

    def __init__(self, spec: str, args: argparse.Namespace) -> None:
        name, _, ft = spec.partition("+")
        torch.manual_seed(0)
        self.spec, self.net = spec, mlp(args.hidden)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=args.lr, momentum=args.momentum)
        period, own_warmup = 1, 0
        if name == "compute":
            self.model: nn.Module = self.net
            self.wrapped = None
        else:
            algorithm = unison.algorithms.create(*unison.algorithms.parse(name)[:1], **unison.algorithms.parse(name)[1])
            period = int(getattr(algorithm, "period", 1) or 1)
            own_warmup = max(getattr(algorithm, "warmup_steps", 0) or 0, getattr(algorithm, "start_iter", 0) or 0)
            self.wrapped = unison.DataParallel(
                self.net, optimizer=self.opt, algorithm=algorithm, fault_tolerant=ft == "ft"
            )
            self.model = self.wrapped
        if args.window % period or args.window < 2 * period:
            raise SystemExit(f"{spec}: the window ({args.window}) must be at least two whole sync periods ({period})")
        self.period = period
        self.warmup = period * math.ceil(max(args.warmup, own_warmup + 1) / period)

    def train(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=False)
            F.cross_entropy(self.model(x), y).backward()
            self.opt.step()

    def drain(self) -> float:
        start = time.perf_counter()
        if self.wrapped is not None:
            self.wrapped.flush()
        return time.perf_counter() - start

    def close(self) -> None:
        if self.wrapped is not None:
            self.wrapped.close()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def overhead(args: argparse.Namespace) -> None:
    """Step time of each contender, built afresh per round, rounds in alternating order."""
    topo = unison.init()
    torch.set_num_threads(1)
    x, y = batch(1000 + topo.rank, args.batch)
    contenders = args.contenders.split(",")
    watch = FalseFailureWatch(args.out, int(os.environ.get("UNISON_FT_ID", topo.rank)))
    rounds = []
    for r in range(args.first_round, args.first_round + args.rounds):
        measured = {}
        for spec in contenders if r % 2 == 0 else contenders[::-1]:
            c = Contender(spec, args)
            watch.ft = getattr(c.wrapped, "ft", None)
            c.train(x, y, c.warmup)
            dist.barrier()
            start = time.perf_counter()
            c.train(x, y, args.window)
            elapsed = slowest(time.perf_counter() - start)
            drain = slowest(c.drain())
            c.close()
            measured[spec] = {"ms": 1000 * elapsed / args.window, "drain_ms": 1000 * drain, "warmup": c.warmup}
            del c
        rounds.append(measured)
    if topo.rank == 0:
        write_json(os.path.join(args.out, "overhead.json"), {"launcher": topo.launcher, "rounds": rounds})
    unison.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["train", "elastic", "overhead"])
    p.add_argument("--out", required=True)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--algorithm", default="allreduce")
    p.add_argument("--steps", type=int, default=10**9, help="stop here (or at the step in OUT/stop)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", choices=["kill", "stop"], default=None)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--at", type=int, default=30)
    p.add_argument("--chain", type=int, default=0, help="replacements to heal in one after the other")
    p.add_argument("--chain-after", type=int, default=20)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--contenders", default="compute,allreduce,allreduce+ft")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-round", type=int, default=0, help="even: contenders in the given order first")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--warmup", type=int, default=16)
    args = p.parse_args()
    {"train": train, "elastic": elastic, "overhead": overhead}[args.role](args)


if __name__ == "__main__":
    main()
