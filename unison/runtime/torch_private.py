"""Every reach of unison's into torch's private names, in one place.

torch promises nothing of a name that starts with an underscore: a release may rename or drop it.
unison reads a few where torch has no public way to do what it must; each is one function here,
whose docstring names the public alternative where torch has one (and why it is not used), or
says there is none. ``tests/unit/test_torch_private.py`` fails, naming the function, the day the
installed torch lacks one (``PRIVATES`` lists what each reads). Outside this module unison reads
no private name of torch's (``tests/integration/test_architecture.py`` checks), save the
multi-tensor ops ``torch._foreach_*``, the kernels torch.optim itself runs on.

It imports nothing of unison, and sits in the runtime, the lowest layer: every layer may use it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils import _pytree

#: What each function reads: (object, attribute) pairs that must exist in the installed torch.
PRIVATES: dict[str, list[tuple[Any, str]]] = {
    "tree_map": [(_pytree, "tree_map")],
    "tree_leaves": [(_pytree, "tree_flatten")],
    "at_backward_end": [(Variable, "_execution_engine")],
    "sequence_nr": [(torch._C._autograd, "_get_sequence_nr")],
    "node_sequence_nr": [],  # a grad_fn's method: checked on a live node by the test
    "reset_group_count": [(dist.distributed_c10d, "_world")],
    "set_group_timeout": [(dist.distributed_c10d, "_set_pg_timeout")],
    "default_store": [(dist.distributed_c10d, "_get_default_store")],
    "view_base": [],  # a tensor's attribute: checked on a live view by the test
    "is_future": [(torch._C, "Future")],
    "copy_state_metadata": [],  # what nn.Module.state_dict sets: checked on a live state dict by the test
    "root_mesh": [],  # a DeviceMesh's method: checked on a live mesh by the test
    "step_hooks_held": [],  # an optimizer's attributes: checked on a live optimizer by the test
    "unregister_group": [(dist.distributed_c10d, "_world"), (dist.distributed_c10d, "_unregister_process_group")],
    "register_group": [(torch._C._distributed_c10d, "_register_process_group")],
}


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of a nest of lists, tuples and dicts (and what torch registers).
    Public alternative: none in torch (``torch.utils._pytree``); ``torch.utils.pytree`` is not
    there in every release this runs on."""
    return _pytree.tree_map(fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nest of lists, tuples and dicts, in order (``torch.utils._pytree``)."""
    return _pytree.tree_flatten(tree)[0]


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass running now has ended, as torch DDP does
    (``Variable._execution_engine.queue_callback``). Public alternative:
    ``torch.autograd.graph.register_multi_grad_hook(..., mode="all")`` fires when every listed
    gradient is computed, never for a parameter unused in this pass: no equivalent."""
    Variable._execution_engine.queue_callback(fn)


def sequence_nr() -> int:
    """The next autograd node's sequence number (the order of a forward's ops, which nonblocking
    checks). Public alternative: none."""
    return int(torch._C._autograd._get_sequence_nr())


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (``grad_fn._sequence_nr()``). Public alternative: none."""
    return int(node._sequence_nr())


def reset_group_count() -> None:
    """Reset the count that names unnamed process groups, after a failed
    ``init_process_group`` (torch resets it only when it destroys the default group, which a
    failed build never made). Public alternative: none."""
    dist.distributed_c10d._world.group_count = 0


def set_group_timeout(group: Any, timeout: datetime.timedelta) -> bool:
    """Give ``group`` the timeout of its collectives after it was built with a shorter one (its
    rendezvous). False where this torch cannot (the group keeps its build timeout). Public
    alternative: none; building it with the longer timeout makes a dead peer's rendezvous slow."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return False
    set_timeout(timeout, group)
    return True


def default_store() -> dist.Store:
    """The store of the default process group (``_get_default_store``). Public alternative:
    keep the store one built the group with, which a group a user built leaves unknown."""
    return dist.distributed_c10d._get_default_store()


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``t`` is a view of, or None (``Tensor._base``). Public alternative:
    ``untyped_storage().data_ptr()`` says which storage, not which tensor."""
    return t._base


def is_future(obj: Any) -> bool:
    """Whether ``obj`` is a torch Future (``torch.futures.Future`` or a Work's ``get_future()``:
    both ``torch._C.Future``). Public alternative: ``isinstance(obj, torch.futures.Future)``
    misses a Work's future, which torch DDP's hooks may return."""
    return isinstance(obj, torch._C.Future)


def copy_state_metadata(source: Any, copy: Any) -> None:
    """Carry a module state dict's ``_metadata`` (the versions ``load_state_dict`` reads) over to
    its copy. Public alternative: none (``state_dict`` sets the attribute on its OrderedDict)."""
    if hasattr(source, "_metadata"):
        copy._metadata = source._metadata


def root_mesh(mesh: Any) -> Any:
    """The DeviceMesh ``mesh`` is a dimension of (itself when it is one). Public alternative:
    none; comparing the ``mesh`` tensors tells equal layouts, not one mesh."""
    return mesh._get_root_mesh()


@contextlib.contextmanager
def step_hooks_held(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Hold off the optimizers' step hooks for a while (``_optimizer_step_pre_hooks``,
    ``_optimizer_step_post_hooks``). Public alternative: removing each hook by its handle, which
    only its registrar holds."""
    held = [(opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks) for opt in optimizers]
    for opt in optimizers:
        opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for opt, (pre, post) in zip(optimizers, held):
            opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks = pre, post


#: The registries of ``torch.distributed``'s world that hold a group by its object.
_REGISTRIES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")


def unregister_group(group: Any) -> dict[str, Any]:
    """Take ``group`` out of torch.distributed's registries (so that destroying the default group
    leaves it alone); returns what ``register_group`` puts back. Public alternative: none."""
    c10d = dist.distributed_c10d
    world = c10d._world
    saved = {}
    for registry in _REGISTRIES:
        held = getattr(world, registry)
        if group in held:
            saved[registry] = held.pop(group)
    tag = saved.get("pg_to_tag")
    for key in (tag, ""):
        if key is not None and group in world.tags_to_pg.get(key, []):
            world.tags_to_pg[key].remove(group)
    c10d._unregister_process_group(group.group_name)
    return saved


def register_group(group: Any, saved: dict[str, Any], ranks: dict[int, int]) -> None:
    """Put ``group`` back into torch.distributed's registries (``saved``: ``unregister_group``'s),
    its members' global ranks now ``ranks`` (global -> its own). Public alternative: none."""
    world = dist.distributed_c10d._world
    saved = {**saved, "pg_group_ranks": ranks}
    for registry, value in saved.items():
        getattr(world, registry)[group] = value
    tag = saved.get("pg_to_tag")
    if tag is not None:
        world.tags_to_pg.setdefault(tag, []).append(group)
        if tag.startswith("ptd:"):
            world.tags_to_pg.setdefault("", []).append(group)
    torch._C._distributed_c10d._register_process_group(group.group_name, group)
