"""torch DDP's communication-hook contract, as ``DataParallel.register_comm_hook`` keeps it.

torch checks a hook when it is registered (callable; ``bucket`` annotated
``dist.GradBucket``; the return annotated ``torch.futures.Future[torch.Tensor]``;
the bf16 hooks only where NCCL or XCCL runs them) and, when it runs, that it returned
a Future. ``check`` makes the first checks with torch's messages; ``FutureChecked``
wraps the hook so a hook returning anything else is named as the cause at once.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .runtime import torch_private

#: The registration form torch DDP's method has, and the one pytorch-pfn-extras' has.
TORCH, PFN = "torch", "pfn"

#: torch's hooks that need bf16 allreduce (CUDA with NCCL 2.10+, or XPU with XCCL).
BF16_HOOKS = ("bf16_compress_hook", "bf16_compress_wrapper_hook")


class _NotGiven:
    """The default of ``register_comm_hook``'s arguments: tells the two forms apart."""

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN: Any = _NotGiven()


def form(state: Any, hook: Any) -> tuple[str, Any, Any]:
    """Which registration was meant: ``(TORCH, state, hook)`` or ``(PFN, None, hook)``.

    ``register_comm_hook(state, hook)`` and ``register_comm_hook(state=..., hook=...)``
    are torch DDP's; ``register_comm_hook(hook)`` and ``register_comm_hook(hook=...)``
    pytorch-pfn-extras' (torch's form has no default for ``state``).
    """
    if state is NOT_GIVEN and hook is NOT_GIVEN:
        raise TypeError("register_comm_hook() takes (state, hook) as torch DDP does, or (hook) as pytorch-pfn-extras")
    if hook is NOT_GIVEN:
        return PFN, None, state
    if state is NOT_GIVEN:
        return PFN, None, hook
    return TORCH, state, hook


def check(hook: Any) -> None:
    """torch DDP's checks of a ``hook(state, bucket)`` at registration (``_check_comm_hook``).

    Unlike torch, a hook whose second parameter is not named ``bucket`` is accepted
    (torch raises ``KeyError: 'bucket'`` for it; that parameter's annotation is checked),
    and annotations written as strings (``from __future__ import annotations``) are
    read as what they name (torch compares the strings, and refuses correct ones).
    """
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:
        signature = inspect.signature(hook, eval_str=True)
    except Exception:  # a string annotation naming what the hook's module cannot resolve
        signature = inspect.signature(hook)
    bucket = _bucket_parameter(signature)
    if bucket is not None and bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and returned != torch.futures.Future[torch.Tensor]:
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor].")
    if getattr(hook, "__name__", "") in BF16_HOOKS and not _bf16_allreduce_available():
        raise TypeError("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and XCCL")


def _bucket_parameter(signature: inspect.Signature) -> Optional[inspect.Parameter]:
    """The parameter named ``bucket``, else the second positional one, else None."""
    if "bucket" in signature.parameters:
        return signature.parameters["bucket"]
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional[1] if len(positional) > 1 else None


def _bf16_allreduce_available() -> bool:
    """torch's condition for its bf16 hooks: CUDA (or ROCm) with NCCL 2.10+, or XPU with XCCL."""
    gpu = torch.version.cuda is not None or torch.version.hip is not None
    nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    xccl = dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return bool((gpu and nccl) or xccl)


class FutureChecked:
    """``hook(state, bucket)``, raising torch's RuntimeError when it returns no Future.

    Without it the engine would fail later on the returned value
    (``'int' object has no attribute 'wait'``), far from the hook at fault.
    """

    def __init__(self, hook: Callable[[Any, Any], Any]) -> None:
        self.hook = hook
        self.__qualname__ = getattr(hook, "__qualname__", type(hook).__qualname__)

    def __call__(self, state: Any, bucket: Any) -> Any:
        future = self.hook(state, bucket)
        if not torch_private.is_future(future):  # torch.futures.Future, or a Work's get_future()
            kind = type(future)
            raise RuntimeError(
                "DDP communication hook's callback must return a torch.futures.Future object, "
                f"but got {kind.__module__}.{kind.__qualname__} (from hook {self.__qualname__})"
            )
        return future
