"""Train a few steps and leave at once: the process must exit cleanly.

Run under torchrun by tests/test_exit.py. Before unison released its last
communication works from Python, a rank that reached exit right after its last
backward aborted now and then (one launch in two with the switch interval below:
"terminate called without an active exception"): a gloo thread dropped the
last reference to a work during interpreter shutdown.
"""

import sys
import time

import torch
from torch import nn

import unison

sys.setswitchinterval(10)  # the main thread keeps the GIL until it blocks: widens the old race
topo = unison.init()
torch.manual_seed(topo.rank)
model = unison.DataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), bucket_cap_mb=0.005)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 32)).sum().backward()
    optimizer.step()
if topo.rank == 0:
    time.sleep(0.05)  # the others reach exit first, as when rank 0 saves a checkpoint
unison.shutdown()
