"""A model sharded inside each node with FSDP2, DiLoCo across the nodes, under fault tolerance.

unison launch --fault-tolerant --nodes 3 --procs-per-node 2 --respawn examples/sharded_fault_tolerant.py --epochs 3

A node (all its processes) is the unit of failure: when one of its processes dies or hangs the
node goes, the other nodes regroup and train on, and with ``--respawn`` a new node joins, each of
its processes healing its shards from the process of the same local rank on a live node. FSDP2
shards the model over ``unison.node_mesh()``, whose group lives as long as the node, across every
membership; DataParallel then needs no ``device_mesh``: the replicas of a shard are the processes
of its local rank on every node. The algorithm runs unstreamed (``fragments=1, delay=0``).
See docs/sharded.md.
"""

import argparse

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--algorithm", default="diloco:period=8,fragments=1,delay=0")
args = parser.parse_args()

unison.init()  # joins the coordinator's membership
mesh = unison.node_mesh()  # this node's processes, for as long as the node lives
device = mesh.device_type

torch.manual_seed(0)
x = torch.randn(4096, 32)
data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
loader = unison.sharded_loader(data, batch_size=32, drop_last=True)  # every process its own batches

net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
for block in net:
    if isinstance(block, nn.Linear):
        fully_shard(block, mesh=mesh)
fully_shard(net, mesh=mesh)
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
model = unison.DataParallel(net, optimizer=optimizer, algorithm=args.algorithm, fault_tolerant=True)
model.ft.attach(sampler=loader.sampler)  # a replacement starts where the members are

for epoch in range(loader.sampler.epoch, args.epochs):
    loader.sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()  # FSDP2 reduce-scatters the gradients inside the node
        optimizer.step()  # every period steps, the shards are synced across the nodes
    if model.ft.rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}, members {model.ft.members}")

model.average()  # every process: the nodes' replicas become identical
weights = {name: p.full_tensor() for name, p in net.named_parameters()}  # a collective in the node
if model.ft.rank == 0:
    print("steps", model.ft.step, "events", [(e.kind, e.detail) for e in model.ft.events])
    torch.save(weights, "sharded_fault_tolerant.pt")
