"""Bagua's ``bagua.torch_api.distributed`` over unison.

``bagua_init`` and ``ModelSwitchWrapper`` wrap the module in a
``unison.DataParallel`` (``wrapper.bagua_module``) running the unison algorithm
of the chosen ``DistributedAlgorithm``; ``switch_to`` switches it in place and
returns the wrapper. Bagua's bucket manager (``Reducer``) and overlap wrapper
(``OverlappingWrapper``) are unison's gradient engine, which scripts never
call. Where behaviour differs from Bagua, ``docs/migration.md`` says so.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Any, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

import unison
from unison.engine.averaging import average_
from unison.engine.comm import default_broadcast

from ..bagua_define import UNISON_ALGORITHM, DistributedAlgorithm

__all__ = ["DistributedModule", "ModelSwitchWrapper", "allreduce_parameters", "bagua_init", "broadcast_parameters"]

MB = 1024 * 1024

#: Bagua's keyword arguments of its algorithms, and the unison option names they may have.
_KWARG_OPTIONS = {
    "peer_selection_mode": ("peer_selection_mode", "peer_selection"),
    "communication_interval": ("communication_interval", "period"),
}
#: Bagua's defaults for its decentralized reducer (``DecentralizedReducer``).
_BAGUA_DEFAULTS = {"decentralized": {"peer_selection_mode": "all", "communication_interval": 1}}

#: Message sizes (bytes) autotuning tries, besides the wrapper's own ``message_size``.
AUTOTUNE_MESSAGE_SIZES = (1_000_000, 4_000_000, 10_000_000, 25_000_000, 64_000_000)
#: Training steps between two automatic reports under ``BAGUA_AUTOTUNE`` (Bagua's cycle).
AUTOTUNE_CYCLE = 100


def _option_name(key: str, defaults: dict) -> Optional[str]:
    """The name under which a unison algorithm with ``defaults`` takes Bagua's keyword ``key`` (None: it has none)."""
    for name in _KWARG_OPTIONS.get(key, (key,)):
        if name in defaults:
            return name
    return None


def _member(algorithm: Any) -> Union[DistributedAlgorithm, unison.algorithms.Algorithm]:
    if isinstance(algorithm, (DistributedAlgorithm, unison.algorithms.Algorithm)):
        return algorithm
    if isinstance(algorithm, str):
        return DistributedAlgorithm.from_str(algorithm)
    raise TypeError(
        f"distributed_algorithm must be a DistributedAlgorithm or its value, not {type(algorithm).__name__}"
    )


def _autotune_level() -> int:
    """Bagua's ``BAGUA_AUTOTUNE`` level (0: off)."""
    try:
        return int(os.environ.get("BAGUA_AUTOTUNE", "0") or 0)
    except ValueError:
        return 0


