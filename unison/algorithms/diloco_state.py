"""DiLoCo's state: the outer optimizer and the snapshot it steps, the step count, the syncs in
flight, and the error feedback of 8-bit pseudo-gradients (hierarchical: of this local rank's
shards, where the compression happens)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .periodic import StepCount
from .streamed import StreamedState


class DiLoCoState(StreamedState):
    """The outer optimizer and the snapshot it steps (the reference weights, one piece per
    fragment's share of a parameter), the step count, and the syncs in flight."""

    __slots__ = ("names", "params", "buffers", "snapshot", "outer", "group", "fragments", "feedback")

    def __init__(
        self,
        count: StepCount,
        fragments: list[list[tuple[str, torch.Tensor]]],
        buffers: list[torch.Tensor],
        outer: dict[str, Any],
        group: Optional[dist.ProcessGroup],
    ) -> None:
        super().__init__(count)
        pieces = [piece for fragment in fragments for piece in fragment]
        self.names = [n for n, _ in pieces]
        self.params = [p for _, p in pieces]
        self.fragments: list[range] = []  # per fragment, the indices of its pieces
        first = 0
        for fragment in fragments:
            self.fragments.append(range(first, first + len(fragment)))
            first += len(fragment)
        self.buffers = buffers  # floating-point buffers, averaged with the last fragment's pseudo-gradient
        with torch.no_grad():  # detached copies: the outer and inner optimizers' gradients never meet
            self.snapshot = [nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.snapshot, **outer)
        self.group = group  # None: one process, the average is the replica itself
        self.feedback: dict[int, torch.Tensor] = {}  # int8 wire: per fragment, the quantization error carried

    def state_dict(self) -> dict[str, Any]:
        streams = self.streams_state()  # first: it waits for the syncs in flight, which update the feedback
        feedback = {"feedback": {f: e.clone() for f, e in self.feedback.items()}} if self.feedback else {}
        return {
            "steps": self.steps,
            "snapshot": {n: s.detach().clone() for n, s in zip(self.names, self.snapshot)},
            "outer_optimizer": self.outer.state_dict(),
            "in_flight": [],
            **streams,
            **feedback,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly; the outer optimizer keeps this run's options (lr, momentum, nesterov)."""
        expected = {"steps", "snapshot", "outer_optimizer"}
        if not expected <= set(state) <= expected | {"in_flight", "merged", "feedback"}:
            raise ValueError(
                f"diloco state must have keys {sorted(expected)} (and 'in_flight', 'feedback'), got {sorted(state)}"
            )
        missing = [n for n in self.names if n not in state["snapshot"]]
        if missing:
            raise ValueError(f"diloco state has no snapshot of {missing[0]!r}: was it saved with other fragments?")
        self.load_streams(state)
        self.feedback = {int(f): e.clone() for f, e in state.get("feedback", {}).items()}
        self.count.load_state_dict(state)
        with torch.no_grad():
            for n, s in zip(self.names, self.snapshot):
                s.copy_(state["snapshot"][n])
        options = [{k: g[k] for k in ("lr", "momentum", "nesterov")} for g in self.outer.param_groups]
        self.outer.load_state_dict(state["outer_optimizer"])
        for group, values in zip(self.outer.param_groups, options):
            group.update(values)
