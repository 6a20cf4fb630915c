"""What an algorithm supports is checked once (``unison.algorithms.support.check``): building a
wrapper with an algorithm and switching a running wrapper to it give the same answer, for every
algorithm and its hierarchical form, on a plain model, on one with sparse gradients, on one
sharded by FSDP2 and under fault tolerance (one job of ``unison launch --fault-tolerant``,
tests/scripts/ft_support.py). Fault tolerance over FSDP2 is in test_sharded_fault.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import launch
import pytest
import torch
from torch import nn

import unison
from integration.test_sharded import NODES, PER_NODE, mesh_2d, sharded_net
from unison import algorithms
from unison.algorithms import support

FT_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_support.py"
#: Every registered algorithm at its defaults, and hierarchical where it has the option.
SPECS = [*algorithms.names()] + [
    f"{name}:hierarchical=True" for name in algorithms.names() if "hierarchical" in algorithms.get(name).defaults
]


class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 2)


def _answer(attempt) -> object:
    """None if ``attempt()`` raised nothing, else the type and message of what it raised."""
    try:
        attempt()
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    return None


def _both(build, spec: str, base: str) -> tuple[object, object]:
    """(built with ``spec``, a wrapper of ``base`` switched to ``spec``): the answers of the two."""

    def built() -> None:
        net = build()
        unison.DataParallel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), algorithm=spec).close()

    def switched() -> None:
        net = build()
        model = unison.DataParallel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), algorithm=base)
        try:
            model.switch_to(spec)
        finally:
            model.close()

    return _answer(built), _answer(switched)


def plain_and_sparse() -> dict:
    torch.manual_seed(0)
    return {("plain", spec): _both(lambda: nn.Linear(4, 2), spec, "allreduce") for spec in SPECS} | {
        ("sparse", spec): _both(SparseNet, spec, "allreduce") for spec in SPECS
    }


def over_fsdp2() -> dict:
    mesh = mesh_2d()
    node = torch.distributed.get_rank() // PER_NODE

    def build_wrapped(spec: str) -> None:
        net = sharded_net(mesh, node)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        unison.DataParallel(net, optimizer=opt, algorithm=spec, device_mesh=mesh["replicate"]).close()

    def build_switched(spec: str) -> None:
        net = sharded_net(mesh, node)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model = unison.DataParallel(net, optimizer=opt, algorithm="allreduce", device_mesh=mesh["replicate"])
        try:
            model.switch_to(spec)
        finally:
            model.close()

    return {
        ("fsdp2", spec): (_answer(partial(build_wrapped, spec)), _answer(partial(build_switched, spec)))
        for spec in SPECS
    }


@pytest.fixture(scope="module")
def answers() -> dict:
    found = launch.run(plain_and_sparse, 2, env={"UNISON_NODES": "2"})
    found += launch.run(over_fsdp2, NODES * PER_NODE, timeout=300)
    return found


def test_construction_and_switch_to_give_the_same_answer(answers):
    differ = {key: pair for found in answers for key, pair in found.items() if pair[0] != pair[1]}
    assert differ == {}


@pytest.mark.parametrize("context", ["sparse", "fsdp2"])
def test_what_the_check_refuses_is_what_construction_refuses(answers, context):
    """Each refusal of an algorithm as such is ``support.check``'s, word for word; a refusal the
    check does not make comes from the algorithm's own setup (its layout, its optimizer)."""
    ctx = support.Context(fsdp2=context == "fsdp2", sparse="emb.weight" if context == "sparse" else None)
    for found in answers:
        for (where, spec), (built, _) in found.items():
            if where != context:
                continue
            try:
                support.check(algorithms.as_algorithm(spec), ctx)
                expected = None
            except Exception as exc:
                expected = (type(exc).__name__, str(exc))
            if expected is not None:
                assert built == expected, (spec, built)
    refused = {spec for found in answers for (where, spec), (built, _) in found.items() if where == context and built}
    assert refused, f"nothing refused over {context}: the case tests nothing"


def test_under_fault_tolerance_construction_and_switch_to_give_the_check_s_answer(tmp_path):
    """Every spec through a fault-tolerant construction and a fault-tolerant switch, in one job of
    ``unison launch --fault-tolerant`` (tests/scripts/ft_support.py): the same answer from both, and
    where ``support.check`` refuses (no Recovery), its words."""
    cmd = [sys.executable, "-m", "unison", "launch", "--fault-tolerant", "--nproc", "2", *launch.PRELOAD]
    cmd += [str(FT_SCRIPT), "--out", str(tmp_path), *SPECS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ctx = support.Context(fault_tolerant=True)
    refused = 0  # by either path, for whatever reason (qadam without its optimizer, say)
    written = sorted(tmp_path.glob("*.json"))
    assert len(written) == 2, done.stderr[-3000:]
    for path in written:
        found = json.loads(path.read_text())
        assert sorted(found) == sorted(SPECS)
        for spec, (built, switched) in found.items():
            assert built == switched, spec
            expected = _answer(partial(support.check, algorithms.as_algorithm(spec), ctx))
            if expected is not None:
                assert built == list(expected), (spec, built)
            refused += built is not None
    assert refused, "nothing refused under fault tolerance: the comparison of refusals tests nothing"


def test_fault_tolerance_s_refusal_is_the_same_check():
    """Construction (``joining_member``) and ``unison train --fault-tolerant`` refuse an algorithm
    without a Recovery by ``support.check``: its words, with the algorithms that declare one."""
    supported = unison.fault.supported()
    for name in algorithms.names():
        answer = _answer(partial(support.check, algorithms.as_algorithm(name), support.Context(fault_tolerant=True)))
        assert (answer is None) == (name in supported), name
