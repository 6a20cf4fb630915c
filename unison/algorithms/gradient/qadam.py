"""QAdam: Adam whose momentum, not its gradient, is averaged in 8 bits after a warm-up.

It runs with its own optimizer, ``unison.QAdamOptimizer``: during the warm-up
buckets are averaged in full precision and the optimizer is plain Adam; after
it the variance is frozen, each rank folds its gradient into its momentum, and
the momenta (divided by the frozen Adam denominator) are averaged with
bytegrad's 8-bit exchange (with ``hierarchical=True``: summed in full precision
inside the node, each shard across nodes in 8 bits). See docs/algorithms.md#qadam.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist

from ...engine.buckets import Bucket, split
from ...engine.comm import CommThread, Waitable, ring_bytes, start
from ...engine.flatstate import FlatState
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import Algorithm, ThreadedState, open_thread
from .bytegrad import bucket_exchange, exchange_cross, wire_bytes_8bit
from .qadam_optimizer import QAdamOptimizer, beta1_like

#: Values per 8-bit quantization chunk (as bytegrad's default).
CHUNK_SIZE = 1024


class QAdamState(ThreadedState):
    """The optimizer, the flat momenta (saved), the buckets' exchanges and denominators, group and thread."""

    __slots__ = ("optimizer", "momentum", "seeded", "compressing", "exchanges", "denominators", "levels")

    def __init__(
        self, optimizer: QAdamOptimizer, group: Optional[dist.ProcessGroup] = None, thread: Optional[CommThread] = None
    ) -> None:
        super().__init__(group, thread)
        self.levels: Optional[TwoLevel] = None  # with hierarchical=True (its thread is the state's)
        self.optimizer = optimizer
        self.momentum = FlatState()
        self.seeded: set[str] = set()  # parameters whose momentum started from the optimizer's exp_avg
        self.compressing = False  # whether the last bucket launched went through the 8-bit exchange
        self.exchanges: dict[int, Any] = {}
        self.denominators: dict[int, tuple[Any, ...]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum.state_dict()} if self.seeded else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"momentum"})
        if unknown:
            raise ValueError(f"qadam state has unknown entries {unknown}; expected 'momentum'")
        momentum = state.get("momentum", {})
        self.momentum.load_state_dict(momentum)
        self.seeded = set(momentum)


