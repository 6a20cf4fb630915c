"""An algorithm's options are its dataclass's fields, so mypy checks their names and types where
the class is constructed (``create`` takes any name and checks it when it runs)."""

import textwrap

import pytest

mypy_api = pytest.importorskip("mypy.api")

GOOD = """
    from unison.algorithms.averaging.diloco import DiLoCo
    from unison.algorithms.averaging.local_sgd import LocalSGD
    from unison.algorithms.gradient.powersgd import PowerSGD

    PowerSGD(rank=4, start_iter=0)
    LocalSGD(period=8, fragments=2, hierarchical=True)
    DiLoCo(wire_dtype="bf16", mixing=0.5)
"""

BAD = """
    from unison.algorithms.averaging.diloco import DiLoCo
    from unison.algorithms.gradient.nonblocking import NonBlocking
    from unison.algorithms.gradient.powersgd import PowerSGD

    PowerSGD(rnak=4)
    PowerSGD(4)
    PowerSGD(warm_start="yes")
    DiLoCo(wire_dtype="int4")
    NonBlocking(autotune=True)
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy_cache")  # one for both checks: the second reads unison's from it


def _mypy(tmp_path, cache, code):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(code))
    out, err, status = mypy_api.run(
        [str(snippet), "--follow-imports=silent", "--no-error-summary", "--cache-dir", str(cache)]
    )
    return out + err, status


def test_a_well_spelt_construction_passes_mypy(tmp_path, cache):
    out, status = _mypy(tmp_path, cache, GOOD)
    assert status == 0, out


def test_mypy_finds_a_misspelt_option_and_a_wrong_type(tmp_path, cache):
    out, status = _mypy(tmp_path, cache, BAD)
    assert status == 1, out
    errors = [line.split(": error: ")[1] for line in out.splitlines() if ": error: " in line]
    assert errors[0].startswith('Unexpected keyword argument "rnak" for "PowerSGD"'), out
    assert errors[1].startswith('Too many positional arguments for "PowerSGD"'), out
    assert errors[2].startswith('Argument "warm_start" to "PowerSGD" has incompatible type "str"'), out
    assert errors[3].startswith('Argument "wire_dtype" to "DiLoCo" has incompatible type'), out
    assert errors[4].startswith('Unexpected keyword argument "autotune" for "NonBlocking"'), out
    assert len(errors) == 5, out
