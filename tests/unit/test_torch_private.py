"""Every private name of torch's that unison reads (unison/runtime/torch_private.py) exists in the installed
torch: when a release drops one, this fails naming the function that reads it and what it is for,
before any training does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unison.runtime import torch_private


def _missing(function: str) -> str:
    doc = getattr(torch_private, function).__doc__ or ""
    return (
        f"torch {torch.__version__} lacks what unison.runtime.torch_private.{function} reads; what it does and its "
        f"public alternative: {' '.join(doc.split())}"
    )


@pytest.mark.parametrize("function", sorted(torch_private.PRIVATES))
def test_each_private_read_exists_in_this_torch(function):
    assert callable(getattr(torch_private, function, None)), f"unison.torch_private has no {function}"
    for owner, name in torch_private.PRIVATES[function]:
        assert hasattr(owner, name), _missing(function)


def test_the_privates_of_live_objects_exist_and_do_what_unison_reads_them_for():
    """The reads on objects (a view, an autograd node, a state dict, an optimizer)."""
    base = torch.zeros(4, 3)
    assert torch_private.view_base(base[1]) is base and torch_private.view_base(base) is None, _missing("view_base")
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    assert isinstance(torch_private.node_sequence_nr(y.grad_fn), int), _missing("node_sequence_nr")
    before = torch_private.sequence_nr()
    (x * 3).sum()
    assert torch_private.sequence_nr() > before, _missing("sequence_nr")
    state = nn.Linear(2, 2).state_dict()
    copy = type(state)(state)
    torch_private.copy_state_metadata(state, copy)
    assert copy._metadata == state._metadata, _missing("copy_state_metadata")
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    with torch_private.step_hooks_held([opt]):
        opt.step()
    opt.step()
    assert steps == [1], _missing("step_hooks_held")
    assert torch_private.tree_leaves({"a": [1, (2, 3)], "b": 4}) == [1, 2, 3, 4], _missing("tree_leaves")
    assert torch_private.tree_map(lambda v: v * 2, [1, {"k": 2}]) == [2, {"k": 4}], _missing("tree_map")
    assert torch_private.is_future(torch.futures.Future()), _missing("is_future")
