"""Model averaging: DiLoCo's local steps and outer syncs, then a switch to local SGD.

torchrun --standalone --nproc-per-node 2 examples/model_averaging.py --epochs 4

The replicas train on their own gradients and meet every ``period`` steps (DiLoCo: the averaged
pseudo-gradient drives an outer Nesterov step; the sync is streamed in fragments while training
goes on). Halfway the job switches to local SGD on every rank at the same step; at the end
``model.average()`` makes the replicas identical.
"""

import argparse

import torch
from torch import nn

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()

topo = unison.init()
torch.manual_seed(0)
x = torch.randn(4096, 16)
data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
loader = unison.sharded_loader(data, batch_size=32)

net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
model = unison.DataParallel(net, optimizer=optimizer, algorithm=unison.algorithms.create("diloco", period=8))

for epoch in range(args.epochs):
    if epoch == args.epochs // 2:
        model.switch_to("local_sgd")  # averages the replicas and hands over, on every rank
    loader.sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()  # local gradients: nothing is sent here
        optimizer.step()  # the algorithm syncs after some steps
    model.end_epoch(loss.item())
    if topo.rank == 0:
        print(f"epoch {epoch} ({model.algorithm.name}): loss {loss.item():.4f}")

model.average()  # every rank: the replicas become identical
if topo.rank == 0:
    print(f"sent {model.comm_stats['bytes_per_step']:.0f} bytes per step on average")
    torch.save(model.state_dict(), "model_averaging.pt")
unison.shutdown()
