"""PowerSGD's factors (``unison.engine.codecs.lowrank``): the blocked products against plain ones."""

import pytest
import torch

from unison.engine.codecs import LowRank, lowrank, orthogonalize


@pytest.mark.parametrize("shapes", [[(48, 64)], [(3, 5), (70, 9), (16, 16)]])
def test_low_rank_products(monkeypatch, shapes):
    monkeypatch.setattr(lowrank, "FINISH_BLOCK", 100)  # several blocks of rows
    g = torch.Generator().manual_seed(len(shapes))
    rank = 2
    mats = [torch.randn(s, generator=g) for s in shapes]
    qs = [torch.randn(m, rank, generator=g) for _, m in shapes]
    low = LowRank(shapes, rank)
    for q, view in zip(qs, low.qs):
        view.copy_(q)
    ours = [m.clone() for m in mats]
    low.compute_p(ours)
    for p, q, mat in zip(low.ps, qs, mats):
        torch.testing.assert_close(p, mat @ q)
    low.orthogonalize_p()
    low.compute_q(ours)
    for p, q, q_local, mat, q0 in zip(low.ps, low.qs, low.qts_local, mats, qs):
        torch.testing.assert_close(p, orthogonalize(mat @ q0))
        torch.testing.assert_close(q, mat.t() @ p)
        assert torch.equal(q_local.t(), q)
    low.q_flat.mul_(2)  # as if another rank's Q's were added
    errors = [torch.empty(s) for s in shapes]
    low.finish(ours, errors)
    for mat, err, p, q, ref in zip(ours, errors, low.ps, low.qs, mats):
        torch.testing.assert_close(err, ref - p @ (q / 2).t())
        torch.testing.assert_close(mat, p @ q.t())
