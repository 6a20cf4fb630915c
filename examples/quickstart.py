"""The smallest complete unison program: launch it with torchrun, mpirun or srun.

torchrun --standalone --nproc-per-node 2 examples/quickstart.py
"""

import torch
from torch import nn

import unison

topo = unison.init()  # reads torchrun / mpirun / srun variables; a world of one when run alone
torch.manual_seed(0)  # the same data on every rank; each rank trains on its own shard of it
x = torch.randn(1024, 20)
data = torch.utils.data.TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())
loader = unison.sharded_loader(data, batch_size=32)

net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
model = unison.DataParallel(net)  # rank 0's weights are broadcast; gradients will be averaged
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

for epoch in range(3):
    loader.sampler.set_epoch(epoch)  # reshuffle the shards
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # buckets are averaged while backward runs
        optimizer.step()
    if topo.rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}")

if topo.rank == 0:
    torch.save(model.state_dict(), "quickstart.pt")  # plain module keys, no "module." prefix
unison.shutdown()
