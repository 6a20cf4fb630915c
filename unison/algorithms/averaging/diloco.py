"""DiLoCo (Douillard et al. 2023): many local steps, then one outer step on the
averaged change of the weights, streamed (Douillard et al. 2025) by default.

Every rank trains on local gradients with the user's optimizer (the inner one)
for ``period`` steps; then the pseudo-gradient, the snapshot taken at the last
outer step minus the current parameters, is averaged across ranks and given to
an outer SGD with Nesterov momentum, whose step gives the new snapshot that
every rank copies into its parameters. Streamed (``fragments``, ``delay``,
``mixing``): the weights are cut into fragments synced in turn across the
period (``streaming.Stagger``), each average travelling for ``delay`` inner
steps before its outer step is merged; ``fragments=1, delay=0`` is the classic
schedule and ``overlap=True`` the classic one with ``delay=1``.

See docs/algorithms.md#diloco.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ...engine.averaging import AsyncAverage, average_async
from ...engine.codecs import WIRE_DTYPES
from ...engine.comm import Finished, Waitable
from ...engine.offload import empty_like, keep, pieces
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Recovery
from ..schedules import StepCount
from ..streaming import Stagger, Streamed, StreamedState, default_schedule, fragments_of


class DiLoCoState(StreamedState):
    """The outer optimizer and the snapshot it steps (the reference weights, one piece per
    fragment's share of a parameter; on the host with ``offload``), the step count, and the
    syncs in flight."""

    __slots__ = ("names", "params", "buffers", "snapshot", "outer", "group", "fragments", "feedback")

    def __init__(
        self,
        count: StepCount,
        fragments: list[list[tuple[str, torch.Tensor]]],
        buffers: list[torch.Tensor],
        outer: dict[str, Any],
        group: Optional[dist.ProcessGroup],
        offload: bool = False,
    ) -> None:
        super().__init__(count)
        pieces = [piece for fragment in fragments for piece in fragment]
        self.names = [n for n, _ in pieces]
        self.params = [p for _, p in pieces]
        self.fragments: list[range] = []  # per fragment, the indices of its pieces
        first = 0
        for fragment in fragments:
            self.fragments.append(range(first, first + len(fragment)))
            first += len(fragment)
        self.buffers = buffers  # floating-point buffers, averaged with the last fragment's pseudo-gradient
        with torch.no_grad():  # detached copies: the outer and inner optimizers' gradients never meet
            self.snapshot = [nn.Parameter(keep(p, offload)) for p in self.params]  # offload: on the host
        self.outer = torch.optim.SGD(self.snapshot, **outer)
        self.group = group  # None: one process, the average is the replica itself
        self.feedback: dict[int, torch.Tensor] = {}  # int8 wire: per fragment, the quantization error carried

    def state_dict(self) -> dict[str, Any]:
        streams = self.streams_state()  # first: it waits for the syncs in flight, which update the feedback
        feedback = {"feedback": {f: e.clone() for f, e in self.feedback.items()}} if self.feedback else {}
        return {
            "steps": self.steps,
            "snapshot": {n: s.detach().clone() for n, s in zip(self.names, self.snapshot)},
            "outer_optimizer": self.outer.state_dict(),
            "in_flight": [],
            **streams,
            **feedback,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly; the outer optimizer keeps this run's options (lr, momentum, nesterov)."""
        expected = {"steps", "snapshot", "outer_optimizer"}
        if not expected <= set(state) <= expected | {"in_flight", "merged", "feedback"}:
            raise ValueError(
                f"diloco state must have keys {sorted(expected)} (and 'in_flight', 'feedback'), got {sorted(state)}"
            )
        missing = [n for n in self.names if n not in state["snapshot"]]
        if missing:
            raise ValueError(f"diloco state has no snapshot of {missing[0]!r}: was it saved with other fragments?")
        self.load_streams(state)
        self.feedback = {int(f): e.clone() for f, e in state.get("feedback", {}).items()}
        self.count.load_state_dict(state)
        with torch.no_grad():
            for n, s in zip(self.names, self.snapshot):
                s.copy_(state["snapshot"][n])
        options = [{k: g[k] for k in ("lr", "momentum", "nesterov")} for g in self.outer.param_groups]
        self.outer.load_state_dict(state["outer_optimizer"])
        for group, values in zip(self.outer.param_groups, options):
            group.update(values)


class DiLoCo(Streamed[DiLoCoState]):
    """Local training with an outer Nesterov step on the averaged pseudo-gradient every ``period`` steps.

    Args:
        period: inner steps between two outer steps (alias ``inner_steps``, DiLoCo's name).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: its momentum, in [0, 1) (the paper's 0.9: see the docs).
        nesterov: Nesterov momentum (needs ``outer_momentum > 0``).
        wire_dtype: ``"fp32"`` (the parameters' own dtype), ``"bf16"``, ``"fp16"``, or
            ``"int8"`` (8-bit min-max codes with error feedback) for the pseudo-gradients
            (hierarchical: across nodes only; the node averages inside in full precision).
        hierarchical: the node averages the pseudo-gradients inside, each local rank carries
            its shard across nodes, the node gathers; every process then takes the outer step.
        fragments, delay: how the outer syncs are streamed (streaming DiLoCo; see
            ``streaming.Streamed``); ``fragments`` defaults to 1 with ``overlap``.
        mixing: with a delay, the merged weights are ``mixing * local + (1 - mixing) * outer``
            (the paper's alpha); None keeps the local steps taken meanwhile instead
            (``outer + local - local_at_launch``).
        overlap: the classic schedule with ``delay=1`` (one fragment unless given).
        offload: keep the global weights, the outer momentum and the weights at launch in host
            memory (pinned with CUDA), moved to the parameters' device piece by piece at a sync;
            the outer step runs on the host, so each outer sync waits once for the device (the
            average comes to the host); the steps between syncs do not. Nothing changes on CPU.

    Memory: the global weights and the outer momentum (+2 P, none of it on the device with
    ``offload``), and while a fragment's sync travels its wire buffer and (``delay`` > 0, no
    ``mixing``) its weights at launch.

    Example::

        model = unison.DataParallel(net, optimizer=opt, algorithm="diloco:period=32,wire_dtype=bf16")
        classic = unison.algorithms.create("diloco", fragments=1, delay=0)
    """

    name = "diloco"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    # An outer step is state every replica shares: launched again after a membership change. The
    # error feedback of its int8 wire belongs to the rank.
    recovery = Recovery(rank_local=("feedback",), interrupted="relaunch")
    fsdp2 = FSDP2(fault_tolerant=True)  # the local shards' outer step
    period: int = 16
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    nesterov: bool = True
    wire_dtype: Literal["fp32", "bf16", "fp16", "int8"] = "fp32"
    mixing: Optional[float] = None
    overlap: bool = False
    offload: bool = False

    def __post_init__(self) -> None:
        options.integer("period", self.period)
        options.number("outer_lr", self.outer_lr)
        options.number("outer_momentum", self.outer_momentum, 0.0, open_low=False, high=1.0)
        options.boolean("nesterov", self.nesterov)
        options.choice("wire_dtype", self.wire_dtype, (*WIRE_DTYPES, "int8"))
        options.number("mixing", self.mixing, 0.0, open_low=False, high=1.0, optional=True)
        options.boolean("overlap", self.overlap)
        options.boolean("offload", self.offload)
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0; set nesterov=False for plain outer SGD")
        super().__post_init__()
        if self.overlap and self.delay not in (None, 1):
            raise ValueError(f"overlap=True means delay=1, but delay={self.delay} was given: give only delay")

    @property
    def wire(self) -> Union[torch.dtype, str, None]:
        """What ``wire_dtype`` names, as the averaging takes it: a dtype, "int8", or None (fp32: the
        parameters' own dtype)."""
        return None if self.wire_dtype == "fp32" else WIRE_DTYPES.get(self.wire_dtype, self.wire_dtype)

    def schedule(self) -> Stagger:
        """Streamed's, where ``overlap`` means one fragment (unless given) and a delay of 1."""
        fragments = 1 if self.overlap and self.fragments is None else self.fragments
        return default_schedule(self.period, fragments, 1 if self.overlap else self.delay)

    def setup(self, replica: Replica) -> DiLoCoState:
        self.check_optimizers(replica)
        buffers = [b for _, b in replica.float_buffers] if replica.broadcast_buffers else []
        group = replica.private_group("diloco") if replica.distributed else None
        outer = {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": self.nesterov}
        fragments = fragments_of(replica.trainable, self.schedule().fragments)
        state = DiLoCoState(StepCount(self.period), fragments, buffers, outer, group, self.offload)
        if group is not None:
            self.use_nodes(replica, state, [sum(self._tensors(state, f), []) for f in range(len(fragments))])
        self.stream(replica, state, len(state.fragments))
        return state

    @property
    def int8(self) -> bool:
        return self.wire_dtype == "int8"

    def _tensors(self, state: DiLoCoState, f: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Fragment ``f``'s parameter pieces and buffers (the last fragment carries the buffers)."""
        return [state.params[i] for i in state.fragments[f]], state.buffers if f == len(state.fragments) - 1 else []

    def launch(self, replica: Replica, state: DiLoCoState, fragment: int) -> tuple[Waitable, Any]:
        """Start averaging ``fragment``'s pseudo-gradients (and buffers); keep its weights if merged late."""
        f = fragment
        params, buffers = self._tensors(state, f)
        with torch.no_grad():
            kept = state.late and self.mixing is None
            at_launch = [_kept(t, self.offload) for t in params + buffers] if kept else None
            pending: Waitable
            if state.group is not None and not self.int8 and state.levels is None:  # made in the wire buffers
                fill = partial(self._fill, state, f, len(params))
                dtype = self.wire if isinstance(self.wire, torch.dtype) else None  # not int8: a dtype or fp32's None
                pending = AsyncAverage(params + buffers, state.group, dtype, fill=fill)
                state.bytes_sent += pending.wire_bytes
                return pending, at_launch
            tensors = self._pseudo_gradients(state, f, params) + buffers
            if state.group is None:
                pending = Finished(tensors[: len(params)] + [b.detach().clone() for b in buffers])
            else:
                levels = state.levels  # hierarchical: the feedback of this rank's shards
                whole = levels.shards_numel(state.node_flats[f]) if levels else sum(t.numel() for t in tensors)
                numel = whole if self.int8 else 0
                feedback = state.feedback.setdefault(f, torch.zeros(numel, device=tensors[0].device)) if numel else None
                if feedback is not None and feedback.numel() != numel:
                    raise ValueError(
                        f"diloco's error feedback of fragment {f} has {feedback.numel()} values, this run needs "
                        f"{numel}: was the state saved with another node layout or hierarchical setting?"
                    )
                if levels is not None:  # on a thread: the buffers are copied now
                    values = tensors[: len(params)] + [b.detach().clone() for b in buffers]
                    return state.average_nodes(f, values, self.wire, feedback), at_launch
                pending = average_async(tensors, state.group, self.wire, feedback)
        state.bytes_sent += pending.wire_bytes
        return pending, at_launch

    def _fill(self, state: DiLoCoState, f: int, count: int, i: int, out: torch.Tensor) -> None:
        """Write the ``i``-th value fragment ``f`` sends into ``out``: a pseudo-gradient (the first
        ``count``: snapshot - parameter, piece by piece when the snapshot is offloaded) or a buffer."""
        params, buffers = self._tensors(state, f)
        if i >= count:
            out.copy_(buffers[i - count])
            return
        s, p = state.snapshot[state.fragments[f][i]].detach(), params[i].detach()
        if s.device == p.device:
            torch.sub(s, p, out=out)
            return
        flat_out, flat_s, flat_p = out.view(-1), s.reshape(-1), p.reshape(-1)
        for part in pieces(flat_out.numel(), flat_out.element_size()):
            flat_out[part].copy_(flat_s[part], non_blocking=True).sub_(flat_p[part])

    def _pseudo_gradients(self, state: DiLoCoState, f: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fragment ``f``'s snapshot - parameters, new tensors on the parameters' device."""
        out = [torch.empty_like(p) for p in params]
        for i, o in enumerate(out):
            self._fill(state, f, len(params), i, o)
        return out

    def merge(self, replica: Replica, state: DiLoCoState, fragment: int, result: Any, extra: Any) -> None:
        """Step the outer optimizer on ``fragment``'s averaged pseudo-gradient and write the result into the model."""
        f, averaged, at_launch = fragment, result, extra
        params, buffers = self._tensors(state, f)
        snapshot = [state.snapshot[i] for i in state.fragments[f]]
        if self.offload and params and params[0].device.type == "cuda":
            # The outer step writes the host copies: the moves of the last sync must have landed.
            torch.cuda.current_stream(params[0].device).synchronize()
        for s, g in zip(snapshot, averaged):
            s.grad = g.to(s.device)  # offloaded: the outer step runs on the host
        state.outer.step()  # steps only the pieces with a gradient: this fragment's
        with torch.no_grad():
            for s in snapshot:
                s.grad = None
            targets = [s.detach() for s in snapshot] + averaged[len(params) :]
            for t, new, old in zip(params + buffers, targets, at_launch or targets):
                for t_, new_, old_ in _pieces_on(t, new, old):
                    if at_launch is not None:  # keep the local steps taken while the average travelled
                        t_.add_(new_ - old_)
                    elif state.late and self.mixing is not None:
                        t_.mul_(self.mixing).add_(new_, alpha=1 - self.mixing)
                    else:
                        t_.copy_(new_)


def _pieces_on(
    t: torch.Tensor, new: torch.Tensor, old: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(t, new, old)`` whole when all three live on ``t``'s device; else (offloaded copies) flat
    pieces of at most ``engine.offload.PIECE_BYTES``, ``new`` and ``old`` moved to ``t``'s device.

    The moves do not wait for the device: the host copies are next written on the host only by
    the next outer step, after ``merge`` has waited for the stream (the average comes to the host)."""
    if new.device == t.device and old.device == t.device or not t.is_contiguous():
        yield t, new.to(t.device, non_blocking=True), old.to(t.device, non_blocking=True)
        return
    flat_t, flat_new, flat_old = t.view(-1), new.reshape(-1), old.reshape(-1)
    for part in pieces(flat_t.numel(), flat_t.element_size()):
        yield (
            flat_t[part],
            flat_new[part].to(t.device, non_blocking=True),
            flat_old[part].to(t.device, non_blocking=True),
        )


def _kept(t: torch.Tensor, offload: bool) -> torch.Tensor:
    """``keep(t, offload)`` without waiting for the device: the weights at launch are only ever
    copied back onto the device (in stream order), never read on the host."""
    if not offload or t.device.type != "cuda":
        return keep(t, offload)
    return empty_like(t.detach(), offload).copy_(t.detach(), non_blocking=True)
