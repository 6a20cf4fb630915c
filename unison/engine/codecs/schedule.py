"""Which schedule a codec runs: one arithmetic, two shapes of the same work.

- ``"blocked"``: a loop over cache-sized blocks. On a CPU every elementwise pass
  of a block stays in the core's L2 cache, so a codec costs about one trip
  through memory, and it needs no buffer of the input's size.
- ``"whole"``: a fixed number of ops on whole buffers (one ``aminmax`` over
  ``[chunks, size]``, one ``topk`` over all chunks of a shape, one batched
  matrix product). On a GPU each kernel launch costs ~10 us whatever its
  size, so the number of ops must not grow with the model; this schedule
  issues the same ops for 4M values as for 64M. It may hold work buffers of
  the input's size while it runs (freed at its end).

A codec takes ``"blocked"`` on the CPU and ``"whole"`` on every other device
(CUDA, and ``meta``, where CI counts the ops), unless forced: by its
``schedule`` argument, or for every codec built afterwards by the environment
variable ``UNISON_CODEC_SCHEDULE`` (``blocked``, ``whole`` or ``auto``). Both
schedules give the same values: bit for bit where the arithmetic is the same,
and to a stated tolerance where a reduction's order differs
(tests/unit/codecs/test_schedules.py holds them to it on CPU).

Example::

    codec = MinMax8(x.numel(), schedule="whole")   # the GPU's schedule, on the CPU
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import torch

Schedule = Literal["blocked", "whole"]
BLOCKED: Schedule = "blocked"
WHOLE: Schedule = "whole"
#: The environment variable that forces every codec built afterwards onto one schedule.
ENV = "UNISON_CODEC_SCHEDULE"
CHOICES = ("auto", BLOCKED, WHOLE)


def schedule_for(device: "torch.device | str", forced: Optional[str] = None) -> Schedule:
    """The schedule of a codec whose buffers live on ``device``: ``forced`` if given, else the
    environment's ``UNISON_CODEC_SCHEDULE``, else ``"blocked"`` on the CPU and ``"whole"`` elsewhere.

    Raises:
        ValueError: ``forced`` or the environment variable is not one of ``auto``, ``blocked``, ``whole``.
    """
    source = "schedule" if forced is not None else ENV
    choice = forced if forced is not None else os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "auto":
        return BLOCKED if torch.device(device).type == "cpu" else WHOLE
    return WHOLE if choice == WHOLE else BLOCKED
