"""A HeAT script moved to unison by changing its import.

torchrun --standalone --nproc-per-node 2 examples/heat_migration.py
mpirun -np 2 python examples/heat_migration.py

Before, the first line was ``import heat as ht``; nothing else changed. ``ht.nn.DataParallel``
with HeAT's default non-blocking updates is unison's ``nonblocking`` algorithm: the update of
each step is applied during the next forward. See docs/migration.md.
"""

import torch
from torch import nn

from unison.compat import heat as ht

torch.manual_seed(0)
x = torch.randn(1024, 20)
y = (x[:, 0] + x[:, 1] > 0).long()
rank, size = ht.MPI_WORLD.rank, ht.MPI_WORLD.size
x, y = x[rank::size], y[rank::size]  # this rank's part of the data

net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
optimizer = ht.optim.DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
model = ht.nn.DataParallel(net, ht.MPI_WORLD, optimizer)  # non-blocking by default, as in HeAT
loss_fn = nn.CrossEntropyLoss()

for epoch in range(3):
    for i in range(0, len(x), 32):
        optimizer.zero_grad()
        loss = loss_fn(model(x[i : i + 32]), y[i : i + 32])
        loss.backward()
        optimizer.step()  # applied during the next forward
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.item():.4f}")

model.eval()  # flushes the last update
if rank == 0:
    print(f"first weight {net[0].weight[0, 0].item():.6f}")
