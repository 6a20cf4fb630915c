"""PowerSGD on 2 gloo ranks: the bytes it saves, agreement between replicas,
plain averaging during the warm-up, exactness on low-rank gradients, error
feedback, checkpoints, and option checks."""

from __future__ import annotations

import copy
import io

import launch
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, batch
from scenarios import max_diff, spread_across_ranks
from torch import nn

import unison


def big_mlp() -> nn.Module:
    """About 0.8M parameters, almost all in three 512 x 512 matrices."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))


class ConvNet(nn.Module):
    """A 4-D convolution weight (compressed as 16 x 72) beside matrices and biases."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def dp(net, rank=4, start_iter=0, **kwargs):
    options = {k: kwargs.pop(k) for k in ("warm_start", "min_compression_rate") if k in kwargs}
    alg = unison.algorithms.create("powersgd", rank=rank, start_iter=start_iter, **options)
    return unison.DataParallel(net, algorithm=alg, **kwargs)


def train_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def check_bytes() -> dict:
    """(a) bytes per step of a 0.8M-parameter MLP once compression runs, against allreduce."""
    rank = dist.get_rank()
    out = {}
    for name, make in (
        ("allreduce", lambda n: unison.DataParallel(n)),
        ("powersgd", lambda n: dp(n, rank=4, start_iter=1)),
    ):
        model = make(big_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            train_step(model, opt, torch.randn(8, 512, generator=g), torch.randn(8, 512, generator=g))
        out[name] = model.comm_stats["bytes_last_step"]
    return out


def check_agreement() -> dict:
    """(b) replicas hold identical parameters after compressed steps, with and without warm start."""
    rank = dist.get_rank()
    out = {}
    for warm in (True, False):
        torch.manual_seed(1)
        model = dp(ConvNet(), rank=2, start_iter=1, warm_start=warm)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        start = copy.deepcopy(model.module)
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            train_step(model, opt, torch.randn(6, 8, 4, 4, generator=g), torch.randn(6, 4, generator=g))
        out[warm] = {"spread": spread_across_ranks(model.module), "moved": max_diff(start, model.module)}
    return out


def check_warmup_is_allreduce() -> dict:
    """(c) before start_iter the parameters equal plain allreduce's exactly; after, they part."""
    rank = dist.get_rank()
    torch.manual_seed(2)
    net = MLP(hidden=32)
    ref = unison.DataParallel(copy.deepcopy(net))
    model = dp(copy.deepcopy(net), rank=1, start_iter=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    diffs = []
    for step in range(4):
        x, y = batch(step, rank)
        train_step(ref, ref_opt, x, y)
        train_step(model, opt, x, y)
        diffs.append(max_diff(ref.module, model.module))
    return {
        "diffs": diffs,
        "bytes": model.comm_stats["bytes_last_step"],
        "ref_bytes": ref.comm_stats["bytes_last_step"],
    }


def check_low_rank_exact() -> dict:
    """(d) one sample per rank through a bias-free Linear: the averaged gradient has
    rank 2, so rank-4 PowerSGD reproduces it."""
    rank = dist.get_rank()
    torch.manual_seed(3)
    net = nn.Linear(64, 48, bias=False)
    ref = unison.DataParallel(copy.deepcopy(net))
    model = dp(copy.deepcopy(net), rank=4, start_iter=0)
    errors, scale = [], 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(1, 64, generator=g), torch.randn(1, 48, generator=g)
        for m in (ref, model):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        errors.append((ref.module.weight.grad - model.module.weight.grad).abs().max().item())
        scale = max(scale, ref.module.weight.grad.abs().max().item())
    residual = model.algorithm_state.state_dict()["residuals"]["weight"]
    return {"errors": errors, "scale": scale, "residual": residual.abs().max().item()}


def check_error_feedback() -> dict:
    """(e) the approximations of several steps plus the ranks' final residuals add up to
    the sum of the averaged gradients: what compression leaves out is carried, not lost."""
    rank = dist.get_rank()
    torch.manual_seed(4)
    net = MLP(hidden=32)
    ref = unison.DataParallel(copy.deepcopy(net))
    model = dp(copy.deepcopy(net), rank=1, start_iter=0)
    total_ref = [torch.zeros_like(p) for p in net.parameters()]
    total_approx = [torch.zeros_like(p) for p in net.parameters()]
    for step in range(4):
        x, y = batch(step, rank)
        for m, total in ((ref, total_ref), (model, total_approx)):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
            for t, g in zip(total, grads(m)):
                t.add_(g)
    residuals = model.algorithm_state.state_dict()["residuals"]
    names = [n for n, _ in model.module.named_parameters()]
    summed = []
    for name in names:
        r = residuals[name].clone()
        dist.all_reduce(r)
        summed.append(r)
    with_residual = max((a + r - g).abs().max().item() for a, r, g in zip(total_approx, summed, total_ref))
    without = max((a - g).abs().max().item() for a, g in zip(total_approx, total_ref))
    scale = max(g.abs().max().item() for g in total_ref)
    return {"with_residual": with_residual, "without": without, "scale": scale}


def check_state_round_trip() -> dict:
    """(f) a checkpoint taken after compressed steps, loaded into a fresh model with
    another bucket layout, continues exactly; the weights alone do not, nor
    the residuals without the warm-start factors."""
    rank = dist.get_rank()
    torch.manual_seed(5)
    a = dp(MLP(hidden=32), rank=1, start_iter=1)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05)
    for step in range(4):
        train_step(a, opt_a, *batch(step, rank))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)

    torch.manual_seed(6)
    b = dp(MLP(hidden=32), rank=1, start_iter=1, bucket_cap_mb=0.001)
    b.load_state_dict(saved)
    torch.manual_seed(6)
    c = dp(MLP(hidden=32), rank=1, start_iter=1)
    c.module.load_state_dict({k: v for k, v in saved.items() if not k.startswith("_unison")})
    c.algorithm_state.passes = a.algorithm_state.passes
    torch.manual_seed(6)
    d = dp(MLP(hidden=32), rank=1, start_iter=1)
    no_q = dict(saved)
    no_q["_unison_algorithm"] = {
        **saved["_unison_algorithm"],
        "state": {**saved["_unison_algorithm"]["state"], "qs": {}},
    }
    d.load_state_dict(no_q)
    steps = (a.algorithm_state.passes, b.algorithm_state.passes)
    before = max_diff(a.module, b.module)
    for m in (a, b, c, d):
        train_step(m, torch.optim.SGD(m.parameters(), lr=0.05), *batch(4, rank))
    return {
        "before": before,
        "after": max_diff(a.module, b.module),
        "weights_only": max_diff(a.module, c.module),
        "without_warm_start": max_diff(a.module, d.module),
        "steps": steps,
        "buckets": len(b._core.reducer.buckets),
    }


