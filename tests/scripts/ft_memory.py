"""What fault tolerance keeps beyond local training, in copies of the parameters (P).

Run under `unison launch --fault-tolerant --nproc 2 ft_memory.py OUT SPEC [SPEC ...]`. Each worker
trains the 4 MiB MLP of tests/integration/test_memory.py for 12 steps without a wrapper, then once
per SPEC with ``DataParallel(..., fault_tolerant=True)`` (a spec ending in ``+offload`` adds
``ft_offload=True``), and writes OUT/<worker id>.json: each spec's live tensors over local
training's, in P, whether every spec's weights equal the first spec's of its algorithm, and
where the algorithm's own fault-tolerance copies were told to live (its state's ``on_host``).
With ``FT_MEMORY_DEVICE=cuda`` the model and data are on the GPU, the workers talk over gloo
(two of them share one GPU) and the overheads count the GPU's tensors alone: what a GPU holds.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import unison
from unison.memory import live_tensor_bytes, parameter_bytes

STEPS = 12
BUCKET_MB = 0.25
DEVICE = torch.device(os.environ.get("FT_MEMORY_DEVICE", "cpu"))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(256, 256), nn.ReLU())][:-1])


def train(spec: str | None, rank: int) -> tuple[float, list[torch.Tensor], object]:
    """Live tensor bytes over before after ``STEPS`` steps of ``spec`` (None: no wrapper), the
    weights, and the algorithm state's ``on_host`` (None where it has none)."""
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 256, generator=g).to(DEVICE), torch.randn(8, 256, generator=g).to(DEVICE)
    gc.collect()
    before = live_tensor_bytes(device=DEVICE)
    module = net().to(DEVICE)
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    model: nn.Module = module
    if spec is not None:
        algorithm, _, extra = spec.partition("+")
        model = unison.DataParallel(
            module,
            optimizer=opt,
            algorithm=algorithm,
            bucket_cap_mb=BUCKET_MB,
            fault_tolerant=True,
            ft_offload=extra == "offload",
        )
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    live = live_tensor_bytes([module], [opt], device=DEVICE) - before
    weights = [p.detach().clone() for p in module.parameters()]
    on_host = None
    if isinstance(model, unison.DataParallel):
        on_host = getattr(model._core.events.state, "on_host", None)
        model.close()
    del model, module, opt
    gc.collect()
    return live, weights, on_host


def main() -> None:
    out, specs = sys.argv[1], sys.argv[2:]
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    unison.init(backend="gloo" if DEVICE.type == "cuda" else None)
    rank = int(os.environ.get("UNISON_FT_ID", "0"))
    p = parameter_bytes(net())
    local, _, _ = train(None, rank)
    overheads, weights, on_host = {}, {}, {}
    for spec in specs:
        live, weights[spec], on_host[spec] = train(spec, rank)
        overheads[spec] = (live - local) / p
    same = {
        spec: all(torch.equal(a, b) for a, b in zip(weights[spec], weights[spec.partition("+")[0]]))
        for spec in specs
        if "+" in spec and spec.partition("+")[0] in weights
    }
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"overheads": overheads, "same_as_on_device": same, "on_host": on_host}, f)


if __name__ == "__main__":
    main()
