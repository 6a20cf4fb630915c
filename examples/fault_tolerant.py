"""Fault tolerance inside the job: survivors regroup and go on when a worker dies.

unison launch --fault-tolerant --nproc 3 --respawn examples/fault_tolerant.py --epochs 5

When a worker dies, hangs or leaves, the others regroup and go on, every committed step applied
exactly once; with ``--respawn`` a replacement heals from a live peer (weights, optimizer,
sampler position, scheduler) and trains on. See docs/fault-tolerance.md.
"""

import argparse

import torch
from torch.utils.data import TensorDataset

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()

unison.init()  # joins the coordinator's membership
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
model = unison.DataParallel(net, optimizer=opt, algorithm="allreduce", fault_tolerant=True)
data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
loader = unison.sharded_loader(data, batch_size=32, drop_last=True)
model.ft.attach(sampler=loader.sampler, scheduler=sched)  # healed into a replacement too
for epoch in range(loader.sampler.epoch, args.epochs):  # a replacement starts where the members are
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
model.average()
if model.ft.rank == 0:
    print("steps", model.ft.step, "members", model.ft.members)
    print("events", [(e.kind, e.detail) for e in model.ft.events])
