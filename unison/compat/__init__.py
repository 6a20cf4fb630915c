"""HeAT's, Bagua's and torch's DDPCPU APIs as thin layers over ``unison.DataParallel`` and its algorithms.

Moving a script written for one of these systems to unison is an import change:

====================================  ==============================================
before                                after
====================================  ==============================================
``import heat as ht``                 ``from unison.compat import heat as ht``
``import bagua.torch_api as bagua``   ``from unison.compat.bagua import torch_api as bagua``
``from bagua.torch_api.distributed``  ``from unison.compat.bagua.torch_api.distributed``
``torch.nn.DistributedDataParallelCPU``  ``unison.compat.torch.DistributedDataParallelCPU``
pytorch-pfn-extras' DDP               ``from unison import DataParallel as DistributedDataParallel``
====================================  ==============================================

No layer implements an algorithm of its own: each maps the seed's arguments
onto a unison algorithm and its options, and documents where behaviour
differs. The full table of every documented class, argument and method and
where it lives now is in ``docs/migration.md``.

The layers are imported on demand (``unison.compat.heat``, ``.bagua``,
``.torch``); this package imports none of them. Each starts (or adopts) the
process group with ``unison.init()`` where the original script never starts one
(HeAT's MPI is up at import, Bagua's ``init_process_group`` is mapped to it).
"""

__all__ = ["bagua", "heat", "torch"]
