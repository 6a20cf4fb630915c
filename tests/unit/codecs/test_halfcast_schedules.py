"""halfcast's two schedules: the same values bit for bit on the CPU (those of ``flat.to(dtype)``),
and the whole schedule's op count, on ``meta``, the same for 4M values as for 64M."""

from __future__ import annotations

import pytest
import torch

from unison.engine.codecs import halfcast

from .ops import ops


@pytest.mark.parametrize("numel", [0, 1, 7, 1000, halfcast.FIRST, halfcast.FIRST + 1, (1 << 18) + 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_schedules_agree(numel, dtype):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-8, 6, numel)
    if numel > 10:
        x[3], x[5], x[7] = float("inf"), float("nan"), 1e30  # overflows fp16
    expected = x.to(dtype)
    for schedule in ("blocked", "whole"):
        flat = x.clone()
        wire = halfcast.to_wire(flat, dtype, schedule)
        assert wire.data_ptr() == flat.data_ptr() and torch.equal(wire.view(torch.int16), expected.view(torch.int16))
        back = halfcast.from_wire(wire, flat, schedule)
        assert back is flat and torch.equal(flat.view(torch.int32), expected.float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_whole_schedule_ops_do_not_grow(dtype):
    def count(numel: int, schedule: str) -> tuple[int, int]:
        flat = torch.empty(numel, device="meta")
        wire = halfcast.to_wire(flat, dtype, schedule)
        return ops(lambda: halfcast.to_wire(flat, dtype, schedule)), ops(
            lambda: halfcast.from_wire(wire, flat, schedule)
        )

    assert count(4 << 20, "whole") == count(64 << 20, "whole")
    assert max(count(4 << 20, "whole")) <= 8
    assert count(64 << 20, "blocked")[0] > count(4 << 20, "blocked")[0]  # the doubling ranges, forced on meta
