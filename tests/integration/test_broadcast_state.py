"""comm.share_state: a state with its tensors sent raw, the fault-tolerant heal (point to point,
only to the ranks behind, in shards from several sources)."""

from __future__ import annotations

import collections
import os
import resource
import socket
import struct
import time

import torch
import torch.distributed as dist
from launch import run

from unison.engine import comm
from unison.engine.comm import share_state


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
    state = share_state(_state() if dist.get_rank() == 1 else None, sources=[1], receivers=[0, 2])
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


# ---- share_state: sources 0 and 2 (the same state), receivers 1 and 3, rank 4 not behind -----------
SOURCES, RECEIVERS, BYSTANDER = [0, 2], [1, 3], 4
BIG_MB = 32


def _io() -> dict[str, int]:
    """Bytes this process's TCP sockets (gloo's) have received and had acknowledged so far, from
    each one's TCP_INFO (tcpi_bytes_received, tcpi_bytes_acked)."""
    totals = {"read": 0, "written": 0}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
        except OSError:
            continue
        if len(info) >= 136:
            acked, received = struct.unpack_from("QQ", info, 120)
            totals["read"] += received
            totals["written"] += acked
    return totals


def _big_state(fill: float = 1.0, floats: int = BIG_MB * 2**18) -> dict:
    state = _state()
    state["module"]["big"] = torch.full((floats,), fill)  # BIG_MB MiB of float32 by default
    return state


def _share(pieces: int = 0, into: bool = False, fill_by_rank: bool = False) -> dict:
    """Every rank calls share_state with its part; returns what it got, the bytes it read and wrote
    meanwhile, and its peak memory's growth in MB."""
    floats = BIG_MB * 2**18
    if pieces:
        comm.STAGING_BYTES, comm.DIRECT_BYTES = pieces, 64  # small pieces across every tensor's bounds
        floats = 1000
    rank = dist.get_rank()
    source = rank in SOURCES
    state = _big_state(float(rank) if fill_by_rank else 1.0, floats) if source else None
    names = {id(t): k for k, t in state["module"].items()} if source else None
    own = {"big": torch.zeros(BIG_MB * 2**18), "w": torch.zeros(1000, 7)} if into and rank in RECEIVERS else None
    own_ptrs = {k: t.data_ptr() for k, t in (own or {}).items()}
    dist.barrier()
    peak, io = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, _io()
    out = share_state(state, SOURCES, RECEIVERS, names=names, into=own)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    dist.barrier()  # every receiver has read its part: what a source wrote is acknowledged by now
    time.sleep(0.2)  # past a delayed acknowledgement (40 ms)
    after = _io()
    result = {"read": after["read"] - io["read"], "written": after["written"] - io["written"], "grown_mb": grown}
    if rank in RECEIVERS:
        module, expected = out["module"], _big_state(1.0, floats)["module"]
        result["equal"] = all(
            torch.equal(module[k], v) and module[k].dtype == v.dtype for k, v in expected.items() if k != "big"
        )
        result["big_values"] = sorted(set(module["big"].tolist()))
        result["metadata"] = module._metadata
        result["rest"] = (out["opt"][0]["lr"], out["step"])
        result["in_place"] = {k: module[k].data_ptr() == p for k, p in own_ptrs.items()}
    return result


def test_share_state_sends_only_to_the_ranks_behind_bit_for_bit():
    outcomes = run(_share, 5)
    payload = BIG_MB * 2**20
    for r in RECEIVERS:
        assert outcomes[r]["equal"] and outcomes[r]["big_values"] == [1.0]
        assert outcomes[r]["metadata"] == {"": {"version": 2}} and outcomes[r]["rest"] == (0.1, 7)
        assert outcomes[r]["read"] >= payload
    # A member not behind receives nothing (a few bytes of gloo's own at most), and sends nothing.
    assert outcomes[BYSTANDER]["read"] < 64 * 1024 and outcomes[BYSTANDER]["written"] < 64 * 1024
    # Each source sends about half the payload to each receiver.
    for s in SOURCES:
        assert 0.8 * payload <= outcomes[s]["written"] <= 1.2 * payload, outcomes[s]


def test_share_state_in_shards_from_every_source_streamed_in_small_pieces():
    """Sources holding different values under the same layout show whose pieces a receiver got:
    both sources' (interleaved pieces of 100 bytes), and every other tensor bit for bit."""
    outcomes = run(_share, 5, 100, False, True)
    for r in RECEIVERS:
        assert outcomes[r]["big_values"] == [0.0, 2.0]  # the values of source 0 and of source 2
        assert outcomes[r]["equal"] and outcomes[r]["rest"] == (0.1, 7)


def test_share_state_holds_no_buffer_of_the_whole_state_and_fills_into_in_place():
    """A receiver with ``into`` gets its own tensors filled (the big one in pieces straight into its
    memory); no side grows by anything near the 32 MiB state (a few pieces in flight at most)."""
    outcomes = run(_share, 5, 0, True)
    for r in RECEIVERS:
        assert outcomes[r]["in_place"] == {"big": True, "w": True} and outcomes[r]["big_values"] == [1.0]
        assert outcomes[r]["equal"]
    for r in SOURCES + RECEIVERS:
        assert outcomes[r]["grown_mb"] < BIG_MB / 3, outcomes[r]
