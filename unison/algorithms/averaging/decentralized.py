"""Decentralized training: replicas average their weights with peers, not their gradients.

Each rank trains on its own gradients (no gradient engine runs) and, every
``period`` training steps, mixes its trainable parameters with those of some
peers right after the optimizer step: all of them (one allreduce), one partner
changing every round (``shift_one``, a round-robin tournament), or its two ring
neighbours (``ring``). Buffers stay local until ``model.average()``.

With ``hierarchical=True`` a round first averages each node inside, then each
local rank mixes its shard of the node's mean with the same shard of the peer
nodes (peers are nodes), and the node gathers the shards (``engine.hierarchy.TwoLevel``).

Rounds are streamed as local SGD's averages are (``streaming.Stagger``):
``fragments`` of the weights mix in turn across the period, each round's
messages travel for ``delay`` steps, and when they land every rank adds the
change the round makes to the weights it sent (keeping its local steps).

See docs/algorithms.md#decentralized.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from ...engine import comm
from ...engine.averaging import AsyncAverage
from ...engine.comm import Waitable
from ...engine.flat import by_kind, split
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Recovery
from ..schedules import StepCount
from ..streaming import Streamed, StreamedState, fragments_of, write_average


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
    """The trainable parameters of one dtype and device, gathered into a flat tensor made for the
    round (nothing is kept between rounds) and written back from one."""

    def __init__(self, names: list[str], params: Sequence[torch.Tensor]) -> None:
        self.names, self.params = names, list(params)
        self.numel = sum(p.numel() for p in self.params)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters' values."""
        return self.numel * self.params[0].element_size()

    def gather(self) -> torch.Tensor:
        """The parameters' current values, copied into a new flat tensor."""
        out = self.new_flat()
        with torch.no_grad():
            torch._foreach_copy_(split(out, self.params), [p.detach() for p in self.params])
        return out

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (laid out like ``gather``'s) into the parameters."""
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in self.params], split(flat, self.params))

    def add_to_params(self, flat: torch.Tensor) -> None:
        """Add ``flat`` (laid out like ``gather``'s) to the parameters."""
        with torch.no_grad():
            torch._foreach_add_([p.detach() for p in self.params], split(flat, self.params))

    def new_flat(self) -> torch.Tensor:
        """A new flat tensor shaped and typed like ``gather``'s."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

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


def flat_params_of(trainable: Sequence[tuple[str, torch.Tensor]]) -> list[FlatParams]:
    """``(name, parameter)`` pairs of trained parameters (``replica.trainable``: the Replica knows
    which are trained; an FSDP2 local shard does not require grad itself), grouped by dtype and
    device, in the order given."""
    groups = by_kind([p for _, p in trainable])
    return [FlatParams([trainable[i][0] for i in idx], [trainable[i][1] for i in idx]) for idx in groups]


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
    gloo sends and receives host memory only: tensors on a GPU travel through host
    copies there, and the last work returned writes the received ones back.
    """
    staged = None
    if any(t.device.type != "cpu" for t, _, _ in sends + recvs) and dist.get_backend(group) == "gloo":
        staged = CopyBack([(torch.empty_like(t, device="cpu"), t) for t, _, _ in recvs], [t.cpu() for t, _, _ in sends])
        sends = [(host, peer, tag) for host, (_, peer, tag) in zip(staged.keep, sends)]
        recvs = [(host, peer, tag) for (host, _), (_, peer, tag) in zip(staged.pairs, recvs)]
    ops = [dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=peer) for t, peer, tag in recvs]
    works: list[Any] = dist.batch_isend_irecv(ops) if ops else []
    if staged is not None:
        works.append(staged)  # waited on last: after every receive landed in its host copy
    if wait:
        for work in works:
            comm.wait(work, p2p=True)
        return []
    return works


