"""Bagua's ``bagua.bagua_define``: the ``DistributedAlgorithm`` enum."""

from __future__ import annotations

import enum

__all__ = ["DistributedAlgorithm"]


class DistributedAlgorithm(enum.Enum):
    """The distributed algorithms Bagua names, each run by a unison algorithm.

    ======================  ================  ========================================
    member (value)          unison algorithm  hierarchical by default (Bagua's rule)
    ======================  ================  ========================================
    GradientAllReduce       ``allreduce``     no
    (``"allreduce"``)
    ScatterGatherAllReduce  ``allreduce``     yes (the same average; Bagua moves it
    (``"sg-allreduce"``)                      by reduce-scatter and all-gather)
    Decentralize            ``decentralized`` yes
    (``"decentralize"``)
    QuantizeAllReduce       ``bytegrad``      yes (8-bit min-max scatter-gather)
    (``"quantize"``)
    ======================  ================  ========================================

    Call it with a value to parse a string, ``DistributedAlgorithm("decentralize")``,
    or use ``from_str``.

    Example::

        >>> model.switch_to(DistributedAlgorithm.Decentralize)
    """

    GradientAllReduce = "allreduce"
    ScatterGatherAllReduce = "sg-allreduce"
    Decentralize = "decentralize"
    QuantizeAllReduce = "quantize"

    @staticmethod
    def from_str(val: str) -> "DistributedAlgorithm":
        """The member whose value is ``val``."""
        if not isinstance(val, str):
            raise ValueError(f"DistributedAlgorithm name must be a string, but got: {val}")
        try:
            return DistributedAlgorithm(val)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in DistributedAlgorithm)
            raise ValueError(f"unknown Bagua algorithm {val!r}; Bagua names {allowed}") from None


#: member -> (unison algorithm, hierarchical when hierarchical_reduce is None)
UNISON_ALGORITHM = {
    DistributedAlgorithm.GradientAllReduce: ("allreduce", False),
    DistributedAlgorithm.ScatterGatherAllReduce: ("allreduce", True),
    DistributedAlgorithm.Decentralize: ("decentralized", True),
    DistributedAlgorithm.QuantizeAllReduce: ("bytegrad", True),
}
