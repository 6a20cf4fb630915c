"""The base of the streamed model-averaging algorithms (local_sgd, decentralized,
low_precision_decentralized, diloco): their options, schedule, syncs in flight,
checkpoint and events, written once. Each algorithm writes its ``launch`` and
its ``merge``; the schedule itself is ``streaming``'s.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import torch

from ..engine.comm import Finished, Pending, Waitable
from ..engine.flat import Flats
from ..engine.hierarchy import TwoLevel
from ..replica import Replica
from . import options
from .contract import Algorithm
from .schedules import CountedState, StepCount


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
        commit: told whether a landing sync's wait returned (True) or raised (False) before it is
            merged; it raises to keep one that returned from being merged (``Replica.commit``:
            over FSDP2 the node's processes merge a round on all their shards or on none).
    """

    def __init__(
        self,
        stagger: Stagger,
        launch: Callable[[int], tuple[Waitable, Any]],
        merge: Callable[[int, Any, Any], None],
        redo: bool = False,
        commit: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self.stagger, self._launch, self._merge, self.redo = stagger, launch, merge, redo
        self._commit = commit
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
        try:
            result = pending.wait()  # a failed wait leaves the sync in flight, for ``abandon``
        except Exception:
            self._commit(False)
            raise
        self._commit(True)  # raises if the node merges it nowhere: left in flight as well
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


class StreamedState(CountedState):
    """Base of a streamed algorithm's state: the step count and the syncs in flight
    (``streams`` is None on a replica alone: nothing to sync); hierarchical, the two levels
    (their thread runs the rounds) and each fragment's buffers on them."""

    __slots__ = ("streams", "levels", "node_flats")

    def __init__(self, count: StepCount) -> None:
        super().__init__(count)
        self.streams: Optional[Streams] = None
        self.levels: Optional[TwoLevel] = None  # hierarchical: the node layout and its rounds' thread
        self.node_flats: list[Flats] = []  # hierarchical: per fragment, its tensors' buffers (equal shards)

    def close(self) -> None:
        if self.levels is not None:
            self.levels.close()

    def average_nodes(
        self,
        fragment: int,
        values: Sequence[torch.Tensor],
        wire_dtype: Union[torch.dtype, str, None] = None,
        feedback: Optional[torch.Tensor] = None,
    ) -> Pending:
        """Hierarchical: the average of ``values`` (laid out like the fragment) over every process, on
        the levels' thread (its bytes added to ``bytes_sent``); ``wait()`` gives new tensors."""
        levels, flats = self.levels, self.node_flats[fragment]
        if levels is None:
            raise RuntimeError("this state runs flat: it has no two levels")

        def run() -> list[torch.Tensor]:
            return [v.clone() for v in levels.average(flats, values, wire_dtype, feedback)]

        return levels.submit(run, meter=self)

    @property
    def late(self) -> bool:
        """Whether syncs land some steps after their launch (local steps are kept at the merge)."""
        return self.streams is not None and self.streams.stagger.delay > 0

    @property
    def shared_rounds(self) -> int:
        """Syncs merged so far where they are shared state (``Recovery.relaunches``): fault tolerance
        heals a member that merged fewer than another."""
        return self.streams.merged if self.streams and self.streams.redo else 0

    def streams_state(self) -> dict[str, Any]:
        """The syncs in flight and the count of those merged, for ``state_dict``."""
        return {"in_flight": self.streams.state_dict(), "merged": self.streams.merged} if self.streams else {}

    def load_streams(self, state: dict[str, Any]) -> None:
        if self.streams:
            self.streams.load_state_dict(state.get("in_flight", []))
            self.streams.merged = int(state.get("merged", 0))

    def state_dict(self) -> dict[str, Any]:
        return {**self.count.state_dict(), "in_flight": [], **self.streams_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"steps", "in_flight", "merged"})
        if unknown:
            raise ValueError(f"{type(self).__name__} has unknown entries {unknown}; expected 'steps' and 'in_flight'")
        self.count.load_state_dict(state)
        self.load_streams(state)


