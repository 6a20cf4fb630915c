"""The character-level transformer workload: its text, its windows, a model that
learns, and a 2-rank run through DataParallel that keeps the replicas identical."""

from __future__ import annotations

import math

import launch
import pytest
import torch
import torch.distributed as dist
from scenarios import spread_across_ranks

import unison
from unison.apps.workloads import charlm

CONTEXT = 32
TEXT_BYTES = 200_000


@pytest.fixture(scope="module")
def text():
    return charlm.load_text(TEXT_BYTES)


def test_text_is_real_python_and_deterministic(text):
    assert len(text) == TEXT_BYTES
    assert text.isascii()
    assert "def " in text and "import " in text
    assert charlm.load_text(TEXT_BYTES) == text
    assert charlm.load_text(1000) == text[:1000]


def test_vocab_round_trips_and_split_is_by_position(text):
    vocab = charlm.Vocab(text)
    assert 60 <= len(vocab) <= 128
    ids = vocab.encode(text)
    assert vocab.decode(ids[:500]) == text[:500]
    train, val = charlm.split(ids, 0.1)
    assert len(val) == len(ids) - int(len(ids) * 0.9)
    assert torch.equal(torch.cat([train, val]), ids)
    with pytest.raises(ValueError, match="val_fraction"):
        charlm.split(ids, 1.5)


def test_windows_are_shifted_by_one():
    ids = torch.arange(100)
    ds = charlm.CharDataset(ids, context=10)
    assert len(ds) == 9  # starts 0, 10, ..., 80: each needs 11 characters
    for i in (0, 4, len(ds) - 1):
        x, y = ds[i]
        assert torch.equal(x, ids[10 * i : 10 * i + 10])
        assert torch.equal(y, ids[10 * i + 1 : 10 * i + 11])
    overlapping = charlm.CharDataset(ids, context=10, stride=3)
    assert torch.equal(overlapping[2][0], ids[6:16])
    assert len(overlapping) == 30  # last start 87: 87 + 10 < 100
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="too few"):
        charlm.CharDataset(ids[:5], context=10)


def test_model_is_seeded_causal_and_learns(text):
    vocab = charlm.Vocab(text)
    train, val = charlm.split(vocab.encode(text))
    data, val_set = charlm.CharDataset(train, CONTEXT), charlm.CharDataset(val, CONTEXT)
    net = charlm.build(0, len(vocab), context=CONTEXT)
    assert all(
        torch.equal(p, q) for p, q in zip(net.parameters(), charlm.build(0, len(vocab), context=CONTEXT).parameters())
    )

    x, _ = data[0]
    x = x.unsqueeze(0)
    changed = x.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % len(vocab)
    with torch.no_grad():
        a, b = net(x), net(changed)
    assert torch.equal(a[0, :20], b[0, :20])  # positions before 20 do not see the change
    assert not torch.allclose(a[0, 20:], b[0, 20:])

    before = charlm.validation_loss(net, val_set, batches=2, batch_size=32)
    assert abs(before - math.log(len(vocab))) < 1.0  # near uniform at initialization
    assert charlm.validation_loss(net, val_set, batches=2, batch_size=32) == before
    assert net.training

    torch.manual_seed(0)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    losses = []
    for _, (xb, yb) in zip(range(20), loader):
        opt.zero_grad()
        loss = charlm.loss_fn(net(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8, losses
    assert charlm.validation_loss(net, val_set, batches=2, batch_size=32) < before - 0.8


def two_rank_allreduce(steps: int) -> dict:
    text = charlm.load_text(TEXT_BYTES)
    vocab = charlm.Vocab(text)
    train, _ = charlm.split(vocab.encode(text))
    net = charlm.build(0, len(vocab), context=CONTEXT)
    if dist.get_rank() == 1:
        with torch.no_grad():
            net.head.bias.add_(1.0)  # DataParallel must broadcast rank 0's weights
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    model = unison.DataParallel(net, optimizer=opt, algorithm="allreduce")
    loader = unison.sharded_loader(charlm.CharDataset(train, CONTEXT), batch_size=8, drop_last=True)
    loader.sampler.set_epoch(0)
    losses, spreads = [], []
    for _, (x, y) in zip(range(steps), loader):
        opt.zero_grad()
        loss = charlm.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        spreads.append(spread_across_ranks(net))
    return {"losses": losses, "spreads": spreads, "first_batch": next(iter(loader))[0][0].tolist()}


def test_two_ranks_allreduce_keeps_replicas_identical():
    results = launch.run(two_rank_allreduce, 2, 10, timeout=60)
    for r in results:
        assert len(r["losses"]) == 10
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["spreads"] == [0.0] * 10
    assert results[0]["first_batch"] != results[1]["first_batch"]  # each rank trains on its own shard
    assert results[0]["losses"] != results[1]["losses"]
