"""A training script that checkpoints and resumes, as the README shows; run by tests/test_restart.py.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/scripts/resume_train.py CKPT OUT [KILL_STEP]

With KILL_STEP, rank 1 leaves with ``os._exit(1)`` right after that global step
on torchrun's first attempt; the restarted group resumes from CKPT. Rank 0
writes the final weights, the steps done and the step it resumed from to OUT.
"""

import os
import sys

import torch
from torch import nn

import unison

EPOCHS, EVERY = 4, 5


def main(ckpt: str, out: str, kill_step: int = 0) -> None:
    topo = unison.init()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 10, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())
    loader = unison.sharded_loader(data, batch_size=8)  # 8 steps per epoch on 2 ranks
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model = unison.DataParallel(net, optimizer, algorithm="local_sgd:period=3")
    torch.manual_seed(topo.rank)  # each rank its own dropout masks

    state = unison.load(ckpt, model, optimizer, loader.sampler, missing_ok=True)
    start_epoch, step = (state["epoch"], state["step"]) if state else (0, 0)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for epoch in range(start_epoch, EPOCHS):
        loader.sampler.set_epoch(epoch)  # the saved epoch resumes where it stopped
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            step += 1
            if step == kill_step and topo.rank == 1 and first_attempt:
                os._exit(1)
            if step % EVERY == 0:
                unison.save(ckpt, model, optimizer, loader.sampler, epoch=epoch, step=step)
    model.average()
    if topo.rank == 0:
        torch.save(
            {"params": [p.detach() for p in net.parameters()], "steps": step, "resumed_from": state and state["step"]},
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    unison.shutdown()
