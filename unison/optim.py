"""Optimizer-side data parallelism: ``DistributedOptimizer``.

It wraps a torch optimizer instead of the model (as Horovod's
DistributedOptimizer and HeAT's DataParallelOptimizer do): gradients of the
optimizer's parameters are averaged during backward by the same engine as
``DataParallel`` (``unison.engine.reducer.GradReducer``), with any gradient
algorithm, and ``step()`` steps the wrapped optimizer. Like DataParallel it
builds a ``Replica`` for the algorithm and fires its events through a ``Dispatcher``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from . import algorithms as algos
from .algorithms.qadam_optimizer import QAdamOptimizer
from .engine.buckets import MB
from .engine.comm import check_same_everywhere, default_broadcast
from .engine.reducer import GradReducer
from .events import Dispatcher
from .parallel import ALGORITHM_KEY
from .replica import Replica

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]

# Numbers DistributedOptimizers in creation order (the same on every rank); it
# names their private process groups, apart from DataParallel's.
_serials = itertools.count()


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
    ) -> None:
        # Optimizer.__init__ is not called: the wrapped optimizer's state is used as it is.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("this optimizer is already a DistributedOptimizer; wrap the torch optimizer once")
        steps = backward_passes_per_step
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {steps!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.optimizer = optimizer
        self.backward_passes_per_step = steps
        self.bucket_cap_mb = bucket_cap_mb
        self.algorithm = algos.resolve(algorithm)
        if not self.algorithm.reduces_gradients or self.algorithm.defers_completion:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} needs the model's forward (it does not finish averaging gradients "
                "within backward), so DistributedOptimizer cannot run it; wrap the model with unison.DataParallel instead"
            )
        self._names = _name_map(named_parameters)
        self._passes = 0  # backward passes since the last averaged one
        self._reducer: Optional[GradReducer] = None
        self.optimizers = [optimizer]
        self.serial = f"optimizer-{next(_serials)}"
        self.process_group, self.world_size, self.rank = _membership(process_group)
        named = self._named_params()
        self._connect(named)
        self._replica = Replica(named, [], self.optimizers, self.process_group, tag=self.serial, bucket_cap_mb=bucket_cap_mb)
        self._events = Dispatcher(self.algorithm, self._replica)
        self._step_hooks = [
            optimizer.register_step_pre_hook(lambda opt, _args, _kwargs: self._replica.run_before_step(opt)),
            optimizer.register_step_post_hook(lambda opt, _args, _kwargs: self._after_step(opt)),
        ]
        self._build_reducer()

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._replica.record_step(optimizer)
        try:
            self._events.after_step(optimizer)
        finally:
            self._replica.run_after_step(optimizer)

    def close(self) -> None:
        """Stop averaging: remove the hooks on the parameters and the wrapped optimizer."""
        self._events.teardown()
        for handle in self._step_hooks:
            handle.remove()
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = self._replica.engine = None

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
        return f"DistributedOptimizer({self.optimizer!r}, algorithm={self.algorithm.describe()}, backward_passes_per_step={self.backward_passes_per_step})"

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

    def _connect(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Check that every rank holds the same parameters and settings, then take rank 0's values."""
        if self.process_group is None:
            return
        entries = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in named]
        entries += [
            ("setting", "algorithm", self.algorithm.describe()),
            ("setting", "backward_passes_per_step", self.backward_passes_per_step),
            ("setting", "bucket_cap_mb", self.bucket_cap_mb),
        ]
        check_same_everywhere("the optimizers' parameters", entries, self.process_group, _describe_entry)
        if named:
            with torch.no_grad():
                default_broadcast([p for _, p in named], self.process_group)

    def _build_reducer(self) -> None:
        """The gradient engine over the parameters that require grad (none without a process group)."""
        if self._reducer is not None:
            self._reducer.remove()
            self._reducer = self._replica.engine = None
        trainable = [(n, p) for n, p in self._named_params() if p.requires_grad]
        if self.process_group is None or not trainable:
            return
        names, params = zip(*trainable)
        self._replica.named_parameters = self._named_params()
        self._reducer = GradReducer(
            params, names, self.process_group, self._events, int(self.bucket_cap_mb * MB), tag=self.serial, decide_sync=self._decide_sync
        )
        self._replica.engine = self._reducer
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
            raise ValueError("a parameter of the new group is not in named_parameters; name it when wrapping the optimizer")
        self.optimizer.add_param_group({**param_group, "params": params})
        if self.process_group is None:
            return
        named = self._named_params()
        self._connect(named)
        self._build_reducer()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus the algorithm's state if it keeps any."""
        self._events.flush()
        state = self.optimizer.state_dict()
        algorithm_state = self._events.state_dict()
        if algorithm_state:
            state = {**state, ALGORITHM_KEY: {"name": self.algorithm.name, "state": algorithm_state}}
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict saved by ``state_dict()`` or by the wrapped optimizer."""
        state = dict(state_dict)
        algorithm_state = state.pop(ALGORITHM_KEY, None)
        if algorithm_state is not None and algorithm_state["name"] != self.algorithm.name:
            raise ValueError(
                f"the state dict holds the state of algorithm {algorithm_state['name']!r} but this optimizer "
                f"runs {self.algorithm.name!r}"
            )
        self.optimizer.load_state_dict(state)
        if algorithm_state is not None:
            self._events.load_state_dict(algorithm_state["state"])


def _name_map(named_parameters: Optional[NamedParameters]) -> Optional[dict[int, str]]:
    """id(parameter) -> name from ``named_parameters``; names must be distinct."""
    if named_parameters is None:
        return None
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    names: dict[int, str] = {}
    seen: dict[str, int] = {}
    for entry in named_parameters:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], torch.Tensor)):
            raise ValueError(f"named_parameters must hold (name, parameter) pairs, as module.named_parameters() gives; got {type(entry).__name__}")
        name, p = entry
        if name in seen and seen[name] != id(p):
            raise ValueError(f"named_parameters names two different parameters {name!r}")
        seen[name] = id(p)
        names.setdefault(id(p), name)
    return names


def _membership(process_group: Optional[dist.ProcessGroup]) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, world size, rank in it), or (None, 1, 0) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the process_group given to DistributedOptimizer")
        return group, dist.get_world_size(group), dist.get_rank(group)
    if process_group is not None:
        raise ValueError("process_group was given but torch.distributed is not initialized; call unison.init() first")
    return None, 1, 0


def _describe_entry(entry: tuple) -> str:
    """How a construction-check entry reads in an error message."""
    if entry[0] == "setting":
        return f"setting {entry[1]}={entry[2]!r}"
    frozen = "" if entry[4] else ", frozen"
    return f"parameter {entry[1]!r} (shape {list(entry[2])}, {entry[3].replace('torch.', '')}{frozen})"


__all__ = ["DistributedOptimizer", "QAdamOptimizer"]
