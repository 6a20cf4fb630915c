"""No host sync on the training thread in a steady-state training step.

On a GPU, ``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)``,
``.cpu()`` and ``nonzero`` make the host wait for the device. A
``TorchFunctionMode`` installed on the training thread (it sees that thread's
calls only, not an algorithm's own thread) counts the ones unison's code makes,
each with the unison file:line that made it, over ``STEPS`` steps after a
warm-up past every algorithm's own warm-up and first sync period. On CPU
these calls cost nothing, but they are the same calls that stall a GPU.

Every algorithm at its defaults and the options below run in sequence in the
same two gloo processes. Each must make none, except the ones ``EXEMPT``
names, each with the reason its option truly needs one (also written on the
option's docs).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from contextlib import contextmanager

import launch
import pytest
import torch
import torch.nn.functional as F
from models import MLP, batch
from torch.overrides import TorchFunctionMode

import unison

#: Steady-state steps counted, after the warm-up.
STEPS = 32
#: Steps before counting: past two sync periods (16 is every averaging algorithm's default period).
WARMUP = 34
#: QAdamOptimizer's default warm-up is 100 steps (before it, qadam averages full-precision gradients).
WARMUP_QADAM = 110

#: Name -> (algorithm, DataParallel keywords, run the loop inside ``model.join()``).
CASES: dict[str, tuple[str, dict, bool]] = {
    **{name: (name, {}, False) for name in unison.algorithms.names()},
    "allreduce+nonfinite=skip": ("allreduce", {"nonfinite": "skip"}, False),
    "diloco+nonfinite=skip": ("diloco", {"nonfinite": "skip"}, False),
    "nonblocking+nonfinite=skip": ("nonblocking", {"nonfinite": "skip"}, False),
    "allreduce+join": ("allreduce", {}, True),
    "diloco:offload=True": ("diloco:offload=True", {}, False),
    "low_precision_decentralized:offload=True": ("low_precision_decentralized:offload=True", {}, False),
}

NONFINITE = (
    "nonfinite='raise'/'skip' reads the agreed non-finite code once per synchronized step: whether the "
    "step is skipped (or raises) is decided on the host, as torch's optimizers cannot skip a step on the "
    "device (docs: DataParallel(nonfinite=...))"
)
JOIN = (
    "join() announces each forward and step with a small allreduce whose result every rank reads: "
    "a rank that ran out of inputs learns what to shadow, the others check that they run the same "
    "step and take the divisor (docs: DataParallel.join)"
)

#: (case, file, "function (call)") -> (the most such calls per step, why that option truly needs them).
EXEMPT: dict[tuple[str, str, str], tuple[int, str]] = {
    ("allreduce+nonfinite=skip", "unison/engine/reducer.py", "_settle_flags (item)"): (1, NONFINITE),
    ("nonblocking+nonfinite=skip", "unison/engine/reducer.py", "_settle_flags (item)"): (1, NONFINITE),
    ("diloco+nonfinite=skip", "unison/engine/nonfinite.py", "agree_at_step (item)"): (1, NONFINITE),
    ("allreduce+join", "unison/join.py", "_exchange (tolist)"): (2, JOIN),  # a forward and a step
    ("allreduce+join", "unison/join.py", "_exchange (tensor(device=))"): (2, JOIN),
}


def _exempt(case: str, site: str, count: int) -> bool:
    """Whether ``count`` calls at ``site`` (``file:line function (call)``) in ``case`` are exempted."""
    where, _, what = site.partition(" ")
    for (c, file, call), (per_step, _) in EXEMPT.items():
        if c == case and where.startswith(file + ":") and what == call:
            return count <= per_step * STEPS
    return False


#: What stalls the host on a GPU, by what ``__torch_function__`` receives.
WATCHED = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.tensor: "tensor(device=)",  # counted when given a device: a copy from the host, waited for on a GPU
}

PACKAGE = os.path.dirname(unison.__file__) + os.sep
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


#: Where the watched calls live, to wrap them while backward runs (see ``HostSyncs``).
PATCHED = [(torch.Tensor, f.__name__, name) for f, name in WATCHED.items() if f not in (torch.nonzero, torch.tensor)]
PATCHED += [(torch, "nonzero", "nonzero"), (torch, "tensor", "tensor(device=)")]


class HostSyncs(TorchFunctionMode):
    """Counts the watched calls unison's code makes on this thread, by ``file:line (call)``.

    The autograd engine runs hooks and end-of-backward callbacks without the thread's
    torch function modes, so while ``backward`` runs the watched calls are wrapped instead
    (counted on this thread only: the CPU engine runs backward on the thread that called it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.thread = threading.get_ident()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            with self._wrapped():
                return func(*args, **kwargs)
        name = WATCHED.get(func)
        if name is not None and (func is not torch.tensor or kwargs.get("device") is not None):
            self._note(name)
        return func(*args, **kwargs)

    @contextmanager
    def _wrapped(self):
        saved = [(owner, attr, owner.__dict__.get(attr)) for owner, attr, _ in PATCHED]
        for owner, attr, name in PATCHED:
            setattr(owner, attr, self._counting(getattr(owner, attr), name))
        try:
            yield
        finally:
            for owner, attr, original in saved:
                if original is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, original)

    def _counting(self, original, name: str):
        def counted(*args, **kwargs):
            if threading.get_ident() == self.thread and (name != "tensor(device=)" or kwargs.get("device") is not None):
                self._note(name)
            return original(*args, **kwargs)

        return counted

    def _note(self, name: str) -> None:
        """The innermost frame in unison made it (torch's and the standard library's frames are
        passed over); one in the tests first is the test's own."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(TESTS):
                return
            if path.startswith(PACKAGE):
                where = "unison/" + path[len(PACKAGE) :].replace(os.sep, "/")
                self.sites[f"{where}:{frame.f_lineno} {frame.f_code.co_name} ({name})"] += 1
                return
            frame = frame.f_back


def _train(spec: str, keywords: dict, join: bool) -> dict[str, int]:
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    net = MLP()
    warmup = WARMUP_QADAM if spec.startswith("qadam") else WARMUP
    if spec.startswith("qadam"):
        opt: torch.optim.Optimizer = unison.QAdamOptimizer(net.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    data = [batch(i % 8, rank) for i in range(8)]
    model = unison.DataParallel(net, optimizer=opt, algorithm=spec, **keywords)
    counter = HostSyncs()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    try:
        with model.join() if join else contextlib.nullcontext():
            for i in range(warmup):
                step(i)
            with counter:
                for i in range(STEPS):
                    step(warmup + i)
    finally:
        model.close()
    return dict(counter.sites)


def every_case() -> dict[str, dict[str, int]]:
    return {case: _train(*CASES[case]) for case in CASES}


@pytest.mark.parametrize("schedule", ["blocked", "whole"])
def test_no_host_sync_in_a_training_step(schedule):
    """Zero watched calls from unison on the training thread in ``STEPS`` steady-state steps,
    for every algorithm and option in ``CASES``, but for the exempted sites; with the codecs in
    the CPU's schedule and in the GPU's (``whole``, what a GPU runs), forced on the CPU."""
    results = launch.run(every_case, 2, timeout=180, env={"UNISON_CODEC_SCHEDULE": schedule})
    failures = []
    for case in CASES:
        merged: Counter[str] = Counter()
        for sites in results:
            merged.update(sites[case])
        total = sum(merged.values()) // len(results)
        exempted = {s: n for s, n in merged.items() if _exempt(case, s, n // len(results))}
        print(
            f"{case:45s} {total:4d} per rank"
            + (f"  ({sum(exempted.values()) // len(results)} exempted)" if exempted else "")
        )
        for site, n in sorted(merged.items()):
            print(f"    {n // len(results):4d}  {site}")
            if site not in exempted:
                failures.append(f"{case}: {n // len(results)} x {site}")
    assert not failures, "host syncs on the training thread in steady state:\n" + "\n".join(failures)