class DistributedModule(nn.Module):
    """A base class for a distributed module: it holds the module it wraps.

    Args:
        module: the module to wrap.

    Example::

        >>> model, optimizer = bagua_init(net, optimizer)
        >>> model.unwrap() is net
        True
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> nn.Module:
        """The wrapped module."""
        return self.module

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*inputs, **kwargs)


class ModelSwitchWrapper(DistributedModule):
    """Bagua's module wrapper whose distributed algorithm can change during training.

    Nothing is distributed until ``switch_to`` (``bagua_init`` calls it): the
    first call wraps the module in a ``unison.DataParallel`` (rank 0's
    parameters and buffers are broadcast), later calls average the replicas
    (parameters by ``DataParallel.switch_to``, buffers averaged first, as
    Bagua's ``allreduce_parameters``) and switch algorithm in place.

    Args:
        module: the model (Bagua's own example passes it as ``model=``, which
            is accepted too).
        optimizer: an optimizer or a list of them.
        broadcast_buffers: keep buffers equal to rank 0's after every
            synchronized backward (unison's meaning: Bagua broadcasts them once
            at the start; unison always does that).
        delay_reduce: reduce after backward instead of overlapping it.
        hierarchical_reduce: the node first (reduce-scatter inside each
            node, each shard across nodes by the algorithm's scheme: 8 bits
            for ``QuantizeAllReduce``, a gossip between nodes for
            ``Decentralize``; all-gather inside the node); on a single node
            it runs flat. None: Bagua's default, False for
            ``GradientAllReduce`` and True for the others.
        message_size: the minimum bytes of a gradient bucket (a bucket closes
            once it holds this much; the first is at most 1 MiB so the first
            reduction starts early). No effect on ``Decentralize``, which
            exchanges weights, not gradient buckets.
        intra_comm_root_rank: the local rank of each node's leader in Bagua's
            hierarchical reduction. unison's has no leader (every local rank
            carries its shard across nodes), so it has no effect; it must
            still be a local rank.
        **kwargs: options of the algorithms, kept for the stages that use them:
            ``peer_selection_mode`` ("all", "shift_one" or unison's "ring") and
            ``communication_interval`` of ``Decentralize`` (Bagua's defaults
            "all" and 1), and any option of the unison algorithms behind the
            members (``error_feedback`` of "bytegrad", ...). Any other keyword
            is refused.

    Attributes: ``bagua_module`` (the ``unison.DataParallel``, None before the
    first ``switch_to``), ``distributed_algorithm``, ``stage``, ``step_counter``,
    ``score_record_list``, ``autotune_flag``.

    Example::

        >>> model = ModelSwitchWrapper(
        ...     model, optimizer, broadcast_buffers=True, delay_reduce=False,
        ...     hierarchical_reduce=None, message_size=10_000_000,
        ... ).switch_to(DistributedAlgorithm.GradientAllReduce)
        >>> # train A epochs
        >>> model.switch_to(DistributedAlgorithm.Decentralize)
        >>> # train B epochs
        >>> model.switch_to(DistributedAlgorithm.GradientAllReduce)
    """

    def __init__(
        self,
        module: Optional[nn.Module] = None,
        optimizer: Union[torch.optim.Optimizer, List[torch.optim.Optimizer], None] = None,
        broadcast_buffers: bool = True,
        delay_reduce: bool = False,
        hierarchical_reduce: Optional[bool] = None,
        message_size: int = 10_000_000,
        intra_comm_root_rank: int = 0,
        **kwargs: Any,
    ) -> None:
        if module is None and isinstance(kwargs.get("model"), nn.Module):
            module = kwargs.pop("model")  # Bagua's own example writes ModelSwitchWrapper(model=model, ...)
        if not isinstance(module, nn.Module):
            raise TypeError(f"ModelSwitchWrapper wraps an nn.Module, not {type(module).__name__}")
        if optimizer is None:
            raise TypeError("ModelSwitchWrapper(module, optimizer, ...) needs the optimizer(s)")
        super().__init__(module)
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a list of them")
        for name, flag in (("broadcast_buffers", broadcast_buffers), ("delay_reduce", delay_reduce)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if hierarchical_reduce is not None and not isinstance(hierarchical_reduce, bool):
            raise TypeError(f"hierarchical_reduce must be None, True or False, got {hierarchical_reduce!r}")
        if isinstance(message_size, bool) or not isinstance(message_size, int) or message_size < 1:
            raise ValueError(f"message_size must be a positive number of bytes, got {message_size!r}")
        topo = unison.init()
        if (
            isinstance(intra_comm_root_rank, bool)
            or not isinstance(intra_comm_root_rank, int)
            or not 0 <= intra_comm_root_rank < topo.local_world_size
        ):
            raise ValueError(
                f"intra_comm_root_rank must be a local rank, 0 to {topo.local_world_size - 1}, got {intra_comm_root_rank!r}"
            )
        _check_kwargs(kwargs)
        self.optimizers = optimizers
        self.broadcast_buffers = broadcast_buffers
        self.delay_reduce = delay_reduce
        self.hierarchical_reduce = hierarchical_reduce
        self.message_size = message_size
        self.intra_comm_root_rank = intra_comm_root_rank
        self.kwargs = dict(kwargs)
        self.bagua_module: Optional[unison.DataParallel] = None
        self.distributed_algorithm: Union[DistributedAlgorithm, unison.algorithms.Algorithm, None] = None
        self.stage = 0
        self.step_counter = 0
        self.score_record_list: List[float] = []
        self.last_hit_tp = time.time()
        self.autotune_flag = _autotune_level() >= 1
        self._tuner: Optional[_AutoTuner] = None

    # ---- algorithms -------------------------------------------------------
    def switch_to(
        self, distributed_algorithm: Union[DistributedAlgorithm, str] = DistributedAlgorithm.GradientAllReduce
    ) -> "ModelSwitchWrapper":
        """Distribute the module with ``distributed_algorithm`` (a collective: every rank calls it).

        Args:
            distributed_algorithm: a ``DistributedAlgorithm`` member or its value
                (a ``unison.algorithms.Algorithm`` is accepted too).

        Returns:
            this wrapper, now running the algorithm (so ``model =
            ModelSwitchWrapper(...).switch_to(...)`` keeps the model).
        """
        member = _member(distributed_algorithm)
        algorithm = self._unison_algorithm(member)
        if self.bagua_module is None:
            self.bagua_module = unison.DataParallel(
                self.module,
                optimizer=self.optimizers,
                algorithm=algorithm,
                broadcast_buffers=self.broadcast_buffers,
                bucket_cap_mb=self.message_size / MB,
                delay_reduce=self.delay_reduce,
            )
        else:
            # Bagua averages buffers between stages; switch_to averages the parameters.
            _average_state(list(self.module.buffers()))
            self.bagua_module.switch_to(algorithm)
        self.stage += 1
        self.distributed_algorithm = member
        self._tuner = None  # Bagua restarts autotuning at every switch
        return self

    def _unison_algorithm(self, member) -> unison.algorithms.Algorithm:
        """The unison algorithm running ``member`` with this wrapper's settings."""
        if isinstance(member, unison.algorithms.Algorithm):
            return member
        name, hierarchical_default = UNISON_ALGORITHM[member]
        if name not in unison.algorithms.names():
            raise NotImplementedError(
                f"Bagua's {member.name} runs on unison's {name!r} algorithm, which this unison does not have"
            )
        defaults = unison.algorithms.get(name).defaults
        options: dict[str, Any] = {}
        hierarchical = hierarchical_default if self.hierarchical_reduce is None else self.hierarchical_reduce
        if "hierarchical" in defaults:
            options["hierarchical"] = hierarchical
        elif hierarchical:
            gap = f"unison's {name!r} algorithm (Bagua's {member.name}) has no hierarchical mode yet"
            if self.hierarchical_reduce:
                raise NotImplementedError(f"hierarchical_reduce=True: {gap}; pass hierarchical_reduce=False")
            warnings.warn(
                f"{gap}: Bagua's default hierarchical reduction runs flat here (pass hierarchical_reduce=False to say so)",
                stacklevel=3,
            )
            hierarchical = False
        for key, value in {**_BAGUA_DEFAULTS.get(name, {}), **self.kwargs}.items():
            option = _option_name(key, defaults)
            if option is not None:
                options[option] = value
        return unison.algorithms.create(name, **options)

    # ---- the training step -------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the distributed module; under ``BAGUA_AUTOTUNE`` every ``AUTOTUNE_CYCLE``
        training steps also reports the speed and takes the next setting to try."""
        if self.bagua_module is None:
            raise RuntimeError("call switch_to(DistributedAlgorithm...) before the first forward (bagua_init does)")
        if self.module.training and torch.is_grad_enabled():
            if self.autotune_flag and self.step_counter and self.step_counter % AUTOTUNE_CYCLE == 0:
                self.score_record_list.append(AUTOTUNE_CYCLE / max(time.time() - self.last_hit_tp, 1e-9))
                self.report_metrics(self.score_record_list)
                if self.ask_and_update_hyperparameters():
                    self.score_record_list.clear()
                self.last_hit_tp = time.time()
            self.step_counter += 1
        return self.bagua_module(*inputs, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        """The module's state dict (plain keys); pending updates are applied first."""
        if self.bagua_module is not None:
            self.bagua_module.flush()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a state dict of the module (also one saved by torch DDP or ``unison.DataParallel``)."""
        if self.bagua_module is not None:
            return self.bagua_module.load_state_dict(state_dict, strict=strict, assign=assign)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- autotuning ---------------------------------------------------------
    def report_metrics(self, score_record_list: List[float]) -> None:
        """Report the speed (iterations per second) of the current setting: a collective.

        The scores are denoised (the lowest and highest dropped when there are
        at least 3) and averaged, then averaged over the ranks, so every rank
        records the same score for the setting.

        Args:
            score_record_list: this rank's speed measurements since the last update.
        """
        self._autotuner().report(score_record_list)

    def ask_and_update_hyperparameters(self) -> bool:
        """Move to the next bucket size or hierarchical setting to try, or to the best one found.

        Every setting is tried once its score has been reported; at the end the
        best (by the agreed scores) is kept and ``autotune_flag`` turns False.
        The same decision is taken on every rank. A collective when it changes
        the setting.

        Returns:
            True if the setting changed (clear the score list), False otherwise.
        """
        tuner = self._autotuner()
        changed = tuner.ask()
        if tuner.finished:
            self.autotune_flag = False
        return changed

    def _autotuner(self) -> "_AutoTuner":
        if self.bagua_module is None:
            raise RuntimeError("call switch_to(...) before autotuning")
        if self._tuner is None:
            self._tuner = _AutoTuner(self, self.bagua_module)
        return self._tuner

    def _apply_setting(self, message_size: int, hierarchical: Optional[bool]) -> None:
        """Run the current algorithm with another bucket size and hierarchical setting (a collective
        when the hierarchical setting changes: that needs a new algorithm)."""
        dp = self.bagua_module
        assert dp is not None  # the autotuner that calls this exists only after switch_to
        self.message_size = message_size
        dp.set_bucket_size(message_size / MB)
        if hierarchical is not None and hierarchical != dp.algorithm.options.get("hierarchical"):
            options = {**dp.algorithm.options, "hierarchical": hierarchical}
            dp.switch_to(unison.algorithms.create(dp.algorithm.name, **options))
        if hierarchical is not None:
            self.hierarchical_reduce = hierarchical


class _AutoTuner:
    """Bagua's autotuning loop, driven by the speeds the user reports.

    Settings are (message size, hierarchical). The message sizes of
    ``AUTOTUNE_MESSAGE_SIZES`` are tried in turn for gradient algorithms, then
    the hierarchical setting is flipped at the best size (when the algorithm
    has one), then the best setting is kept. Scores are agreed across ranks
    when reported, so every rank takes the same decisions.
    """

    def __init__(self, wrapper: ModelSwitchWrapper, model: unison.DataParallel) -> None:
        self.wrapper = wrapper
        self.model = model  # the wrapper's bagua_module: the same from one switch_to to the next
        algorithm = model.algorithm
        hierarchical = algorithm.options.get("hierarchical")
        self.can_flip = isinstance(hierarchical, bool)
        sizes = [wrapper.message_size]
        if algorithm.reduces_gradients:  # model averaging has no gradient buckets to size
            sizes = sorted({wrapper.message_size, *AUTOTUNE_MESSAGE_SIZES})
        self.current = (wrapper.message_size, hierarchical)
        self.queue = [(s, hierarchical) for s in sizes if s != wrapper.message_size]
        self.flipped = not self.can_flip
        self.scores: dict[tuple, float] = {}
        self.finished = not self.queue and self.flipped

    def report(self, score_record_list: List[float]) -> None:
        scores = [float(s) for s in score_record_list]
        if len(scores) >= 3:
            scores = sorted(scores)[1:-1]
        value = statistics.fmean(scores) if scores else 0.0
        dp = self.model
        if dist.is_available() and dist.is_initialized() and dp.process_group is not None:
            t = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(t, group=dp.process_group)
            value = t.item() / dist.get_world_size(dp.process_group)
        self.scores[self.current] = value

    def best(self) -> tuple:
        return max(self.scores, key=lambda setting: self.scores[setting])

    def ask(self) -> bool:
        if self.finished or self.current not in self.scores:
            return False
        if self.queue:
            return self._go(self.queue.pop(0))
        if not self.flipped:
            self.flipped = True
            size, hierarchical = self.best()
            if (size, not hierarchical) not in self.scores:
                return self._go((size, not hierarchical))
        self.finished = True
        best = self.best()
        return best != self.current and self._go(best)

    def _go(self, setting: tuple) -> bool:
        self.wrapper._apply_setting(*setting)
        self.current = setting
        return True


def _check_kwargs(kwargs: dict) -> None:
    """Refuse keywords no algorithm behind a Bagua member takes (they would be ignored)."""
    names = {name for name, _ in UNISON_ALGORITHM.values() if name in unison.algorithms.names()}
    options = set().union(*(unison.algorithms.get(n).defaults for n in names)) - {"hierarchical"}
    unknown = sorted(k for k in kwargs if k not in _KWARG_OPTIONS and k not in options)
    if unknown:
        allowed = ", ".join(sorted(set(_KWARG_OPTIONS) | options))
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; the algorithms take {allowed} (hierarchical: use hierarchical_reduce)"
        )


def broadcast_parameters(module: nn.Module, broadcast_buffers: bool = True) -> None:
    """Give every rank rank 0's parameters (and buffers): a collective.

    Args:
        module: the module whose state is broadcast in place.
        broadcast_buffers: also broadcast the buffers (the module's whole state dict).

    Example::

        >>> broadcast_parameters(net)      # before training, on every rank
    """
    unison.init()
    if dist.is_available() and dist.is_initialized():
        tensors = list(module.state_dict().values()) if broadcast_buffers else list(module.parameters())
        default_broadcast(tensors, None)


def allreduce_parameters(module: nn.Module) -> None:
    """Average the parameters and buffers over all ranks (integer buffers: floor of the mean): a collective.

    Args:
        module: the module whose state is averaged in place.

    Example::

        >>> allreduce_parameters(net)      # replicas identical again
    """
    unison.init()
    _average_state(list(module.state_dict().values()))


def _average_state(tensors: List[torch.Tensor]) -> None:
    """Average ``tensors`` in place over the world: floating-point ones by the engine's coalesced
    ``average_``; integer ones (BatchNorm's batch counts), which it does not take, as the floor of the mean."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    floats = [t for t in tensors if t.is_floating_point() or t.is_complex()]
    integers = [t for t in tensors if not (t.is_floating_point() or t.is_complex())]
    if floats:
        average_(floats, None)
    world = dist.get_world_size()
    with torch.no_grad():
        for t in integers:
            dist.all_reduce(t)
            t.copy_(torch.div(t, world, rounding_mode="floor"))


def bagua_init(
    module: nn.Module,
    optimizer: Union[torch.optim.Optimizer, List[torch.optim.Optimizer]],
    distributed_algorithm: Union[DistributedAlgorithm, str] = DistributedAlgorithm.GradientAllReduce,
    broadcast_buffers: bool = True,
    delay_reduce: bool = False,
    hierarchical_reduce: Optional[bool] = None,
    message_size: int = 10_000_000,
    **kwargs: Any,
):
    """Wrap ``module`` for distributed training with a Bagua algorithm: a collective.

    Args:
        module: the model.
        optimizer: an optimizer or a list of them (returned unchanged).
        distributed_algorithm: a ``DistributedAlgorithm`` member or its value.
        broadcast_buffers, delay_reduce, hierarchical_reduce, message_size,
        **kwargs: as for ``ModelSwitchWrapper``.

    Returns:
        ``(model, optimizer)``: a ``ModelSwitchWrapper`` running the algorithm,
        and the optimizer.

    Example::

        >>> model, optimizer = bagua_init(model, optimizer, broadcast_buffers=True)
    """
    model = ModelSwitchWrapper(
        module,
        optimizer,
        broadcast_buffers=broadcast_buffers,
        delay_reduce=delay_reduce,
        hierarchical_reduce=hierarchical_reduce,
        message_size=message_size,
        **kwargs,
    ).switch_to(distributed_algorithm)
    return model, optimizer
