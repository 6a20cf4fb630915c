"""The one dispatcher: every event of a training step reaches the algorithm from here.

For one synchronized training step the events fire in this order:

1. ``before_forward``  — the wrapper's forward, before the module runs
2. ``after_forward``   — the wrapper's forward, with the output
3. ``sync_gradients``, ``gradient_group``, ``grad_scale`` — asked by the engine
   once, at the first gradient of the backward pass
4. ``reduce_bucket``   — by the engine, for each complete bucket, in bucket order
5. ``after_backward``  — by the engine, once every bucket is reduced (at the end
   of backward, or later for algorithms that defer completion)
6. ``after_step``      — after each registered optimizer's ``step()``, once the
   replica has counted it (``replica.step_ended``)

and, on the user's calls: ``end_epoch`` (``model.end_epoch``), ``flush``
(``eval()``, ``state_dict()``, before a switch), ``average`` (``model.average()``,
before a switch), ``teardown`` (a switch, ``close()``). ``setup`` runs when the
dispatcher is built.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .algorithms.contract import Algorithm, State
from .engine.buckets import Bucket
from .engine.comm import Waitable
from .replica import Replica


class Dispatcher:
    """Fires one algorithm's events for one replica; the gradient engine asks it its questions too.

    Args:
        algorithm: the configured algorithm.
        replica: what the algorithm sees of the model.

    Example::

        events = Dispatcher(unison.algorithms.create("local_sgd"), replica)
        events.after_step(optimizer)
    """

    def __init__(self, algorithm: Algorithm[Any], replica: Replica) -> None:
        self.algorithm = algorithm
        self.replica = replica
        self.state: Optional[State] = algorithm.setup(replica)

    # ---- forward ----------------------------------------------------------------
    def before_forward(self) -> None:
        self.algorithm.before_forward(self.replica, self.state)

    def after_forward(self, output: Any) -> None:
        self.algorithm.after_forward(self.replica, self.state, output)

    # ---- the gradient engine's questions ----------------------------------------------
    def gradient_group(self) -> Optional[dist.ProcessGroup]:
        return self.algorithm.gradient_group(self.replica, self.state)

    def sync_gradients(self) -> bool:
        return self.algorithm.reduces_gradients and self.algorithm.sync_gradients(self.replica, self.state)

    def grad_scale(self, world_size: int) -> float:
        return self.algorithm.grad_scale(self.replica, self.state, world_size)

    def lets_buckets_go(self) -> bool:
        return self.algorithm.stops_gradient_sync

    def reduce_bucket(self, bucket: Bucket, group: Optional[dist.ProcessGroup]) -> Optional[Waitable]:
        return self.algorithm.reduce_bucket(self.replica, self.state, bucket, group)

    def bucket_wire_bytes(self, bucket: Bucket, world_size: int) -> int:
        return self.algorithm.bucket_wire_bytes(self.replica, self.state, bucket, world_size)

    def after_backward(self) -> None:
        self.algorithm.after_backward(self.replica, self.state)

    # ---- step, epoch and the user's calls ----------------------------------------------
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.algorithm.after_step(self.replica, self.state, optimizer)

    def end_epoch(self, loss: Optional[float], averaged: bool = False) -> None:
        self.algorithm.end_epoch(self.replica, self.state, loss, averaged)

    def flush(self) -> None:
        self.algorithm.flush(self.replica, self.state)

    def average(self) -> None:
        self.algorithm.average(self.replica, self.state)

    def release(self) -> None:
        """The wrapper is gone without ``close()``: stop local activity, no collective."""
        self.algorithm.release(self.replica, self.state)

    def teardown(self) -> None:
        """The algorithm leaves: finish its work, release its threads (the wrapper removes its hooks)."""
        self.algorithm.flush(self.replica, self.state)
        self.algorithm.teardown(self.replica, self.state)

    # ---- state ----------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        return self.state.bytes_sent if self.state is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict() if self.state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.state is not None:
            self.state.load_state_dict(state)
        elif state:
            raise ValueError(f"algorithm {self.algorithm.name!r} keeps no state but was given {sorted(state)}")
