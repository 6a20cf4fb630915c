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
from ...engine.codecs import WHOLE, schedule_for
from ...engine.comm import CommThread, Waitable, ring_bytes, start
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import Algorithm, Recovery, ThreadedState, open_thread
from .bytegrad import bucket_exchange, exchange_cross, wire_bytes_8bit
from .qadam_optimizer import QAdamOptimizer, beta1_like

#: Values per 8-bit quantization chunk (as bytegrad's default).
CHUNK_SIZE = 1024
#: The most values a denominator is computed over at once (4 MiB of float32).
PIECE = 1 << 20


class QAdamState(ThreadedState):
    """The optimizer, the buckets' exchanges, group and thread.

    It keeps no momentum of its own: after every 8-bit step the optimizer's
    ``exp_avg`` is the averaged momentum (the gradient it copies), so the next
    step reads it there; and no denominators: they are computed a piece at a time
    from the frozen ``exp_avg_sq`` where they are used (the same values, the same
    bits). Its memory is the exchanges' message buffers only (about 0.1 P).
    """

    __slots__ = ("optimizer", "compressing", "exchanges", "levels")

    def __init__(
        self, optimizer: QAdamOptimizer, group: Optional[dist.ProcessGroup] = None, thread: Optional[CommThread] = None
    ) -> None:
        super().__init__(group, thread)
        self.levels: Optional[TwoLevel] = None  # with hierarchical=True (its thread is the state's)
        self.optimizer = optimizer
        self.compressing = False  # whether the last bucket launched went through the 8-bit exchange
        self.exchanges: dict[int, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {}  # the momentum is the optimizer's exp_avg: its state dict holds it

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Accepts the ``momentum`` entry older versions saved, and ignores it: it was a copy of the
        optimizer's ``exp_avg`` after each step, which the optimizer's own state dict restores."""
        unknown = sorted(set(state) - {"momentum"})
        if unknown:
            raise ValueError(f"qadam state has unknown entries {unknown}; expected none (or an old 'momentum')")


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
    recovery = Recovery()  # its momentum is the optimizer's exp_avg, healed with the optimizer
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
        # bucket.flat holds g_local / world: make it m_local / world, whose sum over ranks is the average
        # (m: the optimizer's exp_avg, which is the last step's averaged momentum; zero where it has none).
        momenta = [opt.state.get(p, {}).get("exp_avg") for p in bucket.params]
        held = [i for i, m in enumerate(momenta) if m is not None]
        beta1 = beta1_like(opt, bucket)
        if isinstance(beta1, float):
            bucket.flat.mul_(1 - beta1)
            torch._foreach_add_([bucket.views[i] for i in held], [momenta[i] for i in held], alpha=beta1 / world)
        else:
            bucket.flat.mul_(1 - beta1)
            betas = split(beta1, bucket.views)
            for i in held:
                bucket.views[i].addcmul_(momenta[i], betas[i], value=1.0 / world)
        _scale(opt, bucket, inverse=True)  # the update direction; 0 where the denominator is 0
        opt.grads_hold_momentum = True
        reduce: Callable[[torch.Tensor], Any]
        if h is None:
            reduce = partial(bucket_exchange(state.exchanges, bucket, world, CHUNK_SIZE).run, group=state.group)
        else:
            ex = bucket_exchange(state.exchanges, bucket, h.nodes, CHUNK_SIZE, h.shard_numel(bucket.flat.numel()))
            reduce = partial(h.run, cross=partial(exchange_cross, h, ex, None))
        return state.running_thread().submit(_average, reduce, opt, bucket)

    def bucket_wire_bytes(self, replica: Replica, state: QAdamState, bucket: Bucket, world_size: int) -> int:
        h, n = state.levels, bucket.flat.numel()
        if h is not None:
            shard, nodes = h.shard_numel(n), h.nodes
            full = ring_bytes(shard * bucket.flat.element_size(), nodes)  # the warm-up's
            return h.wire_bytes(bucket.flat, wire_bytes_8bit(shard, nodes, CHUNK_SIZE) if state.compressing else full)
        if state.compressing:
            return wire_bytes_8bit(n, world_size, CHUNK_SIZE)
        return super().bucket_wire_bytes(replica, state, bucket, world_size)


def _average(reduce: Callable[[torch.Tensor], Any], opt: QAdamOptimizer, bucket: Bucket) -> torch.Tensor:
    """On the CommThread: average the update directions in 8 bits, then turn them back into momenta
    (the gradients the optimizer copies into its exp_avg).

    Dividing by the frozen denominator (the same on every rank) commutes with
    averaging and puts the rounding error on the update's scale (see docs).
    """
    reduce(bucket.flat)  # the Exchange, or the two levels with the Exchange across nodes
    _scale(opt, bucket, inverse=False)
    return bucket.flat


def _scale(opt: QAdamOptimizer, bucket: Bucket, inverse: bool) -> None:
    """Multiply each parameter's part of ``bucket.flat`` by the optimizer's frozen
    ``sqrt(exp_avg_sq_hat) + eps`` (with ``inverse``: by its inverse), 0 where the variance is 0
    (those coordinates never move after the warm-up) or missing.

    Computed where it is used, at most ``PIECE`` values at a time, rather than kept: the
    variance is frozen after the warm-up, so this is the same every step, bit for bit what
    a cached copy held, without keeping two copies of the parameters.
    """
    settings = {id(p): group for group in opt.param_groups for p in group["params"]}
    if schedule_for(bucket.flat.device) == WHOLE and _tiles(bucket):
        _scale_whole(opt, bucket, inverse, settings)
        return
    work = []  # (a piece of the bucket, the same piece of its variance, sqrt(correction), eps)
    for view, p in zip(bucket.views, bucket.params):
        variance = opt.state.get(p, {}).get("exp_avg_sq")
        if variance is None:
            view.mul_(0.0)
            continue
        group = settings[id(p)]
        root_correction = math.sqrt(1 - group["betas"][1] ** opt.warmup_steps)
        work += [(part, v, root_correction, group["eps"]) for part, v in _pieces(view, variance)]
    if not work:
        return
    widest = max(part.numel() for part, *_ in work)
    scratch = bucket.flat.new_empty(widest)  # each piece's denominator in turn
    where = torch.empty(widest, dtype=torch.bool, device=bucket.flat.device)
    for part, v, root_correction, eps in work:
        # The cached version's ops, element for element: d = sqrt(v) / sqrt(correction) + eps, 0 where
        # v is 0; its inverse 1 / d, 0 where d is not positive (v 0 or NaN).
        n, flat_v = part.numel(), v.reshape(-1)
        denom = torch.sqrt(flat_v, out=scratch[:n]).div_(root_correction).add_(eps)
        if inverse:
            mask = torch.gt(flat_v, 0, out=where[:n]).logical_not_()
            denom.reciprocal_()
        else:
            mask = torch.eq(flat_v, 0, out=where[:n])
        part.view(-1).mul_(denom.masked_fill_(mask, 0.0))


def _pieces(view: torch.Tensor, variance: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``view`` and ``variance`` (shaped alike) in matching pieces of at most ``PIECE`` values (whole
    when the variance is not contiguous): what a denominator is computed over at a time."""
    if view.numel() <= PIECE or not (view.is_contiguous() and variance.is_contiguous()):
        return [(view, variance)]
    f, v = view.view(-1), variance.view(-1)
    return [(f[i : i + PIECE], v[i : i + PIECE]) for i in range(0, f.numel(), PIECE)]


def _tiles(bucket: Bucket) -> bool:
    """Whether the bucket's views lie end to end over its whole flat buffer."""
    at = bucket.flat.storage_offset()
    for view in bucket.views:
        if view.storage_offset() != at or not view.is_contiguous():
            return False
        at += view.numel()
    return at == bucket.flat.storage_offset() + bucket.flat.numel()


def _scale_whole(opt: QAdamOptimizer, bucket: Bucket, inverse: bool, settings: dict[int, Any]) -> None:
    """``_scale`` in a fixed number of kernels (not one per parameter and piece, on a GPU): the
    variances copied into one buffer of the bucket's size (0 where missing, which scales by 0 as
    ``_scale`` does), then the same ops on the whole of it."""
    flat = bucket.flat
    variance = torch.zeros_like(flat)
    spans, targets, sources, corrections, eps = [], [], [], [], []
    for view, p in zip(bucket.views, bucket.params):
        at = view.storage_offset() - flat.storage_offset()
        span = variance[at : at + view.numel()]
        group = settings.get(id(p))
        v = opt.state.get(p, {}).get("exp_avg_sq")
        if v is not None and group is not None:
            targets.append(span)
            sources.append(v.reshape(-1))
        spans.append(span)
        group = group or {"betas": (0.0, 0.0), "eps": 0.0}
        corrections.append(math.sqrt(1 - group["betas"][1] ** opt.warmup_steps))
        eps.append(group["eps"])
    if targets:
        torch._foreach_copy_(targets, sources)
    mask = torch.gt(variance, 0).logical_not_() if inverse else torch.eq(variance, 0)
    denom = variance.sqrt_()
    if len(set(corrections)) == 1 and len(set(eps)) == 1:
        denom.div_(corrections[0]).add_(eps[0])
    else:  # parameter groups of different settings: one list op each
        torch._foreach_div_(spans, corrections)
        torch._foreach_add_(spans, eps)
    if inverse:
        denom.reciprocal_()
    flat.mul_(denom.masked_fill_(mask, 0.0))
