"""Accelerate: ``UnisonAccelerator(algorithm="diloco")`` is an ``accelerate.Accelerator`` whose
``prepare`` wraps the model in :class:`unison.DataParallel` instead of torch's DDP.

Everything else is Accelerate's own: device placement and mixed precision (applied to the model
before unison wraps it), the sharded data loaders, ``backward``, ``accumulate`` (through the
wrapper's ``no_sync``, as with DDP), ``clip_grad_norm_``, ``unwrap_model``. ``save_state`` and
``load_state`` also carry each rank's algorithm state, and each rank's weights and optimizer state
when the algorithm lets replicas drift (``rank_state``). The manual is docs/huggingface.md.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'unison.integrations.huggingface needs accelerate: pip install "unison[hf]" '
        f'(or pip install "accelerate>=1.10" "transformers>=5.0") [{exc}]'
    ) from exc

from ... import algorithms
from ...parallel import DataParallel
from . import rank_state

__all__ = ["UnisonAccelerator"]

#: Accelerate's kinds of job in which unison replaces torch's DDP.
WRAPPED = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU)
#: The kinds that shard or wrap the model themselves: unison cannot sit under them.
REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed partitions the model and reduces its gradients itself",
    DistributedType.FSDP: (
        "Accelerate's FSDP plugin shards the model and reduces its gradients itself (for FSDP2 inside nodes and "
        "unison across them, shard the model with fully_shard and wrap it in unison.DataParallel: docs/sharded.md)"
    ),
    DistributedType.MEGATRON_LM: "Megatron-LM splits the model and reduces its gradients itself",
    DistributedType.XLA: "XLA devices run their own collectives",
}
#: The environment variables by which Accelerate records that a plugin was asked for.
ASKED = {
    DistributedType.DEEPSPEED: "ACCELERATE_USE_DEEPSPEED",
    DistributedType.FSDP: "ACCELERATE_USE_FSDP",
    DistributedType.MEGATRON_LM: "ACCELERATE_USE_MEGATRON_LM",
}
#: DataParallel arguments the accelerator provides itself.
_OWN = ("module", "optimizer", "algorithm")


class UnisonAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains the prepared model with :class:`unison.DataParallel`.

    Args:
        algorithm: a unison algorithm: a name with options (``"diloco:period=50"``) or an instance.
            Refused at once when unknown.
        dataparallel_kwargs: more arguments of ``unison.DataParallel`` (``bucket_cap_mb``,
            ``nonfinite``, ...); torch DDP's, from a ``DistributedDataParallelKwargs`` handler,
            are passed too.
        *args, **kwargs: ``Accelerator``'s own.

    Prepare the optimizer in the same call as the model: algorithms that act after optimizer steps
    (model averaging) need it (``prepare(model, optimizer, loader)``).

    Raises ValueError at construction for a DeepSpeed, FSDP, Megatron-LM or XLA job, or a tensor
    parallel ``parallelism_config``: those wrap or split the model themselves.

    Example::

        accelerator = UnisonAccelerator(algorithm="diloco:period=20", cpu=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.save_state("ckpt")   # with every rank's algorithm state
    """

    def __init__(
        self,
        *args: Any,
        algorithm: Union[str, algorithms.Algorithm[Any]] = "allreduce",
        dataparallel_kwargs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        chosen = checked(algorithm, dataparallel_kwargs)
        super().__init__(*args, **kwargs)
        self._take(chosen, dataparallel_kwargs)

    @classmethod
    def adopt(
        cls,
        accelerator: Accelerator,
        algorithm: Union[str, algorithms.Algorithm[Any]],
        dataparallel_kwargs: Optional[dict[str, Any]] = None,
    ) -> "UnisonAccelerator":
        """Make an ``Accelerator`` built elsewhere (the Trainer's) a ``UnisonAccelerator``, before
        anything was prepared with it; return it."""
        if type(accelerator) is not Accelerator:
            raise TypeError(
                f"only a plain accelerate.Accelerator can be adopted, not a {type(accelerator).__name__}: "
                "build a UnisonAccelerator instead"
            )
        if accelerator._models:
            raise ValueError("the accelerator has prepared a model already: adopt it before prepare()")
        chosen = checked(algorithm, dataparallel_kwargs)
        accelerator.__class__ = cls
        assert isinstance(accelerator, cls)
        accelerator._take(chosen, dataparallel_kwargs)
        return accelerator

    def _take(self, algorithm: Union[str, algorithms.Algorithm[Any]], kwargs: Optional[dict[str, Any]]) -> None:
        # Asked for, not only chosen: on CPUs Accelerate runs MULTI_CPU and drops an FSDP plugin silently.
        kind = next((k for k, env in ASKED.items() if os.environ.get(env, "false").lower() == "true"), None)
        kind = kind if kind is not None else self.distributed_type
        reason = REFUSED.get(kind)
        if reason is None and self.parallelism_config is not None and self.parallelism_config.tp_enabled:
            reason = "tensor parallelism splits the model's layers across the processes"
        if reason is not None:
            raise ValueError(
                f"unison cannot train under {kind.value}: {reason}. unison.DataParallel replaces torch's DDP: "
                "leave that plugin (or the Trainer's fsdp/deepspeed argument) out and launch with torchrun, or "
                "accelerate launch --multi_gpu"
            )
        self.unison_algorithm = algorithm
        self.unison_kwargs = dict(kwargs or {})
        #: The ``unison.DataParallel`` that ``prepare`` built (None before, or without distribution).
        self.unison_model: Optional[DataParallel] = None
        self._unison_optimizers: list[torch.optim.Optimizer] = []

    # ---- prepare --------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Optional[list[Optional[bool]]] = None) -> Any:
        """Accelerate's ``prepare``; a model among ``args`` is wrapped in ``unison.DataParallel``
        with the optimizers among them. An optimizer prepared later, without a model, is registered
        with the model prepared before."""
        optimizers = [obj for obj in args if isinstance(obj, torch.optim.Optimizer)]
        if self.unison_model is not None and not any(isinstance(obj, nn.Module) for obj in args):
            known = self.unison_model.optimizers
            for opt in optimizers:
                if not any(opt is k for k in known):
                    self.unison_model.register_optimizer(opt)
        self._unison_optimizers = optimizers
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._unison_optimizers = []

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Accelerate's placement and mixed precision, then ``unison.DataParallel`` where Accelerate
        would wrap the model in DDP (a distributed job, a model with trainable parameters)."""
        if isinstance(model, DataParallel):
            return model
        wraps = (
            not evaluation_mode
            and self.distributed_type in WRAPPED
            and any(p.requires_grad for p in model.parameters())
        )
        if not wraps:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        algorithm = algorithms.as_algorithm(self.unison_algorithm)
        if algorithm.needs_optimizers and not self._unison_optimizers:
            raise ValueError(
                f"{algorithm.name!r} acts after each optimizer step, so it needs the optimizer: prepare it in the "
                "same call as the model: accelerator.prepare(model, optimizer, ...)"
            )
        placed = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        handler = self.ddp_handler
        kwargs = {**(handler.to_kwargs() if handler is not None else {}), **self.unison_kwargs}
        wrapped = DataParallel(placed, optimizer=self._unison_optimizers or None, algorithm=algorithm, **kwargs)
        if handler is not None:
            handler.register_comm_hook(wrapped)
        if self.scaler is not None:
            wrapped.add_scaler(self.scaler)
        self._models[next(i for i, m in enumerate(self._models) if m is placed)] = wrapped
        self.unison_model = wrapped
        return wrapped

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The model inside ``unison.DataParallel`` (and inside whatever Accelerate added)."""
        if isinstance(model, DataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    # ---- checkpoints ----------------------------------------------------------------------
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's ``save_state``, then each rank's unison part beside it (``rank_state``)."""
        with self._plain_models():
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if self.unison_model is not None:
            rank_state.save(location, self.unison_model, self.torch_optimizers())
            self.wait_for_everyone()
        return location

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        """Accelerate's ``load_state``, then each rank's unison part (``rank_state``). Needs an
        ``input_dir``: Accelerate's automatic naming picks the folder itself."""
        with self._plain_models():
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if self.unison_model is not None:
            if input_dir is None:
                raise ValueError("UnisonAccelerator.load_state needs input_dir (the folder save_state returned)")
            rank_state.load(input_dir, self.unison_model, self.torch_optimizers())

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers the prepared model steps (inside Accelerate's wrappers)."""
        return [getattr(opt, "optimizer", opt) for opt in self._optimizers]

    @contextlib.contextmanager
    def _plain_models(self) -> Iterator[None]:
        """While Accelerate saves or loads its part, it sees the module inside ``unison.DataParallel``
        (the wrapper's state dict holds the algorithm's state too, which safetensors cannot write)."""
        saved = list(self._models)
        self._models[:] = [m.module if isinstance(m, DataParallel) else m for m in saved]
        try:
            yield
        finally:
            self._models[:] = saved


def checked(
    algorithm: Union[str, algorithms.Algorithm[Any]], kwargs: Optional[dict[str, Any]]
) -> algorithms.Algorithm[Any]:
    """The algorithm, refused at once when unknown, and the DataParallel arguments, refused when
    they are the accelerator's own."""
    own = sorted(set(kwargs or {}) & set(_OWN))
    if own:
        raise ValueError(f"dataparallel_kwargs may not set {', '.join(own)}: the accelerator provides them")
    return algorithms.as_algorithm(algorithm)
