"""The optimizer of the "qadam" algorithm: Adam whose variance freezes after a warm-up."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Union

import torch

from ...engine.buckets import Bucket, split


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam that freezes its variance after ``warmup_steps`` steps (the optimizer of "qadam").

    For the first ``warmup_steps`` steps it is Adam (``exp_avg`` and
    ``exp_avg_sq`` follow the gradient). After them ``exp_avg_sq`` stays as it
    was and only the momentum moves, with the bias-corrected update
    ``p -= lr * exp_avg_hat / (sqrt(exp_avg_sq_hat) + eps)``, where
    ``exp_avg_sq_hat`` is corrected for the step at which it froze.

    Under the "qadam" algorithm the post-warm-up gradients are already the
    momentum (each rank's momentum, averaged in 8 bits), and the algorithm
    sets ``grads_hold_momentum`` for the step that follows; otherwise (one
    process, or another algorithm) the momentum is computed here from the
    gradient.

    A coordinate that had no gradient during the whole warm-up (its
    ``exp_avg_sq`` is exactly 0, e.g. a weight into a ReLU unit that never
    fired) has no variance to divide by: after the warm-up it stays where it
    is, instead of taking steps of ``lr / eps`` that would blow it up. Pick a
    warm-up long enough for the variance to be learned.

    ``weight_decay`` is decoupled (as AdamW's): ``p *= 1 - lr * weight_decay``
    before each update, in both phases, so it never passes through the
    compressed momentum.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be a positive integer (the variance is learned during them), got {warmup_steps!r}"
            )
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.warmup_steps = warmup_steps
        self.steps_taken = 0
        self.grads_hold_momentum = False

    @property
    def warming_up(self) -> bool:
        """Whether the next step is a warm-up (plain Adam) step."""
        return self.steps_taken < self.warmup_steps

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warm = self.warming_up
        momentum_given = self.grads_hold_momentum and not warm
        self.grads_hold_momentum = False
        self.steps_taken += 1
        t = self.steps_taken
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            correction1 = 1 - beta1**t
            correction2 = 1 - beta2 ** min(t, self.warmup_steps)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq, grad = state["exp_avg"], state["exp_avg_sq"], p.grad
                if momentum_given:
                    exp_avg.copy_(grad)
                else:
                    exp_avg.lerp_(grad, 1 - beta1)
                if warm:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if wd:
                    p.mul_(1 - lr * wd)
                denom = (exp_avg_sq.sqrt() / math.sqrt(correction2)).add_(eps)
                if not warm:
                    denom.masked_fill_(exp_avg_sq == 0, math.inf)
                p.addcdiv_(exp_avg, denom, value=-lr / correction1)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus the step count (it decides the phase)."""
        return {**super().state_dict(), "qadam_steps": self.steps_taken}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = dict(state_dict)
        if "qadam_steps" not in state:
            raise ValueError("this state dict was not saved by a QAdamOptimizer (it has no 'qadam_steps')")
        steps = state.pop("qadam_steps")
        super().load_state_dict(state)
        self.steps_taken = int(steps)
        self.grads_hold_momentum = False


def beta1_like(opt: QAdamOptimizer, bucket: Bucket) -> Union[float, torch.Tensor]:
    """``opt``'s beta1 for a gradient bucket (the qadam algorithm's): one number, or per element when groups differ."""
    by_param = {id(p): group["betas"][0] for group in opt.param_groups for p in group["params"]}
    betas = [float(by_param[id(p)]) for p in bucket.params]
    if all(b == betas[0] for b in betas):
        return betas[0]
    out = torch.empty_like(bucket.flat)
    for view, b in zip(split(out, bucket.views), betas):
        view.fill_(b)
    return out
