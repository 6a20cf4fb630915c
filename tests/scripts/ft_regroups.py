"""Many regroups in a row, and what they leave in the process: threads, file descriptors, memory.

Run under `unison launch --fault-tolerant`. The cheapest regroup there is: the oldest member asks
the coordinator for the same members again (``ft/rebuild/<epoch>``, what a member does when its
group could not be built), and every member regroups at its next step boundary (or in the step's
collective): the default group and the algorithm's private groups are built again, then a settle
(no heal: nobody is behind). After ``--warmup`` regroups (torch's lazy state is made) this worker
takes its figures, then after ``--regroups`` more, once the reaper has let the old groups go, again.
Each worker writes OUT/<id>.json.
"""

import argparse
import gc
import json
import os
import threading
import time

import torch
from torch import nn

import unison
from unison.fault import member

STOP_KEY = "test/stop_at"


def figures() -> dict:
    gc.collect()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--regroups", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--algorithm", default="allreduce")
    args = p.parse_args()
    unison.init()
    m = member.active()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = unison.DataParallel(net, optimizer=opt, algorithm=args.algorithm, fault_tolerant=True)
    total = args.warmup + args.regroups
    before = None
    started = time.monotonic()
    asked = -1  # the epoch this worker last asked to rebuild
    stop_at = None
    while stop_at is None or model.ft.step < stop_at:
        done = sum(1 for e in model.ft.events if e.kind == "regroup")
        if done == args.warmup and before is None:
            before, started = figures(), time.monotonic()
        if model.ft.rank == 0 and m.latest == m.epoch and asked != m.epoch:
            if done < total:
                m.store.set(f"ft/rebuild/{m.epoch}", str(m.id))  # the same members again, please
                asked = m.epoch
            elif not m.store.check([STOP_KEY]):
                m.store.set(STOP_KEY, str(model.ft.step + 10))  # every member stops at the same step
        if stop_at is None and m.store.check([STOP_KEY]):
            stop_at = int(m.store.get(STOP_KEY))
        opt.zero_grad()
        x = torch.randn(8, 64)
        model(x).pow(2).mean().backward()
        opt.step()
        time.sleep(0.002)
    elapsed = time.monotonic() - started
    regroups = sum(1 for e in model.ft.events if e.kind == "regroup") - args.warmup
    deadline = time.monotonic() + 20  # the reaper lets the last old groups go
    while m.reaper.held > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = figures()
    result = {
        "id": m.id,
        "regroups": regroups,
        "elapsed_s": elapsed,
        "before": before,
        "after": after,
        "held": m.reaper.held,
        "step": model.ft.step,
        "failures": [e.detail for e in model.ft.events if e.kind == "failure"],
    }
    with open(os.path.join(args.out, f"{m.id}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
