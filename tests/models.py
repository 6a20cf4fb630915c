"""Small models and data for the distributed tests, each exercising one situation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DIN, DOUT = 16, 4


def batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the same on every process that asks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, DIN, generator=g), torch.randn(n, DOUT, generator=g)


def image_batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randn(n, DOUT, generator=g)


def token_batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 30, (n, 5), generator=g), torch.randint(0, 30, (n, 5), generator=g)


class MLP(nn.Module):
    def __init__(self, hidden: int = 32, depth: int = 3):
        super().__init__()
        dims = [DIN] + [hidden] * (depth - 1) + [DOUT]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x, **_):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Branchy(nn.Module):
    """A dynamic graph: ``branch`` picks a layer; ``never`` is never used."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIN, 32)
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.never = nn.Linear(32, 32)
        self.out = nn.Linear(32, DOUT)

    def forward(self, x, branch="a"):
        h = torch.relu(self.inp(x))
        if branch == "a":
            h = self.a(h)
        elif branch == "b":
            h = self.b(h)
        return self.out(torch.relu(h))


class Checkpointed(nn.Module):
    """The middle block runs under activation checkpointing."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(DIN, 32)
        self.mid = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.out = nn.Linear(32, DOUT)

    def forward(self, x, **_):
        h = torch.relu(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=self.reentrant)
        return self.out(h)


class Tied(nn.Module):
    """A language-model head whose output weight is the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 30, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, **_):
        return self.head(torch.tanh(self.mix(self.emb(x))))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, DOUT)

    def forward(self, x, **_):
        h = F.max_pool2d(torch.relu(self.bn(self.conv(x))), 2)
        return self.fc(h.flatten(1))


def frozen_mlp() -> MLP:
    model = MLP()
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    return model


class ReverseRegistered(nn.Module):
    """Layers registered in the order they are used, last first: the initial bucket
    plan (reverse registration order) guesses the gradient order wrong."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(64, DOUT)
        self.mid = nn.Linear(64, 64)
        self.inp = nn.Linear(DIN, 64)

    def forward(self, x, **_):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))
