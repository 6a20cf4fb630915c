"""A character-level transformer language model on the Python standard library's source.

The text is read from the ``*.py`` files next to ``os.py`` (present wherever
Python is), so nothing is downloaded and every run on one machine sees the
same characters (another Python version ships other sources, so figures are
comparable only on one installation)::

    from unison.workloads import charlm
    text = charlm.load_text()                          # about 1 MB of Python source
    vocab = charlm.Vocab(text)
    train, val = charlm.split(vocab.encode(text))      # last 10% for validation
    train_set = charlm.CharDataset(train, context=64)
    net = charlm.build(seed=0, vocab_size=len(vocab))
    big = charlm.build(seed=0, vocab_size=len(vocab), **charlm.SIZES["large"])   # 10.7M parameters
    charlm.validation_loss(net, charlm.CharDataset(val, context=64), batches=8)

``CharDataset`` yields ``(input, target)`` windows of ``context`` characters,
the target shifted by one; ``CharTransformer`` is a minimal pre-norm
causal transformer (learned positional embeddings, no dropout, so training is
deterministic for a seed); ``validation_loss`` is the mean cross-entropy
(nats per character) over a fixed, evenly spread set of windows.
"""

from __future__ import annotations

import glob
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

#: Default text budget in bytes (the sorted standard-library files, concatenated, cut here).
DEFAULT_BYTES = 1 << 20

#: Model sizes by name (``build(..., **SIZES[name])``): "small" is ``build``'s default (0.1M
#: parameters with a vocabulary of about 100), "medium" 3.2M, "large" 10.7M (a model whose
#: exchanges the network feels at internet speeds).
SIZES: dict[str, dict[str, int]] = {
    "small": {"d_model": 64, "heads": 4, "layers": 2},
    "medium": {"d_model": 256, "heads": 4, "layers": 4},
    "large": {"d_model": 384, "heads": 6, "layers": 6},
}


def stdlib_dir() -> str:
    """The directory of the standard library's Python sources."""
    return os.path.dirname(os.__file__)


def load_text(max_bytes: int = DEFAULT_BYTES, directory: Optional[str] = None) -> str:
    """The first ``max_bytes`` ASCII characters of the sorted ``*.py`` files in ``directory``
    (the standard library by default), concatenated; non-ASCII characters are dropped."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(directory or stdlib_dir(), "*.py"))):
        with open(path, "rb") as f:
            chunk = f.read().decode("ascii", errors="ignore")
        parts.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    text = "".join(parts)[:max_bytes]
    if not text:
        raise FileNotFoundError(f"no Python sources found in {directory or stdlib_dir()}")
    return text


class Vocab:
    """The characters of a text, sorted, each mapped to its index."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a 1-D int64 tensor of indices."""
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        """The characters of ``ids``."""
        return "".join(self.chars[int(i)] for i in ids)


def split(ids: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) by position: the last ``val_fraction`` of ``ids`` validates."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    cut = int(len(ids) * (1 - val_fraction))
    return ids[:cut], ids[cut:]


class CharDataset(Dataset):
    """Windows of ``context`` characters starting every ``stride`` positions (default:
    ``context``, so windows do not overlap); item ``i`` is ``(ids[s:s+context],
    ids[s+1:s+context+1])`` with ``s = i * stride``."""

    def __init__(self, ids: torch.Tensor, context: int, stride: Optional[int] = None) -> None:
        self.stride = context if stride is None else stride
        if context < 1 or self.stride < 1:
            raise ValueError(f"context and stride must be positive, got {context!r} and {self.stride!r}")
        if len(ids) < context + 1:
            raise ValueError(f"{len(ids)} characters are too few for one window of {context} plus its target")
        self.ids = ids
        self.context = context

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        s = (i % len(self)) * self.stride
        return self.ids[s : s + self.context], self.ids[s + 1 : s + self.context + 1]


class Block(nn.Module):
    """One pre-norm transformer block: causal multi-head self-attention, then a GELU MLP,
    each added to the residual stream. Every weight is used inside its own module's
    forward (plain ``nn.Linear``), as algorithms that defer updates per module expect."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attend(self.norm1(h))
        return h + self.out(F.gelu(self.fc(self.norm2(h))))


class CharTransformer(nn.Module):
    """Token and learned positional embeddings, ``layers`` causal ``Block``s, a final
    LayerNorm and a linear head giving next-character logits of shape (batch, time, vocab)."""

    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"input of {t} characters is longer than the context of {self.context}")
        h = self.embed(ids) + self.position(torch.arange(t, device=ids.device))
        return self.head(self.norm(self.blocks(h)))


def build(
    seed: int, vocab_size: int, context: int = 64, d_model: int = 64, heads: int = 4, layers: int = 2
) -> CharTransformer:
    """A CharTransformer initialized from ``seed``, so every rank builds the same one."""
    torch.manual_seed(seed)
    return CharTransformer(vocab_size, context, d_model, heads, layers)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy in nats."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, dataset: CharDataset, batches: int = 8, batch_size: int = 64) -> float:
    """Mean cross-entropy over ``batches * batch_size`` windows spread evenly over
    ``dataset`` (the same windows every call); the model's training mode is restored."""
    count = min(len(dataset), batches * batch_size)
    picks = torch.linspace(0, len(dataset) - 1, count).round().long().tolist()
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for start in range(0, count, batch_size):
            items = [dataset[i] for i in picks[start : start + batch_size]]
            x = torch.stack([a for a, _ in items])
            y = torch.stack([b for _, b in items])
            total += loss_fn(model(x), y).item() * len(items)
    finally:
        model.train(was_training)
    return total / count
