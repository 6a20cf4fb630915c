"""argparse types shared by the command-line apps."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type for counts that must be at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type for counts that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type for rates that must be above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def algorithm(text: str) -> str:
    """An argparse type for ``NAME`` or ``NAME:key=value,...``, the syntax of ``unison bench --contenders``.

    The algorithm is built once here (``unison.algorithms.create``), so an unknown
    name or a bad option is refused before any process starts, with the names listed.

    Example::

        >>> algorithm("powersgd:rank=2")
        'powersgd:rank=2'
    """
    from .. import algorithms

    names = ", ".join(algorithms.names())
    name = text.partition(":")[0].strip()
    if name not in algorithms.names():
        raise argparse.ArgumentTypeError(
            f"unknown algorithm {name!r}; choose from {names} (with options: NAME:key=value,..., e.g. powersgd:rank=2)"
        )
    try:
        algorithms.create(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (algorithms: {names})") from None
    return text.strip()
