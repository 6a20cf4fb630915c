"""DASO's ``Wire``: a sync's message made in pieces, cut across tensors, carrying exactly what one
flat buffer carried (``x - anchor`` cast, added back to the anchor), slice for slice."""

from __future__ import annotations

import pytest
import torch

from unison.algorithms.averaging.daso import Wire

from .codecs.ops import OpCounter, ops


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


# ---- the two schedules ------------------------------------------------------

WIRES = [torch.bfloat16, torch.float16, torch.float32]


def lists() -> dict[str, list[torch.Tensor]]:
    """Tensor lists: one kind, several kinds (dtypes) interleaved, empty tensors, none at all."""
    g = torch.Generator().manual_seed(1)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(dtype)

    return {
        "one kind": tensors(),
        "kinds": [
            r(7, 5),
            r(9, dtype=torch.bfloat16),
            r(3, 4, dtype=torch.float16),
            r(13),
            r(2, 8, dtype=torch.bfloat16),
        ],
        "doubles": [r(6, 3, dtype=torch.float64), r(11)],
        "empties": [r(0), r(8), r(0, 3, dtype=torch.float16), r(4, 0), r(5, dtype=torch.bfloat16)],
        "none": [],
    }


@pytest.mark.parametrize("piece_elems", [5, 1000])
@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("name", list(lists()))
def test_both_schedules_send_and_add_the_same_bits(name, wire, piece_elems):
    x = lists()[name]
    anchor = [(t * 0.25 + 0.125).contiguous() for t in x]
    runs = {}
    for schedule in ("blocked", "whole"):
        w = Wire(x, wire, piece_elems, schedule=schedule)
        assert w.schedule == schedule
        w.load(x, anchor)
        sent = [p.clone() for p in w.pieces]
        for p in w.pieces:
            p.div_(3)  # what the collective does to them
        targets = [a.clone() for a in anchor]
        w.add_to(targets)
        runs[schedule] = sent, targets, w.tensors(x)
    (sent, targets, saved), (sent2, targets2, saved2) = runs["blocked"], runs["whole"]
    assert [(p.numel(), p.dtype) for p in sent] == [(p.numel(), p.dtype) for p in sent2]
    assert all(p.dtype == wire and p.numel() <= piece_elems for p in sent)
    assert all(torch.equal(a, b) for a, b in zip(sent, sent2))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(targets, targets2))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(saved, saved2))
    if name == "one kind" and piece_elems == 5:
        assert len(sent) > len(x)  # tensors span pieces


def test_the_schedule_follows_the_device_unless_forced(monkeypatch):
    monkeypatch.delenv("UNISON_CODEC_SCHEDULE", raising=False)
    assert Wire([torch.zeros(3)], torch.bfloat16, 4).schedule == "blocked"
    assert Wire([torch.zeros(3, device="meta")], torch.bfloat16, 4).schedule == "whole"
    assert Wire([torch.zeros(3)], torch.bfloat16, 4, schedule="whole").schedule == "whole"
    monkeypatch.setenv("UNISON_CODEC_SCHEDULE", "whole")
    assert Wire([torch.zeros(3)], torch.bfloat16, 4).schedule == "whole"


def counts(total: int, schedule: str, wire: torch.dtype) -> tuple[int, int]:
    """The ops ``load`` and ``add_to`` issue on ``meta`` for 12 tensors of ``total`` values in all,
    in two kinds (float32, bfloat16), in pieces of 1M values."""
    n = total // 12
    kinds = [torch.float32, torch.bfloat16]
    x = [torch.empty(n, dtype=kinds[i % 2], device="meta") for i in range(12)]
    anchor = [torch.empty_like(t) for t in x]
    w = Wire(x, wire, piece_elems=1 << 20, schedule=schedule)
    return ops(lambda: w.load(x, anchor)), ops(lambda: w.add_to(anchor))


@pytest.mark.parametrize("wire", WIRES, ids=str)
def test_whole_issues_as_many_ops_for_64m_values_as_for_4m(wire):
    """Whole: load 16 ops, add_to 29 (bf16), 38 (fp16), 37 (fp32) at 4M and 64M; blocked: load 122
    then 542, add_to 82 then 382."""
    small, large = counts(4 << 20, "whole", wire), counts(64 << 20, "whole", wire)
    assert small == large
    assert counts(64 << 20, "blocked", wire) > large  # the loops grow with the size (the old code)
    assert counts(64 << 20, "blocked", wire) > counts(4 << 20, "blocked", wire)


def test_whole_grows_with_the_number_of_tensors_only_through_views():
    def kernels(n: int) -> dict[str, int]:
        x = [torch.empty(1000, dtype=[torch.float32, torch.bfloat16][i % 2], device="meta") for i in range(n)]
        w, names = Wire(x, torch.float16, piece_elems=1 << 20, schedule="whole"), {}
        for fn in (lambda: w.load(x, x), lambda: w.add_to(x)):
            with OpCounter() as counter:
                fn()
            for name, k in counter.names.items():
                if name not in ("view", "slice"):
                    names[name] = names.get(name, 0) + k
        return names

    assert kernels(4) == kernels(64)
