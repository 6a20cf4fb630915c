"""Local SGD (post-local SGD): replicas step on their own and average their
weights every ``period`` optimizer steps, after ``warmup_steps`` steps of
ordinary synchronous gradient averaging.

With ``hierarchical=True`` the processes of a node also average among
themselves every ``local_period`` steps (cheap, over the node's fast link),
and across nodes only every ``period`` steps. Parameters and floating-point
buffers (BatchNorm statistics) are averaged; the optimizers' states stay local.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .. import comm, runtime
from ..averaging import average_
from .base import Algorithm, check_int, require_optimizers


class LocalSGD(Algorithm):
    """Periodic weight averaging after a synchronous warm-up."""

    name = "local_sgd"
    replicas_drift = True
    defaults = {"period": 16, "warmup_steps": 0, "hierarchical": False, "local_period": 2}

    def validate(self) -> None:
        check_int(self.options, "period")
        check_int(self.options, "warmup_steps", minimum=0)
        check_int(self.options, "local_period")
        if not isinstance(self.options["hierarchical"], bool):
            raise ValueError(f"hierarchical must be True or False, got {self.options['hierarchical']!r}")
        if self.options["hierarchical"] and self.options["local_period"] >= self.options["period"]:
            raise ValueError(
                f"local_period ({self.options['local_period']}) must be smaller than period ({self.options['period']}): "
                "nodes average inside more often than across"
            )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps = 0
        self.bytes_sent = 0

    def setup(self, model) -> None:
        require_optimizers(model, self.name)
        self._intra = None
        if self.options["hierarchical"] and model.process_group is not None:
            topo = runtime.topology()
            if topo.world_size != dist.get_world_size() or model.process_group is not dist.group.WORLD:
                raise ValueError("hierarchical local_sgd needs unison.init() and the whole world as its process group")
            self._intra = comm.private_group(topo.intra_node_group, f"{model.serial}/local_sgd/intra")

    def sync_gradients(self, model) -> bool:
        return self.steps < self.options["warmup_steps"]

    def after_step(self, model, optimizer) -> None:
        if optimizer is not model.optimizers[0] or model.process_group is None:
            return
        self.steps += 1
        local_steps = self.steps - self.options["warmup_steps"]
        if local_steps <= 0:
            return
        if local_steps % self.options["period"] == 0:
            self._average(model, model.process_group)
        elif self._intra is not None and local_steps % self.options["local_period"] == 0:
            self._average(model, self._intra)

    def _average(self, model, group) -> None:
        tensors = list(model.module.parameters()) + [b for b in model.module.buffers() if b.is_floating_point()]
        self.bytes_sent += average_(tensors, group)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
