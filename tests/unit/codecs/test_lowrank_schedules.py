"""PowerSGD's factors in their two schedules (``unison.engine.codecs.lowrank``): the same values on
the CPU to a stated tolerance, and on ``meta`` the whole schedule's ops (one batched product or QR
per group of same-shape matrices) the same for 4M values as for 64M, at most 64 a step."""

from __future__ import annotations

import pytest
import torch

from unison.engine.codecs import LowRank, lowrank, orthogonalize

from .ops import ops

SCHEDULES = ("blocked", "whole")
#: The whole schedule's ``bmm``/``baddbmm`` and the blocked schedule's ``mm``/``addmm`` (on blocks of
#: rows) are different kernels: a float32 sum of up to 64 products may be taken in another order,
#: a few units in the last place of values of order 10 (and QR of such inputs differs as little:
#: the matrices here are well conditioned). Held to 1e-5 relative and absolute.
TOL = {"rtol": 1e-5, "atol": 1e-5}
#: Several shapes, some repeated (a group of 2 and of 3), n < r (1 x 1, 1 x 7), non-square.
SHAPES = [(48, 64), (3, 5), (48, 64), (1, 1), (70, 9), (3, 5), (1, 7), (3, 5)]
RANK = 2
SIZES = (1 << 22, 1 << 26)
MOST = 64
META = torch.device("meta")


def matrices(shapes, device=None, one_buffer=True, seed=0):
    """Matrices of ``shapes``: views of one flat buffer, one after the other (as a bucket's), or tensors of their own."""
    sizes = [n * m for n, m in shapes]
    if device is not None:
        flat = torch.empty(sum(sizes), device=device)
    else:
        flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed))
    views = [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
    return views if one_buffer else [v.clone() for v in views]


def step(shapes, schedule, mats, q0, residuals=True):
    """One step of power iteration: P, P orthogonalized, Q, then the residuals and the approximation
    (the Q's doubled, as if another rank's were added)."""
    low = LowRank(shapes, RANK, schedule=schedule)
    assert low.schedule == schedule
    for q, view in zip(q0, low.qs):
        view.copy_(q)
    low.compute_p(mats)
    p = [t.clone() for t in low.ps]
    low.orthogonalize_p()
    p_orthogonal = [t.clone() for t in low.ps]
    low.compute_q(mats)
    q = [t.clone() for t in low.qs]
    assert torch.equal(low.q_local, low.q_flat)
    low.q_flat.mul_(2)
    errors = matrices(shapes, one_buffer=False, seed=7) if residuals else None
    low.finish(mats, errors)
    return p, p_orthogonal, q, mats, errors


@pytest.mark.parametrize("one_buffer", [True, False], ids=["views", "tensors"])
@pytest.mark.parametrize("residuals", [True, False])
def test_both_schedules_agree(monkeypatch, one_buffer, residuals):
    """Matrices that are views of one buffer (batched as one strided view) or tensors of their own
    (stacked, written back in one op); P, its QR, Q, the residuals and the approximation."""
    monkeypatch.setattr(lowrank, "FINISH_BLOCK", 100)  # several blocks of rows
    mats = matrices(SHAPES, one_buffer=one_buffer)
    reference = [m.clone() for m in mats]
    g = torch.Generator().manual_seed(1)
    q0 = [torch.randn(m, RANK, generator=g) for _, m in SHAPES]
    blocked, whole = (
        step(SHAPES, s, [m.clone() for m in mats] if s == "blocked" else mats, q0, residuals) for s in SCHEDULES
    )
    for b, w in zip(blocked, whole):
        if b is None:
            assert w is None
            continue
        for x, y in zip(b, w):
            torch.testing.assert_close(y, x, **TOL)
    p, p_orthogonal, q, approximation, errors = whole
    for k, (mat, q_start) in enumerate(zip(reference, q0)):
        torch.testing.assert_close(p[k], mat @ q_start, **TOL)
        if mat.shape[0] >= RANK:
            torch.testing.assert_close(p_orthogonal[k], orthogonalize(mat @ q_start), **TOL)
        torch.testing.assert_close(q[k], mat.t() @ p_orthogonal[k], **TOL)
        torch.testing.assert_close(approximation[k], 2 * p_orthogonal[k] @ q[k].t(), **TOL)
        if errors is not None:
            torch.testing.assert_close(errors[k], mat - p_orthogonal[k] @ q[k].t(), **TOL)


def test_a_groups_factors_lie_together_and_each_matrix_keeps_its_own():
    """The factors lie group after group (the wire's order, the same on every rank), each
    ``ps[k]``/``qs[k]`` still the k-th matrix's."""
    low = LowRank([(4, 6), (5, 3), (4, 6)], RANK)
    assert low.groups == [[0, 2], [1]]
    assert [t.storage_offset() for t in low.pts] == [0, 2 * RANK * 4 + 0, RANK * 4]
    assert [t.shape for t in low.ps] == [(4, RANK), (5, RANK), (4, RANK)]
    assert [t.shape for t in low.pt_groups] == [(2, RANK, 4), (1, RANK, 5)]


def test_matrices_of_one_buffer_are_batched_without_a_copy():
    flat = torch.arange(30.0)
    a, _, b = flat[:6].view(2, 3), flat[6:15], flat[15:21].view(2, 3)
    found = lowrank.view_of([a, b])
    assert found is not None and found.shape == (2, 2, 3) and found.data_ptr() == a.data_ptr()
    assert torch.equal(found, torch.stack([a, b]))
    assert lowrank.view_of([a, b.clone()]) is None  # another buffer
    assert lowrank.view_of([b, a]) is None  # backwards
    assert lowrank.view_of([a, flat[3:9].view(2, 3)]) is None  # overlapping


# ---- op counts on meta: the whole schedule's are the same for 4M values as for 64M


def scaled(numel: int) -> list[tuple[int, int]]:
    """Four matrices of two shapes (square, and half as tall, twice as wide), ``numel`` values in all."""
    side = int((numel // 4) ** 0.5)
    return [(side, side), (side // 2, 2 * side)] * 2


def method_ops(numel: int, method: str, schedule=None, one_buffer=True) -> int:
    shapes = scaled(numel)
    low = LowRank(shapes, RANK, device=META, schedule=schedule)
    mats = matrices(shapes, META, one_buffer)
    errors = matrices(shapes, META, one_buffer)
    calls = {
        "compute_p": lambda: low.compute_p(mats),
        "orthogonalize_p": low.orthogonalize_p,
        "compute_q": lambda: low.compute_q(mats),
        "finish": lambda: low.finish(mats, errors),
    }
    return ops(calls[method])


@pytest.mark.parametrize("one_buffer", [True, False], ids=["views", "tensors"])
@pytest.mark.parametrize("method", ["compute_p", "orthogonalize_p", "compute_q", "finish"])
def test_the_whole_schedule_issues_as_many_ops_for_64m_values_as_for_4m(method, one_buffer):
    found = [method_ops(n, method, one_buffer=one_buffer) for n in SIZES]
    assert found[0] == found[1] and found[0] <= MOST, found


def test_the_blocked_schedule_forced_on_meta_grows_with_the_values():
    """The proof the count above would catch ``finish``'s loop over blocks of rows (the CPU's)."""
    found = [method_ops(n, "finish", "blocked") for n in SIZES]
    assert found[1] > 3 * found[0], found
