"""torch DDP's constructor keywords that have no meaning in ``unison.DataParallel``: the drop-in shim.

``DataParallel(net, device_ids=[rank], output_device=rank)`` runs a script written
for ``torch.nn.parallel.DistributedDataParallel`` unchanged: these keywords are
accepted with a warning naming them, and any other unknown keyword is refused as
Python refuses it. (A module of its own below the wrapper, not in ``compat/``:
``compat`` is built over DataParallel, and the wrapper checks these at construction.)
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

#: torch DDP arguments that do not apply here: accepted, with a warning.
IGNORED = (
    "device_ids",
    "output_device",
    "dim",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "init_sync",
    "mixed_precision",
    "device_mesh",
    "skip_all_reduce_unused_params",
)


def check(keywords: Mapping[str, Any], stacklevel: int = 2) -> None:
    """Refuse keywords that are not torch DDP's (TypeError); warn about those given a value.

    ``stacklevel`` counts from the caller of ``check``, as ``warnings.warn``'s does.
    """
    unknown = sorted(set(keywords) - set(IGNORED))
    if unknown:
        raise TypeError(f"DataParallel got unexpected keyword argument(s) {', '.join(unknown)}")
    ignored = sorted(k for k, v in keywords.items() if v is not None)
    if ignored:
        warnings.warn(
            f"unison.DataParallel ignores the torch DDP argument(s) {', '.join(ignored)}: they do not apply here",
            stacklevel=stacklevel + 1,
        )
