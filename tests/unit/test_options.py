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


def test_the_seeds_names_for_options_are_one_table_of_real_options():
    from unison.compat.aliases import ALIASES

    for name, table in ALIASES.items():
        for option, aliases in table.items():
            assert option in get(name).defaults, (name, option)
            assert not set(aliases) & set(get(name).defaults), (name, aliases)
    assert create("diloco", inner_steps=8).period == 8
    assert create("daso", downcast_type="fp16").options["downcast_type"] == "fp16"
    with pytest.raises(ValueError, match=r"allowed options: peer_selection, period \(alias communication_interval\)"):
        create("decentralized", interval=2)


def test_an_option_given_under_two_names_is_refused():
    with pytest.raises(ValueError, match="option 'period' of 'local_sgd' was given twice"):
        create("local_sgd:period=4", communication_interval=4)


def test_a_bad_value_is_named_as_given():
    with pytest.raises(ValueError, match=r"^communication_interval must be a positive integer, got 0 \(period and"):
        create("local_sgd", communication_interval=0)


def test_the_class_checks_its_options_as_create_does():
    from unison.algorithms.gradient.powersgd import PowerSGD

    assert PowerSGD(rank=2).describe() == create("powersgd", rank=2).describe()
    with pytest.raises(ValueError, match=r"^rank must be a positive integer, got 0$"):
        PowerSGD(rank=0)
    with pytest.raises(TypeError, match="rnak"):
        PowerSGD(rnak=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        PowerSGD(2)  # type: ignore[misc]  # keyword-only


def test_describe_names_every_option_sorted():
    assert create("powersgd", rank=2).describe() == (
        "powersgd(hierarchical=False, min_compression_rate=2.0, rank=2, start_iter=10, warm_start=True)"
    )
    assert repr(create("local_sgd:communication_interval=4")) == (
        "local_sgd(delay=None, fragments=None, hierarchical=False, local_period=2, period=4, warmup_steps=0)"
    )


def test_an_algorithm_pickles_with_its_options_and_their_names():
    import pickle

    algorithm = pickle.loads(pickle.dumps(create("decentralized", communication_interval=3, fragments=1)))
    assert algorithm.period == 3 and algorithm.options["communication_interval"] == 3
    assert algorithm.describe() == create("decentralized", period=3, fragments=1).describe()


def test_a_converted_option_keeps_the_value_given():
    import torch

    diloco = create("diloco", wire_dtype="bf16")
    assert (diloco.wire_dtype, diloco.wire) == ("bf16", torch.bfloat16) and "wire_dtype='bf16'" in diloco.describe()
    assert create("diloco").wire is None and create("diloco", wire_dtype="int8").wire == "int8"
    assert create("daso").wire == torch.bfloat16
    assert create("daso", downcast_type=torch.float16).wire == torch.float16
    assert create("daso", wire_dtype="fp32").wire is None


def test_nonblocking_has_no_autotune():
    assert "autotune" in get("allreduce").defaults and "autotune" not in get("nonblocking").defaults
    with pytest.raises(ValueError, match="has no option 'autotune'"):
        create("nonblocking", autotune=True)


def test_a_registered_algorithm_takes_its_options_by_name_and_in_text(monkeypatch):
    from unison import algorithms
    from unison.algorithms import Algorithm, options, register

    monkeypatch.setattr(algorithms, "_REGISTERED", dict(algorithms._REGISTERED))  # forgotten after the test

    @register
    class Scaled(Algorithm[None]):
        name = "test_scaled"
        factor: float = 0.5

        def __post_init__(self) -> None:
            options.number("factor", self.factor)
            super().__post_init__()

    assert create("test_scaled:factor=0.25").factor == 0.25
    assert Scaled.defaults == {"factor": 0.5} and list(Scaled.options_declared) == ["factor"]
    with pytest.raises(ValueError, match="^factor must be a positive number, got -1$"):
        create("test_scaled", factor=-1)
    with pytest.raises(ValueError, match="allowed options: factor$"):
        create("test_scaled", scale=2)


def test_options_declared_the_earlier_way_still_work_with_a_deprecation_warning():
    """``period = options.Int(16)`` (the API before typed fields) keeps its checks, aliases and validate()."""
    from unison.algorithms import Algorithm
    from unison.algorithms.options import Bool, Int

    with pytest.warns(DeprecationWarning, match=r"period: int = \.\.\."):

        class EarlierWay(Algorithm[None]):
            name = "earlier_way"
            period = Int(4, aliases=("interval",))
            flag = Bool(False)

            def validate(self) -> None:
                if self.flag and self.period > 10:
                    raise ValueError("flag needs a period of at most 10")

    assert EarlierWay().describe() == "earlier_way(flag=False, period=4)"
    assert EarlierWay.from_options({"interval": 7}).options == {"interval": 7, "flag": False}
    with pytest.raises(ValueError, match="period must be a positive integer, got 0"):
        EarlierWay(period=0)
    with pytest.raises(ValueError, match="flag must be True or False, got 1"):
        EarlierWay(flag=1)
    with pytest.raises(ValueError, match="flag needs a period of at most 10"):
        EarlierWay(flag=True, period=11)
    with pytest.raises(ValueError, match=r"allowed options: period \(alias interval\), flag"):
        EarlierWay.from_options({"nope": 1})
