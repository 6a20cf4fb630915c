"""What a ``unison bench`` run needs installed, checked before the first contender starts.

A bench trains for minutes before it plots; a missing matplotlib or
scikit-learn must stop it at once, naming the extra to install, not after the
training. rich, which draws its output, is checked before anything else. A peer contender that is not installed (``ppe_ddp`` without
pytorch-pfn-extras) is not an error: it is reported as "not installed" and the
others run, as the README says; ``skipped`` names it up front.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import contenders

if TYPE_CHECKING:
    from .runner import BenchConfig

#: The extra that installs everything a bench may need.
BENCH_EXTRA = 'pip install "unison[bench]"'


@dataclass(frozen=True)
class Need:
    """A module the run imports, the package that provides it, and what needs it."""

    module: str
    package: str
    why: str  # "the plots need it"
    remedy: str = ""  # another way out than installing it


#: What draws the bench's output: checked first, by ``command.run``.
RICH = Need("rich", "rich", "the bench's output needs it")


def needs(config: BenchConfig) -> list[Need]:
    """The optional modules this run imports: matplotlib for the plots, scikit-learn for digits."""
    out = []
    if config.plots:
        out.append(Need("matplotlib", "matplotlib", "the plots need it", "or give --no-plot to run without plots"))
    if ":" not in (config.model or "") and config.workload == "digits":
        out.append(Need("sklearn", "scikit-learn", "the digits workload needs it"))
    return out


def importable(module: str) -> bool:
    """Whether ``import module`` works here (an installed but broken package does not count)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def check(config: BenchConfig) -> None:
    """Refuse a run that would fail for a missing module (ValueError naming the remedies).

    Example::

        >>> check(BenchConfig(workload="digits"))  # doctest: +SKIP
        ValueError: matplotlib is not installed, and the plots need it: pip install "unison[bench]"
        (or pip install matplotlib), or give --no-plot to run without plots
    """
    problems = [message(need) for need in needs(config) if not importable(need.module)]
    if problems:
        raise ValueError("; ".join(problems))


def message(need: Need) -> str:
    """What is missing, what needs it, and how to get it."""
    text = f"{need.package} is not installed, and {need.why}: {BENCH_EXTRA} (or pip install {need.package})"
    return text + (f", {need.remedy}" if need.remedy else "")


def skipped(specs: list[contenders.Spec]) -> list[str]:
    """One line per contender that will be reported "not installed" instead of running."""
    lines = []
    for spec in specs:
        reason = contenders.unavailable(spec)
        if reason:
            lines.append(f"{spec.label}: {reason}; reported as not installed, the others run")
    return lines
