"""Optimizer-side data parallelism: ``DistributedOptimizer``.

It wraps a torch optimizer instead of the model (as Horovod's
DistributedOptimizer and HeAT's DataParallelOptimizer do): gradients of the
optimizer's parameters are averaged during backward by the same engine as
``DataParallel`` (``unison.engine.reducer.GradReducer``), with any gradient
algorithm, and ``step()`` steps the wrapped optimizer. Like DataParallel it
builds a ``Replica`` for the algorithm and fires its events through a ``Dispatcher``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import algorithms as algos
from . import sharded
from .algorithms import support
from .algorithms.gradient.qadam_optimizer import QAdamOptimizer
from .core import (
    ALGORITHM_KEY,
    Core,
    check_bucket_cap,
    check_ranks_agree,
    membership,
    new_tag,
    parameter_entries,
    sparse_parameter,
)
from .engine.comm import default_broadcast
from .engine.reducer import Sync

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]

logger = logging.getLogger("unison")


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose parameters' gradients are averaged across ranks during backward.

    Args:
        optimizer: the torch optimizer to wrap; it keeps its state and hyperparameters.
        named_parameters: ``(name, parameter)`` pairs (``model.named_parameters()``)
            naming the optimizer's parameters in error messages and checkpoints;
            without it they are called ``param.<group>.<index>``.
        backward_passes_per_step: gradients are averaged on every this-many-th
            backward pass and accumulated locally on the others (call ``step()``
            after the averaged one).
        algorithm: a gradient algorithm's name or instance ("allreduce", ...).
        process_group: the group to average over (default: the world).
        bucket_cap_mb: size of a gradient bucket in MiB.
        sparse_params: the parameters that get sparse gradients (the weights of
            ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True``). They
            are summed with a sparse allreduce, outside the buckets; an optimizer
            holding one must name it here (its gradient's layout is known only in
            backward), and an algorithm that cannot take them (bytegrad, powersgd,
            qadam) is refused at construction. See docs/algorithms.md#sparse-gradients.

    At construction every rank checks that all ranks hold the same parameter
    shapes and dtypes, and rank 0's parameter values are broadcast. It is an
    ``Optimizer`` (LR schedulers accept it) that shares the wrapped one's
    ``param_groups``, ``state`` and ``defaults`` rather than copying them.
    Without torch.distributed initialized it only steps the wrapped optimizer.

    Example::

        optimizer = unison.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                                named_parameters=net.named_parameters())
        loss_fn(net(x), y).backward()   # averaged during backward
        optimizer.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[NamedParameters] = None,
        backward_passes_per_step: int = 1,
        algorithm: Union[str, algos.Algorithm] = "allreduce",
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25,
        sparse_params: Iterable[torch.Tensor] = (),
    ) -> None:
        # Optimizer.__init__ is not called: the wrapped optimizer's state is used as it is.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the torch optimizer once")
        steps = backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {steps!r}")
        check_bucket_cap(bucket_cap_mb)
        if any(sharded.is_dtensor(p) for g in optimizer.param_groups for p in g["params"]):
            sharded.refuse_call(
                "DistributedOptimizer",
                "; wrap the sharded module instead: DataParallel(model, device_mesh=mesh['replicate'], optimizer=opt)",
            )
        self.optimizer = optimizer
        self.backward_passes_per_step = steps
        self.bucket_cap_mb = bucket_cap_mb
        self.algorithm = algos.as_algorithm(algorithm)
        if not self.algorithm.reduces_gradients or self.algorithm.defers_completion:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} needs the model's forward (it does not finish averaging gradients "
                "within backward), so DistributedOptimizer cannot run it; wrap the model with unison.DataParallel instead"
            )
        self._names = _name_map(named_parameters)
        self._sparse = list(sparse_params)
        self._passes = 0  # backward passes since the last averaged one
        self.serial = new_tag("optimizer")
        self.process_group, self.world_size, self.rank = membership(process_group, "DistributedOptimizer")
        named = self._named_params()
        self._check_sparse(named)
        self._connect(named)
        self._core = Core(self.algorithm, named, [], self.process_group, self.serial, bucket_cap_mb=bucket_cap_mb)
        self.optimizers = self._core.optimizers
        self._core.add_optimizer(optimizer, self._core.before_step, self._core.after_step)
        self._core.start()
        self._build_reducer()
        logger.info(
            "DistributedOptimizer: %d parameter tensor(s), algorithm %s, %d rank(s), averaging every %d pass(es)",
            len(named),
            self.algorithm.describe(),
            self.world_size,
            steps,
        )

    def close(self) -> None:
        """Stop averaging: remove the hooks on the parameters and the wrapped optimizer."""
        self._core.stop()
        self._core.release()

    # ---- the wrapped optimizer's state, shared ----------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        """Anything else (hook dictionaries, optimizer-specific attributes) is the wrapped optimizer's."""
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        passes = self.backward_passes_per_step
        return f"DistributedOptimizer({self.optimizer!r}, algorithm={self.algorithm.describe()}, backward_passes_per_step={passes})"

    # ---- set-up ----------------------------------------------------------
    def _named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The optimizer's parameters in group order, each with its name."""
        named = []
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if self._names is None:
                    named.append((f"param.{g}.{i}", p))
                elif id(p) in self._names:
                    named.append((self._names[id(p)], p))
                else:
                    raise ValueError(
                        f"param_groups[{g}]['params'][{i}] (shape {list(p.shape)}) is not in named_parameters; "
                        "pass the named_parameters() of every module whose parameters the optimizer updates"
                    )
        return named

    def _check_sparse(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Every sparse parameter is the optimizer's, and the algorithm takes sparse gradients."""
        held = {id(p) for _, p in named}
        for p in self._sparse:
            if not isinstance(p, torch.Tensor) or id(p) not in held:
                raise ValueError(
                    f"sparse_params holds a {type(p).__name__} (shape {list(getattr(p, 'shape', []))}) that is not "
                    "one of the optimizer's parameters; name only parameters the optimizer updates"
                )
        support.check(self.algorithm, support.Context(sparse=sparse_parameter(named, (), self._sparse)))

    def _connect(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Check that every rank holds the same parameters and settings, then take rank 0's values."""
        if self.process_group is None:
            return
        entries = parameter_entries(named)
        sparse = {id(p) for p in self._sparse}
        entries += [("setting", "sparse parameter", n) for n, p in named if id(p) in sparse]
        entries += [
            ("setting", "algorithm", self.algorithm.describe()),
            ("setting", "backward_passes_per_step", self.backward_passes_per_step),
            ("setting", "bucket_cap_mb", self.bucket_cap_mb),
        ]
        check_ranks_agree("the optimizers' parameters", entries, self.process_group)
        if named:
            with torch.no_grad():
                default_broadcast([p for _, p in named], self.process_group)

    def _build_reducer(self) -> None:
        """The gradient engine over the parameters that require grad (none without a process group)."""
        self._core.remove_reducer()
        self._core.replica.named_parameters = self._named_params()
        if self.process_group is None or not self._core.replica.trainable:
            return
        self._core.build_reducer(
            self.process_group, sparse_params=self._sparse, sync=Sync(decide_sync=self._decide_sync)
        )
        self._passes = 0

    def _decide_sync(self) -> bool:
        """Called once per backward pass: average on every backward_passes_per_step-th one."""
        self._passes += 1
        if self._passes < self.backward_passes_per_step:
            return False
        self._passes = 0
        return True

    # ---- the optimizer API -------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step the wrapped optimizer with the averaged gradients."""
        if closure is None and self._passes:
            raise RuntimeError(
                f"step() was called after {self._passes} backward pass(es), but gradients are averaged only every "
                f"{self.backward_passes_per_step} passes (backward_passes_per_step), so they are still local and the "
                f"replicas would drift apart; run {self.backward_passes_per_step - self._passes} more backward pass(es) first"
            )
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters join the averaging (collective)."""
        params = param_group.get("params", [])
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if self._names is not None and any(id(p) not in self._names for p in params):
            raise ValueError(
                "a parameter of the new group is not in named_parameters; name it when wrapping the optimizer"
            )
        self.optimizer.add_param_group({**param_group, "params": params})
        if self.process_group is None:
            return
        named = self._named_params()
        self._connect(named)
        self._build_reducer()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus the algorithm's state if it keeps any."""
        self._core.events.flush()
        state = self.optimizer.state_dict()
        entry = self._core.algorithm_entry()
        return {**state, ALGORITHM_KEY: entry} if entry is not None else state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` or by the wrapped optimizer."""
        state = dict(state_dict)
        entry = state.pop(ALGORITHM_KEY, None)
        ours = entry is not None and self._core.accepts(entry, True, "optimizer")  # before the optimizer changes
        self.optimizer.load_state_dict(state)
        if ours and entry is not None:
            self._core.events.load_state_dict(entry["state"])


def _name_map(named_parameters: Optional[NamedParameters]) -> Optional[dict[int, str]]:
    """id(parameter) -> name from ``named_parameters``; names must be distinct."""
    if named_parameters is None:
        return None
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    names: dict[int, str] = {}
    seen: dict[str, int] = {}
    for entry in named_parameters:
        if not (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], torch.Tensor)
        ):
            raise ValueError(
                f"named_parameters must hold (name, parameter) pairs, as module.named_parameters() gives; got {type(entry).__name__}"
            )
        name, p = entry
        if name in seen and seen[name] != id(p):
            raise ValueError(f"named_parameters names two different parameters {name!r}")
        seen[name] = id(p)
        names.setdefault(id(p), name)
    return names


__all__ = ["DistributedOptimizer", "QAdamOptimizer"]
