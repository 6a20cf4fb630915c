"""Bagua's ``bagua.torch_api`` API over unison.

Change the imports and keep the rest of the script::

    import bagua.torch_api as bagua                       # before
    from unison.compat.bagua import torch_api as bagua    # after

    from bagua.torch_api.distributed import bagua_init, ModelSwitchWrapper      # before
    from unison.compat.bagua.torch_api.distributed import bagua_init, ModelSwitchWrapper

    from bagua.bagua_define import DistributedAlgorithm    # before
    from unison.compat.bagua.bagua_define import DistributedAlgorithm

See ``docs/migration.md``.
"""

from . import bagua_define, torch_api
from .bagua_define import DistributedAlgorithm

__all__ = ["DistributedAlgorithm", "bagua_define", "torch_api"]
