"""QAdam: Adam whose momentum, not its gradient, is averaged in 8 bits after a warm-up.

It runs with its own optimizer, ``unison.optim.QAdamOptimizer``:

* warm-up (the optimizer has taken fewer than ``warmup_steps`` steps): each
  bucket is averaged in full precision and the optimizer is plain Adam,
  learning the variance ``exp_avg_sq`` from the averaged gradients;
* after it: the variance is frozen. Each rank folds its local gradient into
  the momentum, ``m = beta1 * m + (1 - beta1) * g_local``, and the ranks'
  momenta are averaged with bytegrad's 8-bit exchange (every rank decodes the
  same bytes, so all end with the same momentum). What is quantized is each
  momentum divided by the frozen Adam denominator, so the rounding error is
  on the scale of the update rather than amplified by a small variance. The
  averaged momentum replaces ``m`` and is written into the gradients, which
  the optimizer then takes as its ``exp_avg``.

The momentum is kept flat per bucket (``FlatState``), seeded from the
optimizer's ``exp_avg`` when the warm-up ends, and saved in DataParallel's
state dict; the optimizer's state (variance, step count) is in its own.
"""

from __future__ import annotations

import math
from typing import Any, Union

import torch
import torch.distributed as dist

from ..buckets import split
from ..comm import start
from .base import Algorithm
from .bytegrad import Exchange, bucket_exchange, wire_bytes_8bit
from .state import FlatState


#: Elements per 8-bit quantization chunk (as bytegrad's default).
CHUNK_SIZE = 1024


