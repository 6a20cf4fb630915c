"""What a process holds in tensors: the bytes of every storage reachable from Python, each once.

The memory an algorithm costs is the copies of the parameters it keeps (in units
of P, the parameters' bytes). ``live_tensor_bytes`` counts them deterministically,
whatever the allocator does: every tensor the garbage collector tracks, plus the
parameters' gradients and the optimizers' state (which torch creates lazily),
each untyped storage counted once however many views share it (a DTensor as its
local shard). Tensors held only by C++ (a torch DDP reducer's own buckets, a collective in flight) are not seen.

Example::

    before = unison.memory.live_tensor_bytes()
    model = unison.DataParallel(net)
    train(model, steps=12)
    overhead = unison.memory.live_tensor_bytes([net], [optimizer]) - before
"""

from __future__ import annotations

import gc
import resource
from typing import Iterable, Iterator, Optional

import torch

__all__ = ["live_tensor_bytes", "parameter_bytes", "peak_rss_bytes"]


def _tensors(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: some objects warn when asked their __class__
            yield _local(obj)
    for module in modules:
        for p in module.parameters():
            yield _local(p)
            if p.grad is not None:
                yield _local(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients and optimizer states: the wrapper has
    no storage of its own), else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def live_tensor_bytes(
    modules: Iterable[torch.nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    device: Optional[torch.device] = None,
) -> int:
    """Bytes of every tensor storage reachable from Python, each storage counted once.

    Args:
        modules: modules whose parameters' gradients to count as well (``p.grad``
            may have no Python object until it is read).
        optimizers: optimizers whose state to count as well.
        device: count only storages on this device (default: every device);
            "cuda" counts every GPU's, "cuda:1" the second GPU's alone.

    Example::

        >>> net = torch.nn.Linear(1000, 1000)
        >>> live_tensor_bytes([net]) >= 4 * 1000 * 1000
        True
    """
    gc.collect()
    want = None if device is None else torch.device(device)
    seen: dict[tuple[str, int], int] = {}
    for t in _tensors(list(modules), list(optimizers)):
        if t.is_sparse or t.is_meta or (want is not None and not _on(t.device, want)):
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (nested, functional wrappers)
            continue
        if storage.data_ptr() == 0:
            continue
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _on(where: torch.device, want: torch.device) -> bool:
    """Whether ``where`` is ``want``; ``want`` without an index ("cuda") takes any device of its type."""
    return where.type == want.type and (want.index is None or where.index == want.index)


def parameter_bytes(module: torch.nn.Module) -> int:
    """P: the bytes of ``module``'s parameters, the unit algorithms' memory is counted in."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def peak_rss_bytes() -> int:
    """The largest resident set this process has had (VmHWM; ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
