"""Where ``unison.engine.offload`` puts the copies it is asked to keep on the host."""

from __future__ import annotations

import torch

from unison.engine import offload
from unison.replica import Replica


def test_a_copy_offloaded_from_a_device_lives_on_the_host_and_one_not_offloaded_stays_beside_its_tensor():
    on_device = torch.empty(3, 4, device="meta")  # a tensor off the host, as a CUDA one is
    host = offload.empty_like(on_device, True)
    assert host.device == offload.HOST and host.shape == on_device.shape and host.dtype == on_device.dtype
    assert offload.empty_like(on_device, False).device.type == "meta"
    values = torch.arange(6.0)
    for flag in (True, False):  # on the host already, offload changes nothing but is a copy
        kept = offload.keep(values, flag)
        assert torch.equal(kept, values) and kept.data_ptr() != values.data_ptr()
        assert offload.empty_like(values, flag).device == values.device


def test_a_replica_without_a_wrapper_keeps_nothing_on_the_host():
    replica = Replica(list(torch.nn.Linear(2, 2).named_parameters()), [], [], None, "t")
    assert not replica.fault_tolerant and not replica.saved_on_host


def test_live_tensor_bytes_counts_a_device_type_without_an_index():
    """``device="cuda"`` counts every GPU's tensors (a tensor's device always has an index: cuda:0);
    the same rule on the host and on meta devices, which torch gives no index."""
    from unison.memory import _on

    assert _on(torch.device("cuda", 0), torch.device("cuda"))
    assert _on(torch.device("cuda", 1), torch.device("cuda"))
    assert _on(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not _on(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not _on(torch.device("cuda", 0), torch.device("cpu"))
    assert _on(torch.device("cpu"), torch.device("cpu"))
