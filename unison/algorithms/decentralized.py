"""Decentralized training: replicas average their weights with peers, not their gradients.

Each rank trains on its own gradients (no gradient engine runs) and, every
``communication_interval`` optimizer steps, mixes its weights with those of
some peers, right after the optimizer step. ``peer_selection`` picks them:

``"all"``
    Every rank averages with every other: one allreduce of the weights
    (``unison.averaging``). After such a round the replicas are identical.

``"shift_one"``
    Each rank averages with exactly one peer, ``x_i <- (x_i + x_p) / 2``, and
    the pairs change every round following a round-robin tournament (the
    circle method): over ``world - 1`` consecutive rounds every rank is paired
    once with every other. It needs an even world size; an odd one (other than
    a single process, which has nothing to exchange) is refused when the
    algorithm is set up.

``"ring"``
    Each rank averages with its two ring neighbours,
    ``x_i <- (x_{i-1} + x_i + x_{i+1}) / 3``. Each distinct member of the
    neighbourhood counts once: with 2 ranks the two neighbours are the same
    rank, so the round is the plain average ``(x_0 + x_1) / 2`` (one weight
    sent each way, not two).

The pairwise and ring rounds exchange weights point to point
(``batch_isend_irecv``) on a private process group; the trainable parameters
are packed into one reusable flat buffer per dtype and device. Only trainable
parameters are mixed, as Bagua does: frozen ones never change and buffers
(BatchNorm running statistics) stay local, each describing its own replica's
activations. ``model.average()`` (and ``switch_to``) then averages the
parameters and gives every rank rank 0's buffers.

A step ends when every optimizer registered with the model has stepped since
the last one; every rank must take the same number of steps (an optimizer step
skipped on one rank only, e.g. by a grad scaler that saw an inf in a local
gradient, would leave the ranks' rounds out of step). The step counter is
saved in the state dict. Every round is blocking, so nothing is ever left in
flight between steps.

``model.average()`` (at the end of training, and before ``switch_to``) also
averages the optimizers' floating-point states (momenta, Adam moments), which
local gradients have made different on every rank: afterwards the replicas are
identical in everything that decides their next step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..averaging import average_
from ..buckets import split
from .base import Algorithm, StepCounter, check_int, require_optimizers
from .gossip import FlatParams, exchange, flat_params, ring_neighbours, round_robin_partner  # noqa: F401

PEER_SELECTIONS = ("all", "shift_one", "ring")


class PeriodicMixing(Algorithm):
    """Replicas train on local gradients and mix weights every ``communication_interval`` steps.

    Subclasses set ``defaults`` (with ``communication_interval``) and
    implement ``_round(model, round_index)``; ``self.group`` is their private
    group (None alone: nothing to mix).
    """

    replicas_drift = True
    reduces_gradients = False

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.counter = StepCounter()
        self.bytes_sent = 0
        self.group = None

    @property
    def steps(self) -> int:
        """Training steps taken under this algorithm."""
        return self.counter.steps

    def after_step(self, model, optimizer) -> None:
        """At the end of every ``communication_interval``-th step, run one mixing round."""
        if not self.counter.step_ended(model, optimizer) or self.group is None:
            return
        interval = self.options["communication_interval"]
        if self.steps % interval == 0:
            self._round(model, self.steps // interval - 1)

    def _round(self, model, round_index: int) -> None:
        raise NotImplementedError


class Decentralized(PeriodicMixing):
    """Weight mixing with peers (all, one rotating partner, or ring neighbours) every few steps.

    Options:
        peer_selection: "all", "shift_one" or "ring" (see the module's doc).
        communication_interval: optimizer steps between two rounds (1: every step).
    """

    name = "decentralized"
    defaults = {"peer_selection": "all", "communication_interval": 16}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._flats: list[FlatParams] = []
        self._recv: list[list[torch.Tensor]] = []

    def validate(self) -> None:
        """peer_selection is one of PEER_SELECTIONS; communication_interval a positive int."""
        peers = self.options["peer_selection"]
        if peers not in PEER_SELECTIONS:
            raise ValueError(f"peer_selection must be one of {', '.join(map(repr, PEER_SELECTIONS))}, got {peers!r}")
        check_int(self.options, "communication_interval")

    def setup(self, model) -> None:
        """Check the optimizers and the world size; open the private group and the flat buffers."""
        require_optimizers(model, self.name)
        if self.options["peer_selection"] == "shift_one" and model.world_size > 1 and model.world_size % 2:
            raise ValueError(
                f"decentralized with peer_selection='shift_one' pairs the ranks, so it needs an even world size, "
                f"got {model.world_size}; use peer_selection='ring' or 'all'"
            )
        self._rank, self._world = model.rank, model.world_size
        if model.process_group is None or model.world_size == 1:
            return
        self.group = comm.private_group(model.process_group, f"{model.serial}/decentralized")
        if self.options["peer_selection"] != "all":
            self._flats = flat_params(model.module)
            peers = len(self._peers(0))
            self._recv = [[f.like() for _ in range(peers)] for f in self._flats]

    def teardown(self, model) -> None:
        """Drop the flat buffers (the private group stays cached for a switch back)."""
        self._flats, self._recv = [], []
        super().teardown(model)

    def _peers(self, round_index: int) -> list[int]:
        """The group ranks this rank mixes with in round ``round_index`` (p2p modes)."""
        if self.options["peer_selection"] == "shift_one":
            return [round_robin_partner(self._rank, self._world, round_index)]
        return ring_neighbours(self._rank, self._world)

    def _round(self, model, round_index: int) -> None:
        """One mixing round: an allreduce for "all", otherwise a point-to-point exchange."""
        if self.options["peer_selection"] == "all":
            params = [p for p in model.module.parameters() if p.requires_grad]
            self.bytes_sent += average_(params, self.group)
            return
        peers = self._peers(round_index)
        sends, recvs = [], []
        for tag, (f, bufs) in enumerate(zip(self._flats, self._recv)):
            mine = f.gather()
            sends += [(mine, peer, tag) for peer in peers]
            recvs += [(buf, peer, tag) for buf, peer in zip(bufs, peers)]
            self.bytes_sent += f.nbytes * len(peers)
        exchange(sends, recvs, self.group)
        for f, bufs in zip(self._flats, self._recv):
            for buf in bufs:
                f.flat.add_(buf)
            f.flat.div_(len(peers) + 1)
            f.scatter(f.flat)

    def state_dict(self) -> dict[str, Any]:
        """The step counter (it sets the round's pairing and when the next round comes)."""
        return {"steps": self.counter.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"steps"})
        if unknown:
            raise ValueError(f"decentralized state has unknown entries {unknown}; expected 'steps'")
        self.counter.steps = int(state["steps"])
