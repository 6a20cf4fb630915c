"""What ``torch.save(model)`` and ``copy.deepcopy(model)`` keep of a ``DataParallel``.

A pickled wrapper keeps its module (without the running algorithm's forward hooks),
its options and its algorithm's configuration; its live parts (the Core, the
process group, the optimizers' hooks) are left out. Restored, it has a Core that
is never started: it runs the module and synchronizes nothing, and says so.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .algorithms.contract import Algorithm
from .core import Core

#: A wrapper's live parts, which pickling leaves out.
LIVE = (
    "_core",
    "_finalizer",
    "_join_hook",
    "process_group",
    "_step_group",
    "_buffer_sync",
    "_reduce_function",
    "_broadcast_function",
    "optimizers",
    "_warned_restored",
)

#: What a restored wrapper says when asked to synchronize.
RESTORED = (
    "this DataParallel was restored from a pickle or a deepcopy, so it has no process group and "
    "synchronizes nothing; wrap it again to train: unison.DataParallel(model.module, ...)."
)


def picklable(
    attributes: dict[str, Any],
    module: nn.Module,
    hooks: Sequence[RemovableHandle],
    algorithm: Algorithm[Any],
    bucket_cap_mb: float,
) -> dict[str, Any]:
    """A wrapper's picklable state from its ``__dict__``: the live parts left out, the module
    without the algorithm's forward ``hooks``, the algorithm kept as its configuration."""
    state = {k: v for k, v in attributes.items() if k not in LIVE}
    if hooks:
        state["_modules"] = {"module": without_hooks(module, hooks)}
    state["_saved_algorithm"] = algorithm
    state["_saved_bucket_cap_mb"] = bucket_cap_mb
    return state


def idle_core(state: dict[str, Any], module: nn.Module, serial: str, broadcast_buffers: bool) -> Core:
    """The Core of a wrapper restored from ``picklable``'s ``state`` (its saved algorithm and
    bucket size taken out of it): never started, so no engine, no hook, no collective."""
    return Core(
        state.pop("_saved_algorithm"),
        list(module.named_parameters()),
        list(module.named_buffers()),
        None,
        serial,
        modules=list(module.modules()),
        broadcast_buffers=broadcast_buffers,
        bucket_cap_mb=state.pop("_saved_bucket_cap_mb"),
    )


def without_hooks(module: nn.Module, handles: Sequence[RemovableHandle]) -> nn.Module:
    """``module``'s tree without the forward hooks of ``handles`` (the algorithm's): each
    submodule a shallow copy, sharing its parameters and buffers, for pickling to take."""
    ours = {(id(h.hooks_dict_ref()), h.id) for h in handles}
    copies: dict[int, nn.Module] = {}

    def clone(m: nn.Module) -> nn.Module:
        if id(m) not in copies:
            c = copy.copy(m)
            copies[id(m)] = c
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = m.__dict__[name]
                c.__dict__[name] = OrderedDict((k, f) for k, f in hooks.items() if (id(hooks), k) not in ours)
            c.__dict__["_modules"] = OrderedDict(
                (k, None if sub is None else clone(sub)) for k, sub in m.__dict__["_modules"].items()
            )
        return copies[id(m)]

    return clone(module)
