"""The one step counter of periodic syncs, shared by the model-averaging algorithms.

It counts training steps (``replica.step_ended``), past an optional warm-up of
synchronous gradient averaging, and says when a sync every ``period`` steps is due.
Its count is saved in the algorithm's state, so a resumed run syncs at the same steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..replica import Replica
from .contract import State


class StepCount:
    """Training steps taken, and when a periodic sync falls due.

    Args:
        period: a sync every this many steps after the warm-up.
        warmup_steps: steps of synchronous gradient averaging first.

    Example::

        count = StepCount(period=16)
        if count.tick(replica, optimizer) and count.due():
            average_(replica.parameters, replica.group)
    """

    __slots__ = ("period", "warmup_steps", "steps")

    def __init__(self, period: int, warmup_steps: int = 0) -> None:
        self.period, self.warmup_steps, self.steps = period, warmup_steps, 0

    def tick(self, replica: Replica, optimizer: torch.optim.Optimizer) -> bool:
        """Count ``optimizer``'s step if it ended a training step; True if it did."""
        if not replica.step_ended(optimizer):
            return False
        self.steps += 1
        return True

    @property
    def warming_up(self) -> bool:
        """Whether the next step still averages gradients synchronously."""
        return self.steps < self.warmup_steps

    @property
    def local_steps(self) -> int:
        """Steps since the warm-up ended (0 during it)."""
        return max(0, self.steps - self.warmup_steps)

    def due(self, period: int = 0) -> bool:
        """Whether the step just counted ends a period (of ``period`` steps, default the sync period)."""
        local = self.steps - self.warmup_steps
        return local > 0 and local % (period or self.period) == 0

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class CountedState(State):
    """Base of the states of periodic algorithms: a ``StepCount`` in ``count``; by default
    the count is all a checkpoint keeps."""

    __slots__ = ("count",)

    def __init__(self, count: StepCount) -> None:
        super().__init__()
        self.count = count

    @property
    def steps(self) -> int:
        """Training steps taken under this algorithm."""
        return self.count.steps

    def state_dict(self) -> dict[str, Any]:
        return self.count.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.load_state_dict(state)