class QAdam(Algorithm[QAdamState]):
    """8-bit momentum averaging for ``QAdamOptimizer`` (the optimizer holds the hyperparameters).

    Args:
        hierarchical: average inside each node in full precision, each
            process's shard of the node's momenta across nodes in 8 bits.

    Example::

        opt = unison.QAdamOptimizer(net.parameters(), lr=1e-3, warmup_steps=100)
        model = unison.DataParallel(net, optimizer=opt, algorithm="qadam")
    """

    name = "qadam"
    #: It reduces its momentum, compressed per bucket: sparse gradients (nn.Embedding(sparse=True)) are refused at construction.
    sparse_gradients: ClassVar[bool] = False
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.boolean("hierarchical", self.hierarchical)
        super().__post_init__()

    def setup(self, replica: Replica) -> QAdamState:
        found = [opt for opt in replica.optimizers if isinstance(opt, QAdamOptimizer)]
        if len(found) != 1:
            raise ValueError(
                f"qadam needs exactly one unison.optim.QAdamOptimizer holding the model's parameters, found {len(found)}; "
                "pass it as DataParallel(module, optimizer=unison.optim.QAdamOptimizer(module.parameters()), algorithm='qadam')"
            )
        held = {id(p) for group in found[0].param_groups for p in group["params"]}
        missing = [n for n, p in replica.trainable if id(p) not in held]
        if missing:
            raise ValueError(
                f"qadam turns every gradient into momentum, so the QAdamOptimizer must hold every trainable "
                f"parameter; it does not hold {missing[0]!r}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )
        h = (
            TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True)
            if self.hierarchical
            else None
        )
        state = QAdamState(found[0], *(open_thread(replica, self.name) if replica.distributed and h is None else ()))
        if h is not None:
            state.levels, state.thread, h.thread = h, h.thread, None  # the levels' thread is the state's
        return state

    def reduce_bucket(
        self, replica: Replica, state: QAdamState, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        world, opt = dist.get_world_size(group), state.optimizer
        state.compressing = world > 1 and not opt.warming_up and bucket.flat.numel() > 0
        h = state.levels
        if not state.compressing:
            if h is None:
                return start(dist.all_reduce, bucket.flat, group=group)
            return state.running_thread().submit(h.run, bucket.flat, h.allreduce)
        if bucket.flat.dtype != torch.float32:
            raise TypeError(f"qadam averages float32 momenta; bucket {bucket.index} holds {bucket.flat.dtype}")
        momentum = state.momentum.get(bucket)
        _seed(state, bucket, momentum)
        # bucket.flat holds g_local / world: make it m_local / world, whose sum over ranks is the average.
        beta1 = beta1_like(opt, bucket)
        if isinstance(beta1, float):
            bucket.flat.mul_(1 - beta1).add_(momentum, alpha=beta1 / world)
        else:
            bucket.flat.mul_(1 - beta1).addcmul_(momentum, beta1, value=1.0 / world)
        denom, inverse = _denominator(state, bucket)
        bucket.flat.mul_(inverse)  # 0 where the denominator is 0
        opt.grads_hold_momentum = True
        reduce: Callable[[torch.Tensor], Any]
        if h is None:
            reduce = partial(bucket_exchange(state.exchanges, bucket, world, CHUNK_SIZE).run, group=state.group)
        else:
            ex = bucket_exchange(state.exchanges, bucket, h.nodes, CHUNK_SIZE, h.shard_numel(bucket.flat.numel()))
            reduce = partial(h.run, cross=partial(exchange_cross, h, ex, None))
        return state.running_thread().submit(_average, reduce, bucket.flat, momentum, denom)

    def bucket_wire_bytes(self, replica: Replica, state: QAdamState, bucket: Bucket, world_size: int) -> int:
        h, n = state.levels, bucket.flat.numel()
        if h is not None:
            shard, nodes = h.shard_numel(n), h.nodes
            full = ring_bytes(shard * bucket.flat.element_size(), nodes)  # the warm-up's
            return h.wire_bytes(bucket.flat, wire_bytes_8bit(shard, nodes, CHUNK_SIZE) if state.compressing else full)
        if state.compressing:
            return wire_bytes_8bit(n, world_size, CHUNK_SIZE)
        return super().bucket_wire_bytes(replica, state, bucket, world_size)


def _average(
    reduce: Callable[[torch.Tensor], Any], flat: torch.Tensor, momentum: torch.Tensor, denom: torch.Tensor
) -> torch.Tensor:
    """On the CommThread: average the update directions in 8 bits, then turn them back into momenta.

    Dividing by the frozen denominator (the same on every rank) commutes with
    averaging and puts the rounding error on the update's scale (see docs).
    """
    reduce(flat)  # the Exchange, or the two levels with the Exchange across nodes
    flat.mul_(denom)
    momentum.copy_(flat)
    return flat


def _denominator(state: QAdamState, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimizer's frozen ``sqrt(exp_avg_sq_hat) + eps`` laid out like the bucket, and its inverse.

    Both are 0 where the variance is 0 (those coordinates never move after
    the warm-up). Computed once per bucket while the optimizer holds the same
    variance tensors and settings (a reloaded optimizer state is noticed).
    """
    opt = state.optimizer
    settings = {id(p): group for group in opt.param_groups for p in group["params"]}
    variances = [opt.state.get(p, {}).get("exp_avg_sq") for p in bucket.params]
    key = (
        tuple(
            (id(v), None if v is None else v._version, settings[id(p)]["eps"], settings[id(p)]["betas"][1])
            for v, p in zip(variances, bucket.params)
        ),
        opt.warmup_steps,
    )
    cached = state.denominators.get(bucket.index)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    denom = torch.empty_like(bucket.flat)
    for view, p, variance in zip(split(denom, bucket.views), bucket.params, variances):
        if variance is None:
            view.zero_()
            continue
        group = settings[id(p)]
        correction = 1 - group["betas"][1] ** opt.warmup_steps
        torch.sqrt(variance, out=view).div_(math.sqrt(correction)).add_(group["eps"])
        view.masked_fill_(variance == 0, 0.0)
    inverse = torch.where(denom > 0, 1.0 / denom, torch.zeros_like(denom))
    state.denominators[bucket.index] = (key, denom, inverse)
    return denom, inverse


def _seed(state: QAdamState, bucket: Bucket, momentum: torch.Tensor) -> None:
    """At the end of warm-up, start each parameter's momentum from the optimizer's exp_avg."""
    fresh = [i for i, name in enumerate(bucket.names) if name not in state.seeded]
    if not fresh:
        return
    views = split(momentum, bucket.views)
    for i in fresh:
        exp_avg = state.optimizer.state.get(bucket.params[i], {}).get("exp_avg")
        if exp_avg is not None:
            views[i].copy_(exp_avg)
        state.seeded.add(bucket.names[i])
