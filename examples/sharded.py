"""A model sharded inside each node with FSDP2, DiLoCo across the nodes.

torchrun --standalone --nproc-per-node 4 examples/sharded.py --nodes 2 --epochs 2

The processes form ``--nodes`` nodes (consecutive ranks; torchrun's own nodes on a cluster). Inside
a node FSDP2 shards every block and the root over the node's processes (``mesh["shard"]``):
each holds a share of the weights, gradients and optimizer state. Across the nodes unison runs
the algorithm over ``mesh["replicate"]``: each process syncs its own shards with the processes
that hold the same shards on the other nodes, every ``period`` steps for DiLoCo, so the slow
link between nodes carries a pseudo-gradient now and then instead of every gradient (torch's
HSDP, ``algorithm="allreduce"``). At the end ``model.average()`` makes the nodes' replicas
identical and each node holds the whole model in shards.
"""

import argparse

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import unison

parser = argparse.ArgumentParser()
parser.add_argument("--nodes", type=int, default=2)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--algorithm", default="diloco:period=8")
args = parser.parse_args()

topo = unison.init(nodes=args.nodes)
device = "cuda" if torch.cuda.is_available() else "cpu"
mesh = init_device_mesh(device, (topo.num_nodes, topo.local_world_size), mesh_dim_names=("replicate", "shard"))

torch.manual_seed(0)
x = torch.randn(4096, 32)
data = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
loader = unison.sharded_loader(data, batch_size=32)  # every process its own batches, FSDP2's ranks too

net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
for block in net:
    if isinstance(block, nn.Linear):
        fully_shard(block, mesh=mesh["shard"])
fully_shard(net, mesh=mesh["shard"])
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
model = unison.DataParallel(net, optimizer=optimizer, algorithm=args.algorithm, device_mesh=mesh["replicate"])

for epoch in range(args.epochs):
    loader.sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()  # FSDP2 reduce-scatters the gradients inside the node
        optimizer.step()  # every period steps, the shards are synced across the nodes
    if topo.rank == 0:
        print(f"epoch {epoch} ({model.algorithm.name}): loss {loss.item():.4f}")

model.average()  # every process: the nodes' replicas become identical
weights = {name: p.full_tensor() for name, p in net.named_parameters()}  # a collective in the node
if topo.rank == 0:
    print(f"sent {model.comm_stats['bytes_per_step']:.0f} bytes per step across the nodes")
    torch.save(weights, "sharded.pt")
unison.shutdown()
