"""Staggered, overlapped syncs for the model-averaging algorithms (the schedule of
Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512).

The weights are cut into ``fragments`` of about equal size, in model order.
Each fragment syncs once every ``period`` steps, fragment ``f`` after the local
steps ``(f + 1) * period // fragments`` (mod ``period``): the syncs are spread
over the period instead of all falling on its last step. A sync is launched at
the end of a step and merged ``delay`` steps later, so its communication runs
while those steps compute; ``delay=0`` merges at once (a blocking sync). With
one fragment and no delay this is the classic schedule: one sync every
``period`` steps.

A streamed algorithm subclasses ``streamed.Streamed``, which owns the options
(``fragments``, ``delay``), the schedule, the syncs in flight and their
checkpoint, and writes only two methods: ``launch`` starts fragment ``f``'s
communication and returns ``(pending, extra)`` (``pending.wait()`` gives the
result; ``extra`` is what the merge needs besides, such as the weights at
launch), and ``merge`` writes the result into the model.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Optional, Sequence

import torch

from ..engine.comm import Finished, Waitable


def fragments_of(named: Sequence[tuple[str, torch.Tensor]], count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Cut the tensors' elements, in order, into ``count`` runs of equal size.

    A contiguous tensor that straddles two runs is split into flat views named
    ``"name[start:end]"``; a non-contiguous one goes whole into the run where it
    starts. With ``count=1`` the one run is the tensors themselves.

    Example::

        >>> [[n for n, _ in f] for f in fragments_of([("a", torch.zeros(6)), ("b", torch.zeros(2))], 2)]
        [['a[0:4]'], ['a[4:6]', 'b']]
    """
    total = sum(t.numel() for _, t in named)
    bounds = [total * (k + 1) // count for k in range(count)]
    runs: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(count)]
    start = 0
    for name, t in named:
        n = t.numel()
        if count == 1 or not t.is_contiguous():
            runs[min(bisect.bisect_right(bounds, start), count - 1)].append((name, t))
        else:
            s = 0
            while s < n:
                k = min(bisect.bisect_right(bounds, start + s), count - 1)
                e = n if k == count - 1 else min(n, bounds[k] - start)
                runs[k].append((name if (s, e) == (0, n) else f"{name}[{s}:{e}]", t.view(-1)[s:e]))
                s = e
        start += n
    return [run for run in runs if run]


class Stagger:
    """When each fragment launches its sync and when it merges.

    Args:
        period: steps between two syncs of one fragment.
        fragments: how many fragments share the period.
        delay: steps between a sync's launch and its merge, less than ``period``.
    """

    def __init__(self, period: int, fragments: int, delay: int) -> None:
        if fragments > period:
            raise ValueError(
                f"fragments ({fragments}) must be at most period ({period}): each fragment syncs after its own step"
            )
        if delay >= period:
            raise ValueError(
                f"delay ({delay}) must be less than period ({period}): a fragment's sync lands before its next one starts"
            )
        self.period, self.fragments, self.delay = period, fragments, delay

    def offset(self, fragment: int) -> int:
        """The local step (mod ``period``) after which ``fragment`` launches."""
        return (fragment + 1) * self.period // self.fragments % self.period

    def launching(self, step: int) -> list[int]:
        """The fragments whose sync starts after local step ``step`` (counted from 1)."""
        if step <= 0:
            return []
        return [f for f in range(self.fragments) if step % self.period == self.offset(f)]


def default_schedule(period: int, fragments: Optional[int], delay: Optional[int]) -> Stagger:
    """The schedule for the options given; None picks the default: ``min(4, period)``
    fragments, and a delay of half the steps between two launches
    (``period // fragments // 2``: 2 steps for the default period of 16)."""
    fragments = min(4, period) if fragments is None else fragments
    delay = period // fragments // 2 if delay is None else delay
    return Stagger(period, fragments, delay)


class Streams:
    """The fragments' syncs in flight: launched and merged on a ``Stagger``'s schedule.

    Args:
        stagger: the schedule.
        launch: ``launch(f) -> (pending, extra)``.
        merge: ``merge(f, pending.wait(), extra)``.
        redo: syncs abandoned by a membership change (``abandon``) are launched again at the next
            step, on the new members (DiLoCo's outer steps); otherwise they are dropped.
    """

    def __init__(
        self,
        stagger: Stagger,
        launch: Callable[[int], tuple[Waitable, Any]],
        merge: Callable[[int, Any, Any], None],
        redo: bool = False,
    ) -> None:
        self.stagger, self._launch, self._merge, self.redo = stagger, launch, merge, redo
        self.inflight: dict[
            int, tuple[int, Waitable, Any]
        ] = {}  # fragment -> (launch step, pending, extra), in launch order
        self.relaunch: list[int] = []  # fragments abandoned by a membership change, to launch again
        self.merged = 0  # syncs merged so far (fault tolerance compares it across members)

    def advance(self, step: int) -> None:
        """After local step ``step``: launch again the syncs abandoned, merge the syncs due, then
        launch the fragments due."""
        for f in self._relaunch(step):  # blocking: a redone sync lands at once
            self._land(f)
        for f, (launched, _, _) in list(self.inflight.items()):
            if step - launched >= self.stagger.delay:
                self._land(f)
        for f in self.stagger.launching(step):
            self.inflight[f] = (step, *self._launch(f))
            if self.stagger.delay == 0:
                self._land(f)

    def finish(self) -> None:
        """Merge every sync in flight now (all ranks launched them: no new collective), after
        launching again those abandoned by a membership change."""
        self._relaunch(0)
        for f in list(self.inflight):
            self._land(f)

    def drop(self) -> None:
        """Let every sync in flight complete, and forget it."""
        for _, pending, _ in self.inflight.values():
            pending.wait()
        self.inflight.clear()

    def _relaunch(self, step: int) -> list[int]:
        """Launch again the syncs abandoned (each leaves the list once launched); returns them."""
        launched = []
        while self.relaunch:
            f = self.relaunch[0]
            self.inflight[f] = (step, *self._launch(f))
            launched.append(self.relaunch.pop(0))
        return launched

    def abandon(self) -> None:
        """The members changed: forget the syncs in flight without waiting (their peers may be
        gone); with ``redo`` they are launched again at the next step."""
        if self.redo:
            self.relaunch = sorted(set(self.relaunch) | set(self.inflight))
        self.inflight.clear()

    def _land(self, f: int) -> None:
        _, pending, extra = self.inflight[f]
        result = pending.wait()  # a failed wait leaves the sync in flight, for ``abandon``
        del self.inflight[f]
        self._merge(f, result, extra)
        self.merged += 1

    def state_dict(self) -> list[dict[str, Any]]:
        """The syncs in flight, received (waits for them) but not merged: a resumed run merges them on
        schedule; and those to launch again."""
        landed = [
            {"fragment": f, "step": s, "result": _copy(p.wait()), "extra": _copy(e)}
            for f, (s, p, e) in self.inflight.items()
        ]
        return landed + [{"fragment": f, "relaunch": True} for f in self.relaunch]

    def load_state_dict(self, entries: list[dict[str, Any]]) -> None:
        self.drop()
        self.relaunch = [int(e["fragment"]) for e in entries if e.get("relaunch")]
        for e in entries:
            if not e.get("relaunch"):
                self.inflight[int(e["fragment"])] = (int(e["step"]), Finished(e["result"]), e["extra"])


def _copy(value: Any) -> Any:
    """``value`` with every tensor in its (nested) lists cloned: a state dict outlives reused buffers."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value
