"""What ``Algorithm.setup`` builds: the per-model state, with its fields declared once."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ..engine import comm


class State:
    """Base of an algorithm's per-model state: what ``setup`` returns.

    Subclasses declare their fields once, in ``__slots__``, call
    ``super().__init__()``, and override ``state_dict``/``load_state_dict`` when a
    checkpoint keeps something (the default keeps nothing and refuses entries).
    """

    __slots__ = ("bytes_sent",)

    def __init__(self) -> None:
        #: Bytes the algorithm sent itself (weights, pseudo-gradients), apart from gradient buckets.
        self.bytes_sent = 0

    @property
    def shared_rounds(self) -> int:
        """Rounds of shared state completed (fault tolerance heals a member that completed fewer
        than another at the same step); 0 where the algorithm has none."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps nothing in a checkpoint but was given {sorted(state)}")

    def close(self) -> None:
        """Release threads (the algorithm is leaving); nothing by default."""


class ThreadedState(State):
    """A state whose reductions run several dependent collectives on a ``CommThread`` over a
    private group (``open_thread``); ``close`` stops the thread."""

    __slots__ = ("group", "thread")

    def __init__(self, group: Optional[dist.ProcessGroup] = None, thread: Optional[comm.CommThread] = None) -> None:
        super().__init__()
        self.group, self.thread = group, thread

    def running_thread(self) -> comm.CommThread:
        """The thread (only a distributed replica has one: it reduces nothing alone)."""
        if self.thread is None:
            raise RuntimeError(f"{type(self).__name__} has no communication thread: the replica is alone or closed")
        return self.thread

    def close(self) -> None:
        if self.thread is not None:
            self.thread.close()
            self.thread = None
