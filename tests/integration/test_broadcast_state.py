"""comm.broadcast_state: a state with its tensors sent raw (the fault-tolerant heal)."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from launch import run

from unison.engine.comm import broadcast_state


def _state() -> dict:
    """Tensors of every size and alignment (3 bools, then a float64 at byte 3 of the buffer),
    a module state dict's _metadata, and things that are not tensors."""
    module = collections.OrderedDict(
        b=torch.tensor([True, False, True]),
        s=torch.tensor(3.5, dtype=torch.float64),
        empty=torch.zeros(0, 3),
        h=torch.arange(5, dtype=torch.bfloat16),
        w=torch.randn(1000, 7, generator=torch.Generator().manual_seed(1)),
        strided=torch.arange(12.0).reshape(3, 4).t(),
    )
    module._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    shared = torch.ones(4)
    return {"module": module, "opt": [{"state": {0: {"m": shared, "n": shared}}, "lr": 0.1}], "step": 7}


def _receive() -> dict:
    state = broadcast_state(_state() if dist.get_rank() == 1 else None, src=1)
    module = state["module"]
    return {
        "equal": all(torch.equal(module[k], v) and module[k].dtype == v.dtype for k, v in _state()["module"].items()),
        "metadata": module._metadata,
        "rest": (state["opt"][0]["lr"], state["step"]),
        "own_memory": module["w"].untyped_storage().nbytes() == module["w"].numel() * 4,
        "writable": module["s"].add_(1).item(),
    }


def test_every_rank_gets_the_source_state_bit_for_bit_with_its_metadata():
    for outcome in run(_receive, 3):
        assert outcome["equal"]
        assert outcome["metadata"] == {"": {"version": 2}}
        assert outcome["rest"] == (0.1, 7)
        assert outcome["own_memory"]  # not a view that keeps the whole payload alive
        assert outcome["writable"] == 4.5


def _receive_in_small_pieces() -> dict:
    import unison.engine.comm as comm

    comm.STAGING_BYTES = 100  # the raw bytes go in pieces of 100 bytes, across every tensor's bounds
    return _receive()


def test_the_state_is_streamed_in_pieces_bit_for_bit():
    for outcome in run(_receive_in_small_pieces, 3):
        assert outcome["equal"] and outcome["own_memory"] and outcome["rest"] == (0.1, 7)
