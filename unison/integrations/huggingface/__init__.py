"""Hugging Face: every unison algorithm behind ``transformers.Trainer`` (``UnisonTrainer``, or
``UnisonTrainerMixin`` before another Trainer class) and ``accelerate`` (``UnisonAccelerator``).
``pip install "unison[hf]"``; each name imports its framework only when it is first used.
The manual is docs/huggingface.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UnisonAccelerator", "UnisonTrainer", "UnisonTrainerMixin"]

_WHERE = {"UnisonAccelerator": "accelerator", "UnisonTrainer": "trainer", "UnisonTrainerMixin": "trainer"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
