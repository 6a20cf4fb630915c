"""Every algorithm refuses bad options at construction with a ValueError saying what is allowed."""

import math

import pytest

import unison
from unison.algorithms import create, get, names


def bad_values(default):
    """Values no option with this default accepts (0 is a legal warm-up length, so it is not here)."""
    if isinstance(default, bool):
        return [1, "yes", None]
    if isinstance(default, int):
        return [-1, 1.5, "x", True, None]
    if isinstance(default, float):
        return [-1.0, "x", True, None, math.nan]
    if isinstance(default, str):
        return ["no-such-choice", 3, None]
    return []


CASES = [(n, k, v) for n in names() for k, d in get(n).defaults.items() for v in bad_values(d)]


@pytest.mark.parametrize("name,option,value", CASES, ids=[f"{n}.{k}={v!r}" for n, k, v in CASES])
def test_bad_option_value_is_refused(name, option, value):
    with pytest.raises(ValueError, match=option):
        create(name, **{option: value})


@pytest.mark.parametrize("name", names())
def test_unknown_option_lists_the_allowed_ones(name):
    with pytest.raises(ValueError, match="allowed options"):
        create(name, no_such_option=1)


def test_unknown_algorithm_lists_the_names():
    with pytest.raises(ValueError, match="allreduce"):
        create("allreduse")


@pytest.mark.parametrize(
    "text",
    [
        "powersgd:rank=0",
        "local_sgd:period=0",
        "decentralized:communication_interval=-2",
        "diloco:inner_steps=0",
        "async:sync_interval_ms=0",
    ],
)
def test_non_positive_periods_and_ranks_are_refused(text):
    option = text.split(":")[1].split("=")[0]
    with pytest.raises(ValueError, match=f"^{option} must be"):
        create(text)


def test_bad_dataparallel_settings_are_refused():
    import torch

    for kwargs, match in [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"bucket_cap_mb": "25"}, "bucket_cap_mb"),
        ({"nonfinite": "nan"}, "nonfinite"),
    ]:
        with pytest.raises(ValueError, match=match):
            unison.DataParallel(torch.nn.Linear(2, 2), **kwargs)


def test_options_written_in_the_name():
    algorithm = create("decentralized:peer_selection=ring,communication_interval=4")
    assert algorithm.options == {
        "peer_selection": "ring",
        "communication_interval": 4,
        "fragments": None,
        "delay": None,
        "hierarchical": False,
    }
    assert create("powersgd:rank=2", start_iter=0).options["rank"] == 2
    with pytest.raises(ValueError, match="key=value"):
        create("powersgd:rank")