T = TypeVar("T", bound=StreamedState)


def write_average(tensors: list[torch.Tensor], averaged: list[torch.Tensor], at_launch: Optional[list]) -> None:
    """Write a landed average into ``tensors``: as it is, or, when it landed late (``at_launch``: the
    values sent), the change it makes to them, so the local steps taken meanwhile are kept."""
    with torch.no_grad():
        if at_launch is None:
            torch._foreach_copy_(tensors, averaged)
        else:
            torch._foreach_sub_(averaged, at_launch)
            torch._foreach_add_(tensors, averaged)


class Streamed(Algorithm[T]):
    """Base of the streamed model-averaging algorithms: a sync every ``period`` steps per fragment.

    Options (besides each algorithm's ``period``):
        fragments: how many fragments of the weights sync in turn across the
            period (default ``min(4, period)``).
        hierarchical: average inside each node first; syncs cross nodes from every local
            rank with its shard (``engine.hierarchy.TwoLevel``).
        delay: steps a sync travels before it is merged, less than ``period``
            (default ``period // fragments // 2``; 0 blocks).

    A subclass builds its state in ``setup``, calls ``stream(replica, state, n)``
    for its ``n`` fragments, and writes ``launch`` and ``merge``. ``average()``
    and ``switch_to()`` merge the syncs in flight; a wrapper collected without
    ``close()`` forgets them (no waiting: the peers may be gone).
    """

    period: int  # each algorithm declares and checks its own
    fragments: Optional[int] = None
    delay: Optional[int] = None
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.integer("fragments", self.fragments, optional=True)
        options.integer("delay", self.delay, minimum=0, optional=True)
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()
        self.schedule()  # refuses fragments > period, delay >= period

    def schedule(self) -> Stagger:
        """The schedule the options ask for (defaults filled in)."""
        return default_schedule(self.period, self.fragments, self.delay)

    def stream(self, replica: Replica, state: T, fragments: int) -> None:
        """Sync ``fragments`` fragments of ``state`` on the schedule, through ``launch`` and ``merge``."""
        stagger = Stagger(self.period, fragments, self.schedule().delay)
        state.streams = Streams(
            stagger,
            lambda f: self.launch(replica, state, f),
            lambda f, result, extra: self.merge(replica, state, f, result, extra),
            redo=self.recovery is not None and self.recovery.relaunches,
            commit=replica.commit,
        )

    def use_nodes(self, replica: Replica, state: T, fragments: list[list[torch.Tensor]]) -> None:
        """With ``hierarchical``, the two levels and the buffers of ``fragments`` on them, into
        ``state.levels`` and ``state.node_flats`` (left None and empty to run flat)."""
        if not self.hierarchical:
            return
        topology, group, private = replica.topology, replica.group, replica.private_group
        state.levels = TwoLevel.build(topology, group, private, self.name, f"{self.name}/nodes", thread=True)
        if state.levels is not None:
            state.node_flats = [state.levels.flats(f) for f in fragments]

    def launch(self, replica: Replica, state: T, fragment: int) -> tuple[Waitable, Any]:
        """Start ``fragment``'s sync: ``(pending, extra)`` for ``merge``."""
        raise NotImplementedError

    def merge(self, replica: Replica, state: T, fragment: int, result: Any, extra: Any) -> None:
        """Write ``fragment``'s landed sync (``pending.wait()``) into the model."""
        raise NotImplementedError

    def after_step(self, replica: Replica, state: T, optimizer: torch.optim.Optimizer) -> None:
        """After a training step: merge the syncs due, launch the fragments due."""
        if state.count.tick(replica, optimizer) and state.streams is not None:
            state.streams.advance(state.count.local_steps)

    def average(self, replica: Replica, state: T) -> None:
        if state.streams:
            state.streams.finish()

    def teardown(self, replica: Replica, state: T) -> None:
        if state.streams:
            state.streams.finish()
        super().teardown(replica, state)

    def release(self, replica: Replica, state: T) -> None:
        if state.streams:
            state.streams.abandon()