class CopyBack:
    """The end of a point-to-point exchange staged through host memory: ``wait()`` copies each
    received host tensor into its place on the device (and lets the sent host copies go)."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], keep: list[torch.Tensor]) -> None:
        self.pairs, self.keep = pairs, keep

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        for host, target in self.pairs:
            target.copy_(host)
        self.pairs, self.keep = [], []


class Received:
    """Point-to-point messages in flight; ``wait()`` gives the receive buffers once they landed."""

    def __init__(self, works: list, buffers: list) -> None:
        self.works, self.buffers = works, buffers

    def wait(self) -> list:
        for work in self.works:
            comm.wait(work, p2p=True)
        self.works = []
        return self.buffers


PEER_SELECTIONS = ("all", "shift_one", "ring")


class DecentralizedState(StreamedState):
    """The step count (it decides the rounds and their pairings), the private group, the
    fragments (for the point-to-point rounds, their parameters by kind; the buffers of a round
    are made at its launch and dropped at its merge) and the rounds in flight."""

    __slots__ = ("group", "fragments", "flats", "recv")

    def __init__(
        self,
        count: StepCount,
        group: Optional[dist.ProcessGroup] = None,
        fragments: Optional[list[list[torch.Tensor]]] = None,
    ) -> None:
        super().__init__(count)
        self.group = group  # None alone: nothing to mix
        self.fragments = fragments or []  # per fragment, its parameters (or pieces of them)
        self.flats: list[list[FlatParams]] = []  # point to point: per fragment, its parameters by dtype and device
        self.recv: list[list[list[torch.Tensor]]] = []  # hierarchical point to point: per fragment and kind, per peer


class Decentralized(Streamed[DecentralizedState]):
    """Weight mixing with peers (all, one rotating partner, or ring neighbours) every ``period`` steps.

    Args:
        peer_selection: ``"all"``, ``"shift_one"`` (even world sizes) or ``"ring"``.
        period: training steps between two rounds, 1 for every step (alias
            ``communication_interval``, Bagua's name).
        fragments, delay: how the rounds are streamed (see ``streaming.Streamed``).
        hierarchical: nodes average inside first; peers are nodes (``shift_one``: an even node count).

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="decentralized:peer_selection=ring,period=4")
    """

    name = "decentralized"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    recovery = Recovery()  # an interrupted gossip round is dropped: the next one pulls the replicas together
    fsdp2 = FSDP2()  # the local shards gossiped
    peer_selection: Literal["all", "shift_one", "ring"] = "all"
    period: int = 16

    def __post_init__(self) -> None:
        options.choice("peer_selection", self.peer_selection, PEER_SELECTIONS)
        options.integer("period", self.period)
        super().__post_init__()

    def setup(self, replica: Replica) -> DecentralizedState:
        self.check_optimizers(replica)
        world = replica.world_size
        count = StepCount(self.period)
        if not replica.distributed:
            return DecentralizedState(count)
        fragments = fragments_of(replica.trainable, self.schedule().fragments)
        state = DecentralizedState(
            count, replica.private_group("decentralized"), [[p for _, p in f] for f in fragments]
        )
        self.use_nodes(replica, state, state.fragments)
        levels = state.levels
        if levels is not None:
            if self.peer_selection == "shift_one" and levels.nodes % 2:
                levels.close()  # the state is never returned: nobody else would close it
                raise ValueError(
                    f"hierarchical decentralized with peer_selection='shift_one' pairs the nodes, so it needs an even "
                    f"number of nodes, got {levels.nodes}; use peer_selection='ring' or 'all'"
                )
            peers = len(self._peers(levels.node, levels.nodes, 0))
            by_peer = [[levels.new_shards(flats) for _ in range(peers)] for flats in state.node_flats]
            state.recv = [[list(bufs) for bufs in zip(*shards)] for shards in by_peer]  # per kind, per peer
        elif (
            self.peer_selection == "shift_one" and world > 1 and world % 2
        ):  # flat (hierarchical too: one node, one per node)
            raise ValueError(
                f"decentralized with peer_selection='shift_one' pairs the ranks, so it needs an even world size, "
                f"got {world}; use peer_selection='ring' or 'all'"
            )
        elif self.peer_selection != "all":  # buffers made at each launch, dropped at its merge
            state.flats = [flat_params_of(f) for f in fragments]
        self.stream(replica, state, len(fragments))
        return state

    def _peers(self, rank: int, world: int, round_index: int) -> list[int]:
        """The ranks (of nodes, hierarchical) ``rank`` mixes with in round ``round_index`` (point to point)."""
        if self.peer_selection == "shift_one" and world > 1:
            return [round_robin_partner(rank, world, round_index)]
        return ring_neighbours(rank, world)

    def launch(self, replica: Replica, state: DecentralizedState, fragment: int) -> tuple[Waitable, Any]:
        """Start ``fragment``'s round: an allreduce for "all", otherwise a point-to-point exchange."""
        f = fragment
        levels = state.levels
        if levels is not None:  # the node's mean, shards mixed across nodes
            with torch.no_grad():
                values = [p.detach().clone() for p in state.fragments[f]]
            round_index = (state.count.steps - 1) // self.period
            mixed = levels.submit(self._node_round, state, levels, f, values, round_index, meter=state)
            return mixed, (values if state.late else None)
        if self.peer_selection == "all":
            with torch.no_grad():
                at_launch = [p.detach().clone() for p in state.fragments[f]] if state.late else None
            pending = AsyncAverage(state.fragments[f], state.group)
            state.bytes_sent += pending.wire_bytes
            return pending, at_launch
        peers = self._peers(replica.rank, replica.world_size, (state.count.steps - 1) // self.period)
        sends, recvs, first = [], [], sum(len(flats) for flats in state.flats[:f])
        inboxes, at_launch = [], []
        for tag, fl in enumerate(state.flats[f], start=first):
            mine = fl.gather()  # stays untouched until the merge: the weights at launch
            bufs = [fl.new_flat() for _ in peers]
            sends += [(mine, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(bufs, peers)]
            state.bytes_sent += fl.nbytes * len(peers)
            inboxes.append(bufs)
            at_launch.append(mine)
        return Received(exchange(sends, recvs, state.group, wait=False), inboxes), at_launch

    def _node_round(
        self, state: DecentralizedState, levels: TwoLevel, f: int, values: list[torch.Tensor], round_index: int
    ) -> list[torch.Tensor]:
        """On the levels' thread: the node's mean of ``values``, each shard mixed with the peer nodes'."""
        flats = state.node_flats[f]
        if self.peer_selection == "all":
            return [v.clone() for v in levels.average(flats, values)]
        peers = self._peers(levels.node, levels.nodes, round_index)
        pieces = levels.mean_shards(flats, values)
        sends = [(piece, peer, tag) for tag, piece in enumerate(pieces) for peer in peers]
        recvs = [(buf, peer, tag) for tag, bufs in enumerate(state.recv[f]) for buf, peer in zip(bufs, peers)]
        exchange(sends, recvs, levels.inter)
        levels.inter_bytes += sum(piece.numel() * piece.element_size() for piece in pieces) * len(peers)
        for piece, bufs in zip(pieces, state.recv[f]):
            for buf in bufs:
                piece.add_(buf)
            piece.div_(len(bufs) + 1)
        return [v.clone() for v in levels.join_shards(flats, pieces)]

    def merge(self, replica: Replica, state: DecentralizedState, fragment: int, result: Any, extra: Any) -> None:
        """Write ``fragment``'s round into the weights (adding the change it makes when it lands late)."""
        f, at_launch = fragment, extra
        if self.peer_selection == "all" or state.levels is not None:
            write_average(state.fragments[f], result, at_launch)
            return
        with torch.no_grad():
            for fl, bufs, sent in zip(state.flats[f], result, at_launch):
                mix = bufs[0]
                for buf in bufs[1:]:
                    mix.add_(buf)
                if state.late:  # (sent + received) / (k + 1) - sent, added to the weights
                    fl.add_to_params(mix.sub_(sent, alpha=len(bufs)).div_(len(bufs) + 1))
                else:
                    fl.scatter(mix.add_(sent).div_(len(bufs) + 1))
