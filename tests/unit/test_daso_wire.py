"""DASO's ``Wire``: a sync's message made in pieces, cut across tensors, carrying exactly what one
flat buffer carried (``x - anchor`` cast, added back to the anchor), slice for slice."""

from __future__ import annotations

import torch

from unison.algorithms.averaging.daso import Wire


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (3,), (11, 4), (1,), (6, 6)]
    out = [torch.randn(s, generator=g) for s in shapes]
    out.append(torch.randn(4, 3, generator=g).t())  # not contiguous
    return out


def test_pieces_cut_across_tensors_and_carry_the_cast_difference():
    x, anchor = tensors(), [t.clone().contiguous() * 0.5 for t in tensors()]
    wire = Wire(x, torch.bfloat16, piece_elems=16)
    total = sum(t.numel() for t in x)
    assert [p.numel() for p in wire.pieces] == [16] * (total // 16) + ([total % 16] if total % 16 else [])
    wire.load(x, anchor)
    flat = torch.cat([p for p in wire.pieces])
    expected = torch.cat([(a - b).reshape(-1) for a, b in zip(x, anchor)]).to(torch.bfloat16)
    assert torch.equal(flat, expected)
    sent = wire.tensors(x)
    assert all(s.shape == t.shape and s.dtype == t.dtype for s, t in zip(sent, x))
    assert all(torch.equal(s, (a - b).to(torch.bfloat16).float()) for s, a, b in zip(sent, x, anchor))


def test_add_to_adds_the_pieces_in_full_precision():
    x, anchor = tensors(), [torch.zeros(t.shape) for t in tensors()]
    wire = Wire(x, torch.bfloat16, piece_elems=5)
    wire.load(x, anchor)
    before = [a.clone() for a in anchor]
    wire.add_to(anchor)
    for a, b, t in zip(anchor, before, x):
        assert torch.equal(a, b + t.to(torch.bfloat16).float())