class QAdam(Algorithm):
    """8-bit momentum averaging for ``QAdamOptimizer``; it has no options (the optimizer holds them)."""

    name = "qadam"
    defaults: dict[str, Any] = {}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.optimizer = None
        self.momentum = FlatState()
        self._seeded: set[str] = set()
        self._compressing = False
        self._exchanges: dict[int, Exchange] = {}
        self._denominators: dict[int, tuple] = {}
        self.group = None
        self.thread = None

    def setup(self, model) -> None:
        """Find the model's one QAdamOptimizer and open the 8-bit exchange's thread and group."""
        from ..optim import QAdamOptimizer

        found = [opt for opt in model.optimizers if isinstance(opt, QAdamOptimizer)]
        if len(found) != 1:
            raise ValueError(
                f"qadam needs exactly one unison.optim.QAdamOptimizer holding the model's parameters, found {len(found)}; "
                "pass it as DataParallel(module, optimizer=unison.optim.QAdamOptimizer(module.parameters()), algorithm='qadam')"
            )
        self.optimizer = found[0]
        if model.module is not None:
            held = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            missing = [n for n, p in model.module.named_parameters() if p.requires_grad and id(p) not in held]
            if missing:
                raise ValueError(
                    f"qadam turns every gradient into momentum, so the QAdamOptimizer must hold every trainable "
                    f"parameter; it does not hold {missing[0]!r}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                )
        if model.process_group is not None and model.world_size > 1:
            self.open_thread(model)


    def reduce_bucket(self, bucket, group):
        world = dist.get_world_size(group)
        self._compressing = world > 1 and not self.optimizer.warming_up and bucket.flat.numel() > 0
        if not self._compressing:
            return start(dist.all_reduce, bucket.flat, group=group)
        if bucket.flat.dtype != torch.float32:
            raise TypeError(f"qadam averages float32 momenta; bucket {bucket.index} holds {bucket.flat.dtype}")
        momentum = self.momentum.get(bucket)
        self._seed(bucket, momentum)
        # bucket.flat holds g_local / world: make it m_local / world, whose sum over ranks is the average.
        beta1 = self._beta1(bucket)
        if isinstance(beta1, float):
            bucket.flat.mul_(1 - beta1).add_(momentum, alpha=beta1 / world)
        else:
            bucket.flat.mul_(1 - beta1).addcmul_(momentum, beta1, value=1.0 / world)
        denom, inverse = self._denominator(bucket)
        bucket.flat.mul_(inverse)  # 0 where the denominator is 0
        self.optimizer.grads_hold_momentum = True
        return self.thread.submit(self._exchange, bucket, momentum, denom, world)

    def _exchange(self, bucket, momentum: torch.Tensor, denom: torch.Tensor, world: int) -> torch.Tensor:
        """On the CommThread: average the momenta in 8 bits; all ranks keep the same result.

        What travels is each rank's momentum divided by the frozen Adam
        denominator, i.e. its update direction: averaging commutes with that
        division (the denominator is the same on every rank), and the 8-bit
        rounding error then lands on the update's scale. Sent raw, the error
        of a coordinate with a tiny variance would be divided by that tiny
        variance in the optimizer and blow the parameter up.
        """
        bucket_exchange(self._exchanges, bucket, world, CHUNK_SIZE).run(bucket.flat, self.group)
        bucket.flat.mul_(denom)
        momentum.copy_(bucket.flat)
        return bucket.flat

    def _denominator(self, bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The optimizer's frozen ``sqrt(exp_avg_sq_hat) + eps`` laid out like the bucket, and its inverse.

        It is 0 where the variance is 0 (inverse 0 too): the optimizer never
        moves those coordinates after the warm-up, so their momentum is sent
        and kept as 0. The variance is frozen, so both are computed once per
        bucket and reused while the optimizer holds the same variance tensors
        and settings (a reloaded optimizer state is noticed and recomputed).
        """
        key = self._denominator_key(bucket)
        cached = self._denominators.get(bucket.index)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        denom = self._compute_denominator(bucket)
        inverse = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
        self._denominators[bucket.index] = (key, denom, inverse)
        return denom, inverse

    def _denominator_key(self, bucket) -> tuple:
        """What the denominator depends on: the variance tensors (by identity), eps, beta2, warm-up length."""
        settings = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        parts = []
        for p in bucket.params:
            variance = self.optimizer.state.get(p, {}).get("exp_avg_sq")
            group = settings[id(p)]
            parts.append((id(variance), None if variance is None else variance._version, group["eps"], group["betas"][1]))
        return (tuple(parts), self.optimizer.warmup_steps)

    def _compute_denominator(self, bucket) -> torch.Tensor:
        settings = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        out = torch.empty_like(bucket.flat)
        for view, p in zip(split(out, bucket.views), bucket.params):
            group = settings[id(p)]
            variance = self.optimizer.state.get(p, {}).get("exp_avg_sq")
            if variance is None:
                view.zero_()
                continue
            correction = 1 - group["betas"][1] ** self.optimizer.warmup_steps
            torch.sqrt(variance, out=view).div_(math.sqrt(correction)).add_(group["eps"])
            view.masked_fill_(variance == 0, 0.0)
        return out

    def _seed(self, bucket, momentum: torch.Tensor) -> None:
        """At the end of warm-up, start each parameter's momentum from the optimizer's exp_avg."""
        fresh = [i for i, name in enumerate(bucket.names) if name not in self._seeded]
        if not fresh:
            return
        views = split(momentum, bucket.views)
        for i in fresh:
            exp_avg = self.optimizer.state.get(bucket.params[i], {}).get("exp_avg")
            if exp_avg is not None:
                views[i].copy_(exp_avg)
            self._seeded.add(bucket.names[i])

    def _beta1(self, bucket) -> Union[float, torch.Tensor]:
        """The optimizer's beta1 for the bucket: one number, or per element when groups differ."""
        by_param = {id(p): group["betas"][0] for group in self.optimizer.param_groups for p in group["params"]}
        betas = [float(by_param[id(p)]) for p in bucket.params]
        if all(b == betas[0] for b in betas):
            return betas[0]
        out = torch.empty_like(bucket.flat)
        for view, b in zip(split(out, bucket.views), betas):
            view.fill_(b)
        return out

    def bucket_wire_bytes(self, bucket, world_size: int) -> int:
        if self._compressing:
            return wire_bytes_8bit(bucket.flat.numel(), world_size, CHUNK_SIZE)
        return super().bucket_wire_bytes(bucket, world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum.state_dict()} if self._seeded else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"momentum"})
        if unknown:
            raise ValueError(f"qadam state has unknown entries {unknown}; expected 'momentum'")
        momentum = state.get("momentum", {})
        self.momentum.load_state_dict(momentum)
        self._seeded = set(momentum)
