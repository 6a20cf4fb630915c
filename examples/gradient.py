"""Gradient averaging: PowerSGD, gradient accumulation, nan skipping and exact checkpoints.

torchrun --standalone --nproc-per-node 2 examples/gradient.py --epochs 3 --ckpt ckpt/gradient.pt

Every step the ranks agree on one gradient, compressed by PowerSGD (rank-2 factors with error
feedback), so the replicas stay identical. Killed and started again with the same command, the
run resumes from its last checkpoint along the same trajectory.
"""

import argparse

import torch
from torch import nn

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--ckpt", default="ckpt/gradient.pt", help="a path every rank can read")
args = parser.parse_args()

topo = unison.init()
torch.manual_seed(0)
x = torch.randn(2048, 32)
data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
loader = unison.sharded_loader(data, batch_size=32)

net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 2))
optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
algorithm = unison.algorithms.create("powersgd", rank=2, start_iter=10)
model = unison.DataParallel(net, optimizer=optimizer, algorithm=algorithm, nonfinite="skip")

state = unison.load(args.ckpt, model, optimizer, loader.sampler, missing_ok=True)  # every rank
start = state["epoch"] if state else 0
for epoch in range(start, args.epochs):
    loader.sampler.set_epoch(epoch)
    for xb, yb in loader:
        half = len(xb) // 2
        with model.no_sync():  # the first half only accumulates ...
            nn.functional.cross_entropy(model(xb[:half]), yb[:half]).backward()
        loss = nn.functional.cross_entropy(model(xb[half:]), yb[half:])
        loss.backward()  # ... the second averages the sum, compressed
        optimizer.step()
        optimizer.zero_grad()
    unison.save(args.ckpt, model, optimizer, loader.sampler, epoch=epoch + 1)  # a collective
    if topo.rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, sent {model.comm_stats['bytes_last_step']} bytes last step")

weights = torch.cat([p.detach().flatten() for p in model.parameters()])
if topo.rank == 0:
    print(f"skipped steps: {model.skipped_steps}; first weight {weights[0].item():.6f}")
unison.shutdown()
