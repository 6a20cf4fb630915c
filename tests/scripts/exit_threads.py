"""Train with every algorithm, then end: no gloo thread may be left when the interpreter finalizes.

Run under torchrun by tests/integration/test_exit.py, with ``shutdown`` (the script calls
``unison.shutdown()``) or ``atexit`` (it does not: unison ends the job at exit). An atexit
handler registered before unison is imported runs after unison's own, last before the
interpreter finalizes; it writes the names of this process's threads that belong to gloo
(``pt_gloo_runloop``: a group's workers; ``gloo_tcp_loop``: its transport) to
``threads-<rank>.txt``, and, after ``shutdown``, the ones left right after the call. A gloo
worker still alive there can free a tensor after finalization began, and abort the process
(runtime/ending.py).
"""

import atexit
import os
import sys


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(n for n in names if "gloo" in n)


def report(tag: str) -> None:
    with open(f"threads-{os.environ['RANK']}.txt", "a") as f:
        f.write(f"{tag}: {' '.join(gloo_threads())}\n")


atexit.register(report, "at exit")  # before unison's handler is registered: it runs after it

import torch  # noqa: E402
from torch import nn  # noqa: E402

import unison  # noqa: E402

mode, algorithms = sys.argv[1], sys.argv[2].split(",")
topo = unison.init()
torch.manual_seed(0)
models = []
for name in algorithms:
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    if name == "qadam":
        optimizer = unison.optim.QAdamOptimizer(net.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    model = unison.DataParallel(net, optimizer=optimizer, algorithm=name)
    for _ in range(20):  # past the first sync of a period of 16
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 2, (8,)))
        loss.backward()
        optimizer.step()
    models.append((model, optimizer, loss))  # kept to the end, as a script keeps its last model and loss
for model, _, _ in models:
    model.average()  # the replicas agree at the end (and async's thread stops exchanging)
if mode == "shutdown":
    unison.shutdown()
    report("after shutdown")