def all_checks() -> dict:
    return {
        "bytes": check_bytes(),
        "agreement": check_agreement(),
        "warmup": check_warmup_is_allreduce(),
        "low_rank": check_low_rank_exact(),
        "error_feedback": check_error_feedback(),
        "round_trip": check_state_round_trip(),
    }


@pytest.fixture(scope="module")
def results():
    return launch.run(all_checks, 2, timeout=120)


def test_compressed_step_sends_a_tenth_of_allreduce(results):
    for r in results:
        assert 0 < r["bytes"]["powersgd"] <= r["bytes"]["allreduce"] / 10, r["bytes"]


def test_replicas_agree(results):
    for r in results:
        for warm, got in r["agreement"].items():
            assert got["spread"] == 0.0, f"warm_start={warm}: replicas differ by {got['spread']}"
            assert got["moved"] > 0, f"warm_start={warm}: the parameters never moved"


def test_warmup_equals_allreduce(results):
    for r in results:
        w = r["warmup"]
        assert w["diffs"][:3] == [0.0, 0.0, 0.0], w["diffs"]
        assert w["diffs"][3] > 0, "compression never started"
        assert w["bytes"] < w["ref_bytes"]


def test_low_rank_gradient_is_exact(results):
    for r in results:
        lr = r["low_rank"]
        assert lr["scale"] > 0
        assert max(lr["errors"]) <= 1e-5 * max(1.0, lr["scale"]), lr
        assert lr["residual"] <= 1e-5 * max(1.0, lr["scale"]), lr


def test_error_feedback_keeps_what_compression_left_out(results):
    for r in results:
        ef = r["error_feedback"]
        assert ef["with_residual"] <= 1e-5 * max(1.0, ef["scale"]), ef
        assert ef["without"] > 1e-3 * ef["scale"], "the residual is empty: nothing was left out to check"


def test_state_dict_round_trip(results):
    for r in results:
        rt = r["round_trip"]
        assert rt["before"] == 0.0 and rt["steps"][0] == rt["steps"][1] == 4
        assert rt["buckets"] > 1, "the fresh model was meant to have another bucket layout"
        assert rt["after"] == 0.0, f"the restored model differs by {rt['after']}"
        assert rt["weights_only"] > 0, "the algorithm's state made no difference"
        assert rt["without_warm_start"] > 0, "the saved Q factors made no difference (no warm start?)"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rank": 0}, "rank must be a positive integer"),
        ({"rank": 2.5}, "rank must be a positive integer"),
        ({"start_iter": -1}, "start_iter must be a non-negative integer"),
        ({"min_compression_rate": 0.5}, "min_compression_rate must be a number of at least 1"),
        ({"warm_start": "yes"}, "warm_start must be True or False"),
        ({"ranks": 4}, "has no option 'ranks'"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        unison.algorithms.create("powersgd", **options)
