"""Train, switch, save and load where NumPy cannot be imported (the core install
needs neither: `pip install "torch==2.13.0" -e .`).

Run under torchrun by tests/test_without_numpy.py with the checkpoint path as its argument.
"""

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` now raises ImportError

import torch  # noqa: E402
from torch import nn  # noqa: E402

import unison  # noqa: E402

path = sys.argv[1]
topo = unison.init()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
model = unison.DataParallel(net, optimizer=opt)
torch.manual_seed(topo.rank)
for step in range(4):
    if step == 2:
        model.switch_to("local_sgd:period=2")
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
unison.save(path, model, opt, step=4)
state = unison.load(path, model, opt)
model.average()
assert state is not None and state["step"] == 4
assert "numpy" not in sys.modules or sys.modules["numpy"] is None
print(f"rank {topo.rank} ok")
unison.shutdown()
