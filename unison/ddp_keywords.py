"""torch DDP's constructor keywords and checks, as ``unison.DataParallel`` takes them.

``DataParallel(net, device_ids=[rank], init_sync=False, ...)`` runs a script written
for ``torch.nn.parallel.DistributedDataParallel`` unchanged: each torch keyword that
``DataParallel`` does not name itself is parsed here (``parse``) and either honoured
with torch's meaning or refused with the reason; the module is checked as torch's
constructor checks it (``check_module``), with torch's error types and messages.
(A module of its own below the wrapper, not in ``compat/``: ``compat`` is built over
DataParallel, and the wrapper makes these checks at construction.)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .runtime import torch_private

_DELAYED = (
    "delaying some parameters' allreduce to another parameter's gradient hook is not supported; "
    "delay_reduce=True reduces every bucket after backward"
)

#: torch DDP arguments refused when given, with the reason.
REFUSED = {
    "mixed_precision": (
        "torch's private _MixedPrecision is not supported; use torch.autocast for low-precision compute "
        "and algorithm='fp16' or 'bf16' to average gradients in 16 bits"
    ),
    "bucket_cap_mb_list": "unison plans its buckets with one size; use bucket_cap_mb",
    "delay_all_reduce_named_params": _DELAYED,
    "param_to_hook_all_reduce": _DELAYED,
}

#: torch DDP arguments taken with torch's meaning (``Keywords``'s fields).
HONOURED = (
    "device_ids",
    "output_device",
    "dim",
    "init_sync",
    "device_mesh",
    "check_reduction",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
    "forward_sync_buffers",
    "static_graph",
    "gradient_as_bucket_view",
)

Device = Union[int, str, torch.device]


@dataclass(frozen=True)
class Keywords:
    """torch DDP's keywords with their meaning here (torch's defaults).

    Attributes:
        device_ids: None, or one device (torch's ``device_ids`` for a single-device
            CUDA module); forward moves its inputs there.
        output_device: kept as torch keeps it; like torch, forward does not move outputs.
        dim: kept as torch keeps it (``scatter``/``gather``); one device per process splits nothing.
        init_sync: False skips the initial broadcast of parameters and buffers.
        device_mesh: a 1-D ``DeviceMesh`` whose group the replicas talk over.
        check_reduction: deprecated in torch (a FutureWarning); reductions always complete.
        skip_all_reduce_unused_params, batched_grad_copy: torch's speed options; the
            gradients are the same with or without them (unison sends an unused
            parameter's zeros in its bucket, and copies each gradient as it arrives).
        forward_sync_buffers: buffers follow rank 0's during training (not at construction).
        static_graph: the same parameters get gradients at every step: which ones is
            agreed in the first synchronized backward only, and a later change raises.
        gradient_as_bucket_view: ``.grad`` are views of the flat buckets (no copy of the
            gradients). Here the default is True, torch's is False: the same values
            with one copy of the gradients less; False gives each ``.grad`` its own
            tensor, the average copied in, as torch's default does.
    """

    device_ids: Optional[Sequence[Device]] = None
    output_device: Optional[Device] = None
    dim: int = 0
    init_sync: bool = True
    device_mesh: Any = None
    check_reduction: bool = False
    skip_all_reduce_unused_params: bool = False
    batched_grad_copy: bool = False
    forward_sync_buffers: Optional[bool] = None
    static_graph: bool = False
    gradient_as_bucket_view: bool = True


def parse(keywords: Mapping[str, Any], stacklevel: int = 2) -> Keywords:
    """torch DDP's keywords: TypeError for one that is not torch DDP's, the reason for a refused one.

    ``stacklevel`` counts from the caller of ``parse``, as ``warnings.warn``'s does.
    """
    known = set(REFUSED) | set(HONOURED)
    unknown = sorted(set(keywords) - known)
    if unknown:
        raise TypeError(f"DataParallel got unexpected keyword argument(s) {', '.join(unknown)}")
    if (keywords.get("delay_all_reduce_named_params") is None) != (keywords.get("param_to_hook_all_reduce") is None):
        raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time.")
    for name, reason in REFUSED.items():
        if keywords.get(name) is not None:
            raise NotImplementedError(f"unison.DataParallel does not take torch DDP's {name}: {reason}")
    given = {k: v for k, v in keywords.items() if k in HONOURED}
    for name in (
        "init_sync",
        "check_reduction",
        "skip_all_reduce_unused_params",
        "batched_grad_copy",
        "static_graph",
        "gradient_as_bucket_view",
    ):
        if name in given and not isinstance(given[name], bool):
            raise TypeError(f"{name} must be a bool, got {given[name]!r}")
    if given.get("forward_sync_buffers") is not None and not isinstance(given["forward_sync_buffers"], bool):
        raise TypeError(f"forward_sync_buffers must be a bool or None, got {given['forward_sync_buffers']!r}")
    if "dim" in given and (isinstance(given["dim"], bool) or not isinstance(given["dim"], int)):
        raise TypeError(f"dim must be an int, got {given['dim']!r}")
    if given.get("check_reduction"):
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid using it.",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )
    return Keywords(**given)


def buffer_sync(
    broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool], stacklevel: int = 2
) -> tuple[bool, bool]:
    """``(during training, at construction)``: whether buffers follow rank 0's, as torch decides.

    ``broadcast_buffers`` decides both; ``forward_sync_buffers`` (torch 2.13) decides the
    first only and wins over ``broadcast_buffers`` (with torch's FutureWarning when both are given).
    """
    if forward_sync_buffers is not None:
        if broadcast_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` "
                "is deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                FutureWarning,
                stacklevel=stacklevel + 1,
            )
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def group_of(process_group: Any, device_mesh: Any) -> Any:
    """The process group the replicas talk over: ``process_group``, or ``device_mesh``'s.

    torch's checks: not both (RuntimeError), a 1-D mesh only (RuntimeError). A module
    whose parameters are DTensors is checked by ``unison.sharded.check`` (FSDP2 only).
    """
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group(mesh_dim=0)


def check_module(
    module: nn.Module, device_ids: Optional[Sequence[Device]], output_device: Optional[Device]
) -> tuple[Optional[list[int]], Optional[int]]:
    """torch DDP's checks of the module and its devices, with torch's types and messages.

    Returns ``(device_ids, output_device)`` as torch keeps them: device indices for a
    single-device GPU module given ``device_ids``, ``(None, None)`` otherwise.
    """
    ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if ignored:
        raise NotImplementedError(
            "unison.DataParallel does not support parameters and buffers to ignore "
            f"(_ddp_params_and_buffers_to_ignore: {sorted(ignored)}); every parameter and buffer is kept in agreement"
        )
    params = [p for _, p in module.named_parameters()]  # DTensors: unison.sharded.check accepted them
    if not any(p.requires_grad for p in params):
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
        )
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    devices = {p.device for p in params}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on "
            f"the same type of devices, but input module parameters locate in {types}."
        )
    kept: Optional[list[int]] = None
    kept_output: Optional[int] = None
    if not device_ids or "cpu" in types or len(devices) > 1:
        if device_ids or output_device:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments "
                "only work with single-device/multiple-device GPU modules or CPU modules, "
                f"but got device_ids {device_ids}, output_device {output_device}, "
                f"and module parameters {devices}."
            )
    else:
        kept = [_index(d) for d in device_ids]
        kept_output = _index(device_ids[0] if output_device is None else output_device)
    for p in params:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                "Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                "Run a dummy forward pass to correctly initialize the modules"
            )
    if "cpu" in types and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules")
    return kept, kept_output


def _index(device: Device) -> int:
    """A device's index, as torch's ``_get_device_index(device, optional=True)`` gives it."""
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    d = torch.device(device)
    return d.index if d.index is not None else torch.accelerator.current_device_index()


def refuse_positional_device_ids(optimizer: Any) -> None:
    """torch DDP's ``DDP(net, [rank])`` passes device_ids second, where unison takes the optimizer."""
    if isinstance(optimizer, (list, tuple)) and any(
        isinstance(o, (int, str, torch.device)) and not isinstance(o, bool) for o in optimizer
    ):
        raise TypeError(
            f"DataParallel's second argument is the optimizer, got {optimizer!r}; pass torch DDP's "
            "device_ids by keyword: DataParallel(module, device_ids=[...])"
        )


def moved(tree: Any, device: torch.device) -> Any:
    """Every tensor in ``tree`` on ``device`` (torch DDP moves inputs to ``device_ids[0]``)."""
    return torch_private.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, tree)
