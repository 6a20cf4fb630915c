"""A fault-tolerant epoch loop over a ShardSampler: which indices each worker trained, step by step.

Run under `unison launch --fault-tolerant`. The dataset is the indices 0..N-1; every worker
appends the batch of each step it committed (model.ft.step moved on) to OUT/<id>.jsonl, as it
goes (a killed worker's steps count too), and writes OUT/<id>.json at the end.
`--kill ID@STEP` SIGKILLs worker ID (the original, not a replacement) before its step STEP.
"""

import argparse
import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import unison


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.03)
    p.add_argument("--kill", default=None)
    args = p.parse_args()
    unison.init()
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = unison.DataParallel(net, optimizer=opt, fault_tolerant=True)
    data = TensorDataset(torch.arange(args.size, dtype=torch.float32))
    # The sampler cuts the epoch to equal shards (drop_last); the loader keeps a short last batch.
    loader = DataLoader(data, batch_size=args.batch, sampler=unison.ShardSampler(data, seed=3, drop_last=True))
    model.ft.attach(sampler=loader.sampler)
    me, first = model.ft.worker_id, (loader.sampler.epoch, model.ft.step)
    victim, _, at = (args.kill or "-1@-1").partition("@")
    log = open(os.path.join(args.out, f"{me}.jsonl"), "a")
    for epoch in range(loader.sampler.epoch, args.epochs):
        loader.sampler.set_epoch(epoch)
        for (x,) in loader:
            if me == int(victim) and model.ft.step == int(at):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(args.sleep)
            before = model.ft.step
            opt.zero_grad()
            model(x[:, None]).sum().backward()
            opt.step()
            if model.ft.step > before:
                log.write(json.dumps([epoch, model.ft.step, x.long().tolist()]) + "\n")
                log.flush()
    result = {"id": me, "first": first, "step": model.ft.step, "world": model.ft.world_size}
    result["events"] = [[e.time, e.kind, e.detail] for e in model.ft.events]
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
