"""Low-precision decentralized training: ring neighbours exchange 8-bit weight differences.

Every rank ``i`` keeps, besides its weights ``x_i``, three flat copies of the
trainable parameters: its own *public* copy ``p_i`` (what its neighbours
believe its weights are) and *replicas* ``p_left``, ``p_right`` of its ring
neighbours' public copies. All start equal to the weights, which are the same
on every rank when the algorithm is set up. Every ``communication_interval``
optimizer steps, right after the step, each rank:

1. quantizes the difference ``d_i = x_i - p_i`` to 8 bits (min-max per chunk
   of ``CHUNK_SIZE`` elements, ``unison.compress``) and sends the same bytes to
   both neighbours, receiving theirs;
2. decodes every message and adds it: ``p_i += Q(d_i)``,
   ``p_left += Q(d_left)``, ``p_right += Q(d_right)``. Sender and receivers
   decode the same bytes the same way, so a rank's public copy and its
   neighbours' replicas of it stay bit-identical;
3. sets its weights to the uniform average of the public copies in its
   neighbourhood: ``x_i <- (p_left + p_i + p_right) / 3``.

This is the gossip step of decentralized SGD applied to the public copies,
with the uniform 1/3 weights of Bagua's low-precision decentralized
algorithm. A round's rounding moves the mixed weights by at most half a
quantization step of each difference (weighted 1/3), and it does not pile up:
the next difference ``x_i - p_i`` is taken against the public copy as it really
is, so the public copies keep tracking the weights.

With 2 ranks the left and right neighbours are the same rank: each rank keeps
one replica, sends its message once, and both set their weights to
``(p_0 + p_1) / 2``, which is then bit-identical on the two ranks (each holds
the same two copies). With 3 or more the neighbours are distinct. Only
trainable parameters are exchanged; buffers stay local (as in
"decentralized"). ``model.average()`` also averages the optimizers' states
(see "decentralized") and leaves all ranks identical.

The state dict holds the step counter, the public copy and the replicas (keyed
by the neighbour's rank) per parameter name. The first round after
``load_state_dict`` refreshes the replicas from the neighbours' public copies
in full precision (every rank must load, as for any resumption), so a
checkpoint saved on rank 0 alone and loaded everywhere is consistent too; with
each rank's own checkpoint the refresh reproduces the replicas exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..compress import decode_rows, encode_rows_, minmax_params
from .base import check_int, require_optimizers
from .decentralized import FlatParams, PeriodicMixing, exchange, flat_params, ring_neighbours

#: Elements per quantization chunk (each has its own float32 min and scale).
CHUNK_SIZE = 1024
#: Side data per chunk: a float32 min and a float32 scale.
SIDE_BYTES = 8


class Message:
    """The reusable buffers of one flat group's 8-bit message: side data first, then the codes.

    A message is one uint8 tensor: the chunks' float32 mins and scales (as
    bytes), then one code per element padded to ``chunks * size``.
    """

    def __init__(self, numel: int, device: torch.device, chunk_size: int = CHUNK_SIZE):
        self.numel = numel
        self.chunks = max(1, -(-numel // chunk_size))
        self.size = max(1, -(-numel // self.chunks))
        self.side_bytes = SIDE_BYTES * self.chunks
        self.nbytes = self.side_bytes + self.chunks * self.size
        self.work = torch.empty(self.chunks * self.size, dtype=torch.float32, device=device)
        self.send = self.empty()

    def empty(self) -> torch.Tensor:
        """A new message buffer."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.work.device)

    def _parts(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a message: mins, scales (float32 ``[chunks]``) and codes (``[chunks, size]``)."""
        side = message[: self.side_bytes].view(torch.float32).view(2, self.chunks)
        return side[0], side[1], message[self.side_bytes :].view(self.chunks, self.size)

    def encode(self, x: torch.Tensor, public: torch.Tensor) -> torch.Tensor:
        """Quantize ``x - public`` into the send buffer (returned)."""
        n = self.numel
        diff = self.work[:n]
        diff.copy_(x)
        diff.sub_(public)
        self.work[n:] = self.work[n - 1]
        rows = self.work.view(self.chunks, self.size)
        mins, scales, codes = self._parts(self.send)
        found_mins, found_scales = minmax_params(rows)
        mins.copy_(found_mins)
        scales.copy_(found_scales)
        encode_rows_(rows, mins, scales, codes)
        return self.send

    def decode(self, message: torch.Tensor) -> torch.Tensor:
        """The values a message carries (a view of the work buffer, valid until the next call)."""
        mins, scales, codes = self._parts(message)
        return decode_rows(codes, mins, scales, self.work.view(self.chunks, self.size)).view(-1)[: self.numel]


class _Copies:
    """One flat group's public copy, neighbour replicas and message buffers."""

    def __init__(self, flat: FlatParams, neighbours: list[int]):
        self.flat = flat
        start = flat.gather()
        self.public = start.clone()
        self.replicas = [start.clone() for _ in neighbours]
        self.message = Message(flat.numel, start.device)
        self.received = [self.message.empty() for _ in neighbours]
        self.mix = flat.like()


class LowPrecisionDecentralized(PeriodicMixing):
    """Ring gossip of 8-bit compressed weight differences with neighbour replicas (Bagua's algorithm).

    Options:
        communication_interval: optimizer steps between two rounds (1: every step).
    """

    name = "low_precision_decentralized"
    defaults = {"communication_interval": 16}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.neighbours: list[int] = []
        self._copies: list[_Copies] = []
        self._refresh = False
        self._loaded: dict[str, Any] = {}

    def validate(self) -> None:
        """communication_interval is a positive int."""
        check_int(self.options, "communication_interval")

    def setup(self, model) -> None:
        """Open the private group; start the public copy and the replicas from the current weights."""
        require_optimizers(model, self.name)
        self._rank = model.rank
        if model.process_group is None or model.world_size == 1:
            return
        self.group = comm.private_group(model.process_group, f"{model.serial}/low_precision_decentralized")
        self.neighbours = ring_neighbours(model.rank, model.world_size)
        self._copies = [_Copies(f, self.neighbours) for f in flat_params(model.module)]
        if "public" in self._loaded:
            self._restore(self._loaded)

    def teardown(self, model) -> None:
        """Drop the copies and buffers (the private group stays cached for a switch back)."""
        self._copies = []
        super().teardown(model)

    def _round(self, model, round_index: int) -> None:
        """Send, receive and apply the 8-bit differences, then mix (see the module's doc)."""
        if self._refresh:
            self._refresh_replicas()
        sends, recvs = [], []
        for tag, c in enumerate(self._copies):
            message = c.message.encode(c.flat.gather(), c.public)
            sends += [(message, peer, tag) for peer in self.neighbours]
            recvs += [(buf, peer, tag) for buf, peer in zip(c.received, self.neighbours)]
            self.bytes_sent += c.message.nbytes * len(self.neighbours)
        exchange(sends, recvs, self.group)
        k = len(self.neighbours)
        for c in self._copies:
            c.public.add_(c.message.decode(c.message.send))
            for replica, received in zip(c.replicas, c.received):
                replica.add_(c.message.decode(received))
            c.mix.copy_(c.public)
            for replica in c.replicas:
                c.mix.add_(replica)
            c.flat.scatter(c.mix.div_(k + 1))

    def _refresh_replicas(self) -> None:
        """Overwrite the replicas with the neighbours' public copies, sent in full precision."""
        sends, recvs = [], []
        for tag, c in enumerate(self._copies):
            sends += [(c.public, peer, tag) for peer in self.neighbours]
            recvs += [(replica, peer, tag) for replica, peer in zip(c.replicas, self.neighbours)]
            self.bytes_sent += c.flat.nbytes * len(self.neighbours)
        exchange(sends, recvs, self.group)
        self._refresh = False

    def state_dict(self) -> dict[str, Any]:
        """Step counter, public copy and replicas (by neighbour rank), per parameter name."""
        if not self._copies:
            return {"steps": self.counter.steps, **self._loaded}
        public, replicas = {}, {peer: {} for peer in self.neighbours}
        for c in self._copies:
            public.update(c.flat.by_name(c.public))
            for peer, replica in zip(self.neighbours, c.replicas):
                replicas[peer].update(c.flat.by_name(replica))
        return {"steps": self.counter.steps, "rank": self._rank, "public": public, "replicas": replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counter and copies; the next round refreshes the replicas (see the module's doc)."""
        unknown = sorted(set(state) - {"steps", "rank", "public", "replicas"})
        if unknown:
            raise ValueError(f"low_precision_decentralized state has unknown entries {unknown}; expected steps, rank, public, replicas")
        self.counter.steps = int(state["steps"])
        self._loaded = {k: state[k] for k in ("rank", "public", "replicas") if k in state}
        if self._copies and "public" in self._loaded:
            self._restore(self._loaded)

    def _restore(self, state: dict[str, Any]) -> None:
        """Fill the copies from a loaded state and schedule the replicas' refresh."""
        for c in self._copies:
            c.flat.from_names(c.public, state["public"], "public copy")
            if state.get("rank") == self._rank and sorted(state.get("replicas", {})) == sorted(self.neighbours):
                for peer, replica in zip(self.neighbours, c.replicas):
                    c.flat.from_names(replica, state["replicas"][peer], f"replica of rank {peer}")
        self._loaded = {}
        self._refresh = True
