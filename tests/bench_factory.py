"""Model factories for ``unison bench --model bench_factory:NAME`` in the tests."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def _data(n: int = 640, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def tiny():
    """A small classifier of a linearly separable rule: (model, dataset, loss)."""
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)), _data(), F.cross_entropy


class Attending(nn.Module):
    """Self-attention over a sequence of one, which also reads ``out.weight`` before any layer
    from its second training forward on: "nonblocking" updates each weight where the first
    training forward read it, and refuses a forward that reads it earlier (it would be stale)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 2)
        self.forwards = 0

    def forward(self, x):
        self.forwards += self.training
        early = self.out.weight.sum() * 0.0 if self.forwards > 1 and self.training else 0.0
        h = self.inp(x).unsqueeze(1)
        return self.out(self.attn(h, h, h, need_weights=False)[0].squeeze(1)) + early


def attending():
    return Attending(), _data(), F.cross_entropy


def not_a_triple():
    return nn.Linear(8, 2)


def wide():
    """1.1M parameters (4.3 MB of gradients), so that link bytes are dominated by gradients."""
    return (
        nn.Sequential(nn.Linear(8, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 2)),
        _data(),
        F.cross_entropy,
    )
