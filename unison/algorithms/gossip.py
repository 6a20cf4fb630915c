"""What the gossip algorithms share: who talks to whom, the trainable parameters as
flat buffers, and point-to-point exchanges ("decentralized", "low_precision_decentralized")."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine import comm
from ..engine.buckets import split


def round_robin_partner(rank: int, world: int, round_index: int) -> int:
    """``rank``'s partner in round ``round_index`` of a round-robin tournament on ``world`` (even) ranks.

    The circle method: rank ``world - 1`` stays put and meets rank ``r`` in
    round ``r``; two other ranks ``i`` and ``j`` meet when
    ``i + j = 2 r (mod world - 1)``. Rounds repeat every ``world - 1``; over
    one such cycle every pair of ranks meets exactly once.
    """
    if world % 2:
        raise ValueError(f"a round-robin pairing needs an even number of ranks, got {world}")
    last = world - 1
    r = round_index % last
    if rank == last:
        return r
    if rank == r:
        return last
    return (2 * r - rank) % last


def ring_neighbours(rank: int, world: int) -> list[int]:
    """The distinct ranks next to ``rank`` on a ring: left then right; one with 2 ranks, none alone."""
    if world == 1:
        return []
    left, right = (rank - 1) % world, (rank + 1) % world
    return [left] if left == right else [left, right]


class FlatParams:
    """The trainable parameters of one dtype and device, copied to and from one reusable flat buffer."""

    def __init__(self, names: list[str], params: Sequence[torch.Tensor]) -> None:
        self.names = names
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.empty(self.numel, dtype=params[0].dtype, device=params[0].device)
        self._views = split(self.flat, params)

    @property
    def nbytes(self) -> int:
        return self.numel * self.flat.element_size()

    def gather(self) -> torch.Tensor:
        """The parameters' current values, copied into the flat buffer (which is returned)."""
        with torch.no_grad():
            torch._foreach_copy_(self._views, [p.detach() for p in self.params])
        return self.flat

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (laid out like the buffer) into the parameters."""
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], split(flat, self.params))

    def add_to_params(self, flat: torch.Tensor) -> None:
        """Add ``flat`` (laid out like the buffer) to the parameters."""
        with torch.no_grad():
            torch._foreach_add_([p.detach() for p in self.params], split(flat, self.params))

    def like(self) -> torch.Tensor:
        """A new flat tensor shaped and typed like the buffer."""
        return torch.empty_like(self.flat)

    def by_name(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``flat`` cut per parameter, cloned, keyed by parameter name (for a state dict)."""
        return {name: view.clone() for name, view in zip(self.names, split(flat, self.params))}

    def from_names(self, flat: torch.Tensor, values: dict[str, torch.Tensor], what: str) -> None:
        """Fill ``flat`` from a ``by_name`` dict, refusing missing names or other shapes."""
        for name, view in zip(self.names, split(flat, self.params)):
            if name not in values:
                raise ValueError(f"the saved {what} has no entry for parameter {name!r}")
            value = values[name]
            if tuple(value.shape) != tuple(view.shape):
                raise ValueError(
                    f"the saved {what} of parameter {name!r} has shape {list(value.shape)}, the model's is {list(view.shape)}"
                )
            view.copy_(value)


def flat_params_of(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[FlatParams]:
    """The trainable ones of ``(name, parameter)`` pairs (``replica.named_parameters``), grouped
    by dtype and device, in the order given."""
    groups: dict[tuple[Any, ...], tuple[list[str], list[torch.Tensor]]] = {}
    for name, p in named_parameters:
        if p.requires_grad:
            names, params = groups.setdefault((p.dtype, p.device), ([], []))
            names.append(name)
            params.append(p)
    return [FlatParams(names, params) for names, params in groups.values()]


def exchange(
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[torch.Tensor, int, int]],
    group: Optional[dist.ProcessGroup],
    wait: bool = True,
) -> list[Any]:
    """Send and receive (tensor, group rank, tag) triples point to point, and wait for all of them
    (``wait=False``: return their works instead).

    A receive matches the send from its peer with the same tag (the index of
    the flat buffer), so several buffers can travel between two ranks at once.
    """
    ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    if wait:
        for work in works:
            comm.wait(work, p2p=True)
        return []
    return works


class Received:
    """Point-to-point messages in flight; ``wait()`` gives the receive buffers once they landed."""

    def __init__(self, works: list, buffers: list) -> None:
        self.works, self.buffers = works, buffers

    def wait(self) -> list:
        for work in self.works:
            comm.wait(work, p2p=True)
        self.works = []
        return self.buffers
