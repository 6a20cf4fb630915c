"""The base of the streamed model-averaging algorithms (local_sgd, decentralized,
low_precision_decentralized, diloco): their options, schedule, syncs in flight,
checkpoint and events, written once. Each algorithm writes its ``launch`` and
its ``merge``; the schedule itself is ``streaming``'s.
"""

from __future__ import annotations

from typing import Any, Optional, TypeVar

import torch

from ..engine.comm import Waitable
from ..replica import Replica
from .base import Algorithm
from .hierarchical import two_level
from .node_rounds import NodeRounds
from .options import Bool, Int
from .periodic import CountedState, StepCount
from .streaming import Stagger, Streams, default_schedule


class StreamedState(CountedState):
    """Base of a streamed algorithm's state: the step count and the syncs in flight
    (``streams`` is None on a replica alone: nothing to sync)."""

    __slots__ = ("streams", "nodes")

    def __init__(self, count: StepCount) -> None:
        super().__init__(count)
        self.streams: Optional[Streams] = None
        self.nodes: Optional[NodeRounds] = None  # hierarchical: the node layout and its rounds' thread

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.close()

    @property
    def late(self) -> bool:
        """Whether syncs land some steps after their launch (local steps are kept at the merge)."""
        return self.streams is not None and self.streams.stagger.delay > 0

    @property
    def shared_rounds(self) -> int:
        """Syncs merged so far where they are shared state (``redoes_syncs``): fault tolerance
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
            rank with its shard (``node_rounds``).
        delay: steps a sync travels before it is merged, less than ``period``
            (default ``period // fragments // 2``; 0 blocks).

    A subclass builds its state in ``setup``, calls ``stream(replica, state, n)``
    for its ``n`` fragments, and writes ``launch`` and ``merge``. ``average()``
    and ``switch_to()`` merge the syncs in flight; a wrapper collected without
    ``close()`` forgets them (no waiting: the peers may be gone).
    """

    period: int
    fragments = Int(None, optional=True)
    delay = Int(None, minimum=0, optional=True)
    hierarchical = Bool(False)

    def validate(self) -> None:
        self.schedule()  # refuses fragments > period, delay >= period

    def schedule(self) -> Stagger:
        """The schedule the options ask for (defaults filled in)."""
        return default_schedule(self.period, self.fragments, self.delay)

    #: Whether a sync abandoned by a membership change is launched again (its result is state
    #: every replica must share: DiLoCo's outer step) or dropped (an average of drifting replicas).
    redoes_syncs = False

    def stream(self, replica: Replica, state: T, fragments: int) -> None:
        """Sync ``fragments`` fragments of ``state`` on the schedule, through ``launch`` and ``merge``."""
        stagger = Stagger(self.period, fragments, self.schedule().delay)
        state.streams = Streams(
            stagger,
            lambda f: self.launch(replica, state, f),
            lambda f, result, extra: self.merge(replica, state, f, result, extra),
            redo=self.redoes_syncs,
        )

    def node_rounds(self, replica: Replica, fragments: list[list[torch.Tensor]]) -> Optional[NodeRounds]:
        """With ``hierarchical``, the node layout and the rounds' buffers for ``fragments`` (None: flat)."""
        levels = two_level(replica, self.name, f"{self.name}/nodes") if self.hierarchical else None
        return NodeRounds(levels, fragments, self.name) if levels is not None else None

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
