"""What ``torch.compile`` makes of each wrapper: graphs compiled, graph breaks, eager fallbacks.

Two gloo ranks (one torch thread each) train a small MLP for a few steps under
``torch.compile(wrapper(net))``, each contender in fresh processes from the
same seed. TorchDynamo's counters, reset after the wrapper is built, give per
rank:

* ``graphs``: the FX graphs handed to the backend (``unique_graphs``); 0 means
  that nothing of the model was compiled and it ran eagerly;
* ``ops``: the operations captured in those graphs (``calls_captured``);
* ``breaks``: the graph breaks, with their reasons (``graph_break``);
* ``failed``: frames Dynamo gave up on and ran eagerly whole (``unimplemented``);
* ``max_diff``: the largest difference between the weights after compiled
  training and after the same contender's eager training (same data).

Contenders: ``ddp`` (torch DDP) and unison algorithms as ``NAME`` or
``NAME:opt=value,...``. The backend is ``aot_eager`` (Dynamo and AOTAutograd,
no code generation, so the run takes seconds); ``--backend inductor`` compiles
for real.

Example::

    python benchmarks/bench_compile.py                 # about a minute
    python benchmarks/bench_compile.py --contenders ddp,allreduce --backend inductor

Prints a table; writes benchmarks/results/compile.json (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import launch, split_contenders
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import unison

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = "ddp,allreduce,local_sgd:period=2"
STEPS = 6


class Net(nn.Module):
    """A model of the user's own (Dynamo compiles user code; torch's own modules alone it skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def train(contender: str, compiled: bool, backend: str) -> tuple[list[torch.Tensor], dict]:
    """Train ``contender`` for STEPS steps; its final weights and Dynamo's counters."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped: nn.Module = DDP(model) if contender == "ddp" else unison.DataParallel(model, opt, algorithm=contender)
    dynamo.reset()
    counters.clear()
    run = torch.compile(wrapped, backend=backend) if compiled else wrapped
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        F.mse_loss(run(x), y).backward()
        opt.step()
    if isinstance(wrapped, unison.DataParallel):
        wrapped.average()
        wrapped.close()
    stats = {
        "graphs": counters["stats"]["unique_graphs"],
        "ops": counters["stats"]["calls_captured"],
        "breaks": sum(counters["graph_break"].values()),
        "failed": sum(counters["unimplemented"].values()),
        "reasons": sorted({r.split("\n")[0] for r in [*counters["graph_break"], *counters["unimplemented"]]}),
    }
    return [p.detach().clone() for p in model.parameters()], stats


def worker(contender: str, backend: str) -> dict:
    torch.set_num_threads(1)
    unison.init(backend="gloo")
    try:
        eager, _ = train(contender, False, backend)
        weights, stats = train(contender, True, backend)
        stats["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(weights, eager))
        return stats
    finally:
        unison.shutdown()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=DEFAULT)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "compile.json"))
    args = parser.parse_args(argv)
    rows = {}
    for contender in split_contenders(args.contenders):
        rows[contender] = launch(worker, 2, contender, args.backend)[0]
    print(f"torch.compile(backend={args.backend!r}), 2 gloo ranks, {STEPS} steps (rank 0)")
    print(f"{'contender':<22}{'graphs':>7}{'ops':>6}{'breaks':>8}{'failed':>8}{'max_diff':>10}  reasons")
    for name, r in rows.items():
        reasons = "; ".join(r["reasons"]) or "-"
        print(
            f"{name:<22}{r['graphs']:>7}{r['ops']:>6}{r['breaks']:>8}{r['failed']:>8}{r['max_diff']:>10.2g}  {reasons}"
        )
    result = {"command": "python benchmarks/bench_compile.py " + " ".join(argv), "backend": args.backend, "rows": rows}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
