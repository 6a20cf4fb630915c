"""The GPU's codec schedule in real syncs: every algorithm that sends through a codec trains on
2 gloo ranks with its codecs forced onto the whole-buffer schedule (``UNISON_CODEC_SCHEDULE=whole``,
what a GPU runs) and ends with the weights of the blocked schedule (what a CPU runs), from the
same seed and data. The unit tests in tests/unit/codecs/ hold each codec's two schedules equal
on single calls; this holds them equal through an algorithm's whole step: its buffers, its
error feedback and its collectives."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import unison
from tests import launch
from tests.models import MLP, batch
from unison.engine.codecs import schedule

#: Algorithms whose wire goes through a codec, and how close the two schedules end after 12
#: steps. 0: bit for bit (the same arithmetic in the same order). Otherwise the largest
#: difference of a weight, where a matrix product (demo's DCT, PowerSGD's factors) or the bins'
#: sums (sparseloco) add in another order in one schedule than in the other.
CASES = {
    "fp16": 0.0,
    "bf16": 0.0,
    "bytegrad": 0.0,
    "qadam": 0.0,
    "low_precision_decentralized": 0.0,
    "daso:warmup_epochs=0,max_global_skips=2": 0.0,
    "diloco:period=4,wire_dtype=bf16": 0.0,
    "powersgd:rank=2,start_iter=2": 1e-5,
    "demo": 1e-5,
    "sparseloco:period=4": 1e-5,
}
STEPS = 12


def train_both(specs: list[str]) -> dict[str, float]:
    """Each spec trained twice on this rank, blocked then whole; the largest weight difference."""
    out = {}
    for spec in specs:
        name, options = unison.algorithms.parse(spec)
        weights = []
        for forced in ("blocked", "whole"):
            os.environ[schedule.ENV] = forced
            torch.manual_seed(0)
            net = MLP(hidden=640)  # 0.4M weights: the blocked loops take several blocks
            if name == "qadam":
                opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=4)
            else:
                opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            model = unison.DataParallel(net, optimizer=opt, algorithm=unison.algorithms.create(name, **options))
            rank = torch.distributed.get_rank()
            for step in range(STEPS):
                x, y = batch(step, rank)
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                if name == "daso" and (step + 1) % 4 == 0:
                    model.end_epoch(0.0)
            model.flush()
            weights.append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
            assert torch.isfinite(weights[-1]).all(), f"{spec} ({forced}) did not train: non-finite weights"
            model.close()
        os.environ.pop(schedule.ENV)
        out[spec] = (weights[0] - weights[1]).abs().max().item()
    return out


@pytest.mark.parametrize("chunk", [0, 1])
def test_the_whole_schedule_trains_as_the_blocked_one(chunk):
    specs = list(CASES)[chunk::2]
    results = launch.run(train_both, 2, specs, timeout=240)
    for spec in specs:
        worst = max(r[spec] for r in results)
        assert worst <= CASES[spec], f"{spec}: the schedules differ by {worst:.3g} (allowed {CASES[spec]:.0e})"
