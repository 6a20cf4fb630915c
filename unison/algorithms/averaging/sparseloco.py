"""SparseLoCo (Sarfi et al. 2025): DiLoCo's local steps, with a sparse, 2-bit outer sync.

Every ``period`` inner steps each rank adds its pseudo-gradient (the global weights at the last
sync minus its weights) to an error-feedback buffer decayed by ``beta``, sends the top-k entries
of each 64 x 64 tile of each tensor quantized to ``bits`` bits (``engine.codecs.tiles``,
``engine.codecs.tiled_topk``), and keeps the rest. The ranks all-gather the fixed-size messages, each
decodes them and takes each coordinate's mean over the ranks that sent it, and the outer step is
plain descent: ``global -= outer_lr * average`` (the error feedback stands in for DiLoCo's outer
momentum). Every rank then takes the new global weights. As the paper's release and Templar run
it; ``layout="flat"``, ``quantizer="max"`` and ``mean="world"`` give unison's first form. ``fragments`` and ``delay`` stream the
syncs as diloco's do. ``hierarchical``: the node sums the pseudo-gradients at full precision, each
local rank keeps the error feedback of its shard of whole chunks and only its sparse message
crosses nodes (``engine.hierarchy.TwoLevel``).

See docs/algorithms.md#sparseloco.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from ...engine.averaging import average_async
from ...engine.codecs.tiled_topk import TiledTopK
from ...engine.codecs.tiles import TiledBuffer, Tiles
from ...engine.codecs.topk import BITS, SCALE_DTYPES
from ...engine.comm import Finished, Waitable, start
from ...engine.comm import wait as comm_wait
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import FSDP2, Recovery
from ..schedules import StepCount
from ..streaming import Stagger, Streamed, StreamedState, default_schedule, fragments_of


class SparseLoCoState(StreamedState):
    """Per fragment, its layout (``Tiles``), the global weights and this rank's error feedback
    (float32 buffers in that layout), its codec and its message buffers; the step count and the
    syncs in flight.

    Saved: the global weights (shared: equal on every rank) and the error feedback (rank-local:
    ``feedback``). Under fault tolerance, while a fragment's sync travels, its error feedback as it
    was before the launch (``before``): a sync abandoned by a membership change starts again from it.
    """

    __slots__ = (
        "names",
        "params",
        "buffers",
        "fragments",
        "tiles",
        "globals",
        "errors",
        "codecs",
        "messages",
        "group",
        "node_parts",
        "before",
    )

    def __init__(
        self,
        count: StepCount,
        fragments: list[list[tuple[str, torch.Tensor]]],
        buffers: list[torch.Tensor],
        tiles: list[Tiles],
        codecs: list[TiledTopK],
        group: Optional[dist.ProcessGroup],
        world: int,
    ) -> None:
        super().__init__(count)
        # hyperparameters and layout
        self.names = [n for fragment in fragments for n, _ in fragment]
        self.params: list[list[torch.Tensor]] = [[p for _, p in fragment] for fragment in fragments]
        self.fragments: list[list[str]] = [[n for n, _ in fragment] for fragment in fragments]
        self.buffers = buffers  # floating-point buffers, averaged densely with the last fragment
        self.tiles = tiles
        self.codecs = codecs
        self.group = group  # None: one process, the average is this rank's own message
        # internal state: float32 copies in each fragment's layout, allocated once (the padding stays zero)
        device = self.params[0][0].device
        self.globals = [TiledBuffer(t, device) for t in tiles]
        for glob, ps in zip(self.globals, self.params):
            glob.load(ps)
        self.errors = [TiledBuffer(t, device) for t in tiles]
        # per fragment: this rank's message and every rank's ([world, nbytes]), reused at each sync
        self.messages = [(c.empty(), c.empty(world)) for c in codecs]
        self.node_parts: list[NodePart] = []  # hierarchical: per fragment, this rank's shard and its buffers
        self.before: dict[int, torch.Tensor] = {}  # per fragment in flight, its error feedback before the launch

    def by_name(self, buffers: list[TiledBuffer]) -> dict[str, torch.Tensor]:
        """Each tensor's values in ``buffers``, shaped like its parameter, by name."""
        out: dict[str, torch.Tensor] = {}
        for names, params, b in zip(self.fragments, self.params, buffers):
            out.update(zip(names, b.tiles.unpad(b.flat, [p.shape for p in params])))
        return out

    def state_dict(self) -> dict[str, Any]:
        streams = self.streams_state()  # first: it waits for the syncs in flight
        return {
            **self.count.state_dict(),
            "global": self.by_name(self.globals),
            "feedback": self.by_name(self.errors),
            "in_flight": [],
            **streams,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore exactly: the global weights, this rank's error feedback, the syncs in flight."""
        expected = {"steps", "global", "feedback"}
        if not expected <= set(state) <= expected | {"in_flight", "merged"}:
            raise ValueError(
                f"sparseloco state must have keys {sorted(expected)} (and 'in_flight', 'merged'), got {sorted(state)}"
            )
        for key in ("global", "feedback"):
            missing = [n for n in self.names if n not in state[key]]
            if missing:
                raise ValueError(f"sparseloco state has no {key} of {missing[0]!r}: was it saved with other fragments?")
        self.load_streams(state)
        self.count.load_state_dict(state)
        self.before.clear()  # the syncs in flight loaded have landed: they are merged as they are
        with torch.no_grad():
            for key, buffers in (("global", self.globals), ("feedback", self.errors)):
                for f, ps, b in zip(self.fragments, self.params, buffers):
                    b.flat.zero_()
                    b.load([state[key][n].reshape(p.shape).to(b.flat) for n, p in zip(f, ps)])


class SparseLoCo(Streamed[SparseLoCoState]):
    """Local training with a sparse outer step every ``period`` steps: the top-k of each tile of
    an error-feedback buffer, values in ``bits`` bits, gathered by all-gather and averaged over
    their senders, plain outer descent.

    Args:
        period: inner steps between two outer steps (SparseLoCo's H).
        outer_lr: the outer step's learning rate (the paper's 1.0).
        beta: the error feedback's decay, in [0, 1] (the paper's 0.95); 1 keeps it whole.
        layout: where the top-k is taken. ``"tiles"`` (the references'): each tensor on its own,
            a matrix in ``tile x tile`` tiles (sides the largest divisors of its rows and columns
            up to ``tile``), a vector in chunks of ``tile`` values, so every tensor sends its
            share; ``"flat"``: the fragment's tensors end to end in chunks of ``chunk`` values,
            where tensors compete for each chunk's entries (``engine.codecs.tiles``).
        tile: the side of a tile (``layout="tiles"``; default 64).
        chunk: values per chunk (``layout="flat"``; default 4096).
        density: the share of each chunk sent, in (0, 1]: 1/64, Templar's production (64 of a
            4096-value tile; the paper sweeps 1-3%).
        topk: the entries per ``tile x tile`` tile (scaled to smaller tiles and to vectors' chunks,
            as the reference does) or per ``chunk``, instead of ``density``.
        fixed_k: Templar's form (``layout="tiles"``): every tile and vector chunk sends what a whole
            ``tile x tile`` tile sends, its length at most (a 48 x 40 tile: 64 values, not 30).
        dense_vectors: Templar's form for vectors (``layout="tiles"``): a tensor cut as a vector (a
            bias, a norm's gain) is sent whole, every value in ``bits`` bits.
        median_clip: Templar's defence (``layout="tiles"``): before the mean, each rank's decoded
            values of a tensor are scaled by ``min(1, median norm / own norm)`` over the ranks'
            norms of that tensor, so that one bad or hostile replica weighs no more than the
            median one. Nothing more is sent.
        bits: bits per value sent: 2, 4 or 8.
        quantizer: ``"bins"`` (the references'): the values a tensor sends centred on their mean,
            ``2**bits`` bins over +-3 standard deviations, each code decoded to the mean of the
            values in its bin (a table of ``2**bits`` values per tensor travels along);
            ``"max"``: each chunk's values on a symmetric grid scaled by its largest.
        mean: ``"senders"`` (the references'): each coordinate's mean over the ranks that sent
            it; ``"world"``: the sum of the messages over the number of ranks (a coordinate sent
            by one rank of four moves a quarter as far).
        scale_dtype: the dtype of the tables (``"bins"``) or scales (``"max"``) on the wire:
            ``"fp32"`` or ``"bf16"``.
        fragments, delay: how the syncs are streamed (see ``streaming.Streamed``); the default
            is the paper's schedule, one fragment and no delay.
        hierarchical: the node sums the pseudo-gradients inside at full precision; each local
            rank keeps the error feedback of its shard (whole chunks) of the node's mean and sends
            its sparse message to the same local rank of every other node; the node gathers the
            decoded average. Only ``nodes - 1`` messages per local rank cross nodes.

    A message is the tables (or scales), each chunk's ``k`` positions (12 bits up to 4096 values
    a chunk, two to 3 bytes) and the codes bit-packed: about ``density * (12 + bits) / 32`` of
    fp32's bytes (0.68% at the defaults; ``engine.codecs.tiled_topk``): on 4 ranks, about 1/70 of what
    fp32 diloco sends (an all-gather's bytes grow with the ranks: ``W / 2`` times the message's
    share). Floating-point buffers (BatchNorm statistics) are averaged densely with the last fragment.

    Memory: the global weights and the error feedback, in float32 (+2 P for a float32 model),
    each rank's message (about 0.007 P per rank at the defaults), under ``fault_tolerant=True``
    while a sync travels its fragment's error feedback before the launch (what a sync abandoned by
    a failure starts again from) and, with a ``delay``, its weights at launch; hierarchical, a
    float32 buffer the node's rounds run in (+1 P).

    Example::

        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        model = unison.DataParallel(net, optimizer=opt, algorithm="sparseloco:period=30")
    """

    name = "sparseloco"
    replicas_drift = True
    reduces_gradients = False
    needs_optimizers = True
    # The outer step is state every replica shares: a sync a failure interrupts is launched again on
    # the new membership, from the error feedback as it was before (``release``). The error feedback
    # belongs to the rank.
    recovery = Recovery(rank_local=("feedback",), interrupted="relaunch")
    fsdp2 = FSDP2(fault_tolerant=True)  # the local shards' outer step
    period: int = 16
    outer_lr: float = 1.0
    beta: float = 0.95
    layout: Literal["tiles", "flat"] = "tiles"
    tile: Optional[int] = None
    chunk: Optional[int] = None
    density: float = 1 / 64  # 64 of a 64 x 64 tile: Templar's production setting
    topk: Optional[int] = None
    fixed_k: bool = False
    dense_vectors: bool = False
    median_clip: bool = False
    bits: int = 2
    quantizer: Literal["bins", "max"] = "bins"
    mean: Literal["senders", "world"] = "senders"
    scale_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        options.integer("period", self.period)
        options.number("outer_lr", self.outer_lr)
        options.number("beta", self.beta, 0.0, open_low=False)
        if self.beta > 1:
            raise options.OptionError("beta", "a number in [0, 1] (1: the error feedback is never decayed)", self.beta)
        options.choice("layout", self.layout, ("tiles", "flat"))
        options.integer("tile", self.tile, optional=True)
        options.integer("chunk", self.chunk, optional=True)
        if self.layout == "tiles" and self.chunk is not None:
            raise options.OptionError(
                "chunk", "unset with layout='tiles' (tiles are tile x tile; layout='flat' cuts chunks)", self.chunk
            )
        if self.layout == "flat" and self.tile is not None:
            raise options.OptionError(
                "tile",
                "unset with layout='flat' (its chunks are chunk values long; layout='tiles' cuts tiles)",
                self.tile,
            )
        options.number("density", self.density)
        if self.density > 1:
            raise options.OptionError("density", "a number in (0, 1] (the share of each chunk sent)", self.density)
        options.integer("topk", self.topk, optional=True)
        most = self.size**2 if self.layout == "tiles" else self.size
        if self.topk is not None and self.topk > most:
            what = f"at most tile * tile ({most})" if self.layout == "tiles" else f"at most chunk ({most})"
            raise options.OptionError("topk", f"{what}: the entries sent per tile or chunk", self.topk)
        options.boolean("fixed_k", self.fixed_k)
        options.boolean("dense_vectors", self.dense_vectors)
        options.boolean("median_clip", self.median_clip)
        for name in ("fixed_k", "dense_vectors", "median_clip"):
            if getattr(self, name) and self.layout != "tiles":
                raise options.OptionError(
                    name, "False with layout='flat' (Templar's forms cut each tensor on its own)", True
                )
        options.choice("bits", self.bits, BITS)
        options.choice("quantizer", self.quantizer, ("bins", "max"))
        options.choice("mean", self.mean, ("senders", "world"))
        options.choice("scale_dtype", self.scale_dtype, tuple(SCALE_DTYPES))
        super().__post_init__()

    @property
    def size(self) -> int:
        """The tile's side (``layout="tiles"``) or the chunk's length (``"flat"``)."""
        if self.layout == "tiles":
            return 64 if self.tile is None else self.tile
        return 4096 if self.chunk is None else self.chunk

    def schedule(self) -> Stagger:
        """The paper's schedule (one fragment, no delay) unless ``fragments`` or ``delay`` is given."""
        fragments = 1 if self.fragments is None else self.fragments
        return default_schedule(self.period, fragments, 0 if self.delay is None else self.delay)

    def setup(self, replica: Replica) -> SparseLoCoState:
        self.check_optimizers(replica)
        buffers = [b for _, b in replica.float_buffers] if replica.broadcast_buffers else []
        group = replica.private_group("sparseloco") if replica.distributed else None
        world = dist.get_world_size(group) if group is not None else 1
        fragments = fragments_of(replica.trainable, self.schedule().fragments)
        device = fragments[0][0][1].device
        scale = SCALE_DTYPES[self.scale_dtype]
        tiles = [
            Tiles(
                [p.shape for _, p in f],
                self.layout,
                self.size,
                self.density,
                self.topk,
                self.fixed_k,
                self.dense_vectors,
            )
            for f in fragments
        ]
        codecs = [TiledTopK(t.runs, self.bits, self.quantizer, scale, device) for t in tiles]
        scratch = torch.empty(2 * max(c.block_numel for c in codecs), device=device)  # one sync at a time
        for c in codecs:
            c.share(scratch)
        state = SparseLoCoState(StepCount(self.period), fragments, buffers, tiles, codecs, group, world)
        if self.hierarchical and group is not None:
            topology, private = replica.topology, replica.private_group
            state.levels = TwoLevel.build(topology, group, private, self.name, "sparseloco/nodes", thread=True)
            if state.levels is not None:
                state.node_parts = [NodePart(state.levels, t, self, device, scratch) for t in tiles]
        self.stream(replica, state, len(fragments))
        return state

    def launch(self, replica: Replica, state: SparseLoCoState, fragment: int) -> tuple[Waitable, Any]:
        """Fold ``fragment``'s pseudo-gradient into its error feedback, encode its top-k (the rest
        stays in the feedback) and start the all-gather; keep its weights if merged late, and its
        error feedback before the fold until the sync merges."""
        f, params = fragment, state.params[fragment]
        error, codec, tiles = state.errors[f], state.codecs[f], state.tiles[f]
        mine, everyone = state.messages[f]
        with torch.no_grad():
            at_launch = [p.detach().clone() for p in params] if state.late else None
            if state.group is not None and replica.fault_tolerant:  # an abandoned sync restarts from it
                state.before[f] = error.flat.clone()
            buffers = state.buffers if f == len(state.params) - 1 else []
            if state.levels is not None:
                return self._launch_nodes(state, f, params, buffers), at_launch
            if self.beta != 1:
                error.flat.mul_(self.beta)
            error.flat.add_(state.globals[f].flat)  # + global - params: the pseudo-gradient
            torch._foreach_sub_(error.views, tiles.shaped([p.detach() for p in params]))
            codec.encode(error.flat, mine)
            tiles.zero_pad(error.flat)  # a padding entry sent (as any value) is not kept
            if state.group is None:
                return Finished([mine.view(1, -1)] + [b.detach().clone() for b in buffers]), at_launch
            pending = Exchange(mine, everyone, state.group, buffers)
        state.bytes_sent += pending.wire_bytes
        return pending, at_launch

    def _launch_nodes(
        self, state: SparseLoCoState, f: int, params: list[torch.Tensor], buffers: list[torch.Tensor]
    ) -> Waitable:
        """Hierarchical: write ``fragment``'s pseudo-gradient into its node buffer and run the
        node's round on the levels' thread; the buffers are averaged flat beside it."""
        levels, part, glob, tiles = state.levels, state.node_parts[f], state.globals[f], state.tiles[f]
        assert levels is not None and state.group is not None
        part.work.copy_(glob.flat)  # its padding is zero
        torch._foreach_sub_(tiles.views(part.work), tiles.shaped([p.detach() for p in params]))
        pending = levels.submit(self._node_round, state, f, meter=state)
        averaged = average_async(buffers, state.group) if buffers else None
        if averaged is not None:
            state.bytes_sent += averaged.wire_bytes
        return NodeExchange(pending, averaged)

    def _node_round(self, state: SparseLoCoState, f: int) -> torch.Tensor:
        """On the levels' thread: the node's sum of this rank's shard, folded (as the node's mean)
        into this rank's error feedback, its top-k all-gathered across nodes, decoded in node order
        and averaged, and every shard's average gathered in the node; returns the dense average."""
        levels, part, error = state.levels, state.node_parts[f], state.errors[f]
        assert levels is not None
        work, (start, end) = part.work, levels.shard(part.bounds)
        with torch.no_grad():
            shard = levels.scatter(work, part.bounds)
            codec, message, everyone = part.codec, part.mine, part.everyone
            if codec is not None and message is not None and everyone is not None:
                mine = error.flat[start:end]
                if self.beta != 1:
                    mine.mul_(self.beta)
                mine.add_(shard, alpha=1.0 / levels.local_size)
                codec.encode(mine, message)
                state.tiles[f].zero_pad(error.flat)  # a padding entry sent is not kept
                comm_wait(start_gather(everyone, message, levels.inter))
                levels.inter_bytes += (levels.nodes - 1) * message.numel()
                shard = work[start:end].zero_()
                codec.mean_into(everyone, shard, 1.0, self.mean == "senders", self.median_clip)  # in node order
            return levels.gather(work, shard, part.bounds)

    def merge(self, replica: Replica, state: SparseLoCoState, fragment: int, result: Any, extra: Any) -> None:
        """The outer step on ``fragment``: ``global -= outer_lr * mean(decoded messages)``, then
        the weights take the new global weights (keeping the local steps taken meanwhile if late)."""
        f, at_launch = fragment, extra
        state.before.pop(f, None)
        messages, averaged = result[0], result[1:]
        glob, codec, tiles = state.globals[f], state.codecs[f], state.tiles[f]
        with torch.no_grad():
            if messages.dtype == torch.uint8:  # in rank order: every rank adds the same values in the same order
                codec.mean_into(messages, glob.flat, -self.outer_lr, self.mean == "senders", self.median_clip)
            else:  # hierarchical: the decoded average itself, the same bits on every rank
                glob.flat.add_(messages, alpha=-self.outer_lr)
            tiles.zero_pad(glob.flat)
            params = tiles.shaped([p.detach() for p in state.params[f]])
            if at_launch is None:
                torch._foreach_copy_(params, glob.views)
            else:  # keep the local steps taken while the sync travelled
                torch._foreach_add_(params, torch._foreach_sub(glob.views, tiles.shaped(at_launch)))
            if averaged:
                torch._foreach_copy_([b.detach() for b in state.buffers], averaged)

    def release(self, replica: Replica, state: SparseLoCoState) -> None:
        """The members changed: the syncs in flight are abandoned, to be launched again at the next
        step; each fragment's error feedback goes back to what it was before its launch, so that the
        launch again folds its pseudo-gradient in once (and applies ``beta`` once)."""
        if state.streams is not None:
            with torch.no_grad():
                for f in state.streams.inflight:
                    before = state.before.pop(f, None)
                    if before is not None:
                        state.errors[f].flat.copy_(before)
        state.before.clear()
        super().release(replica, state)


class Exchange:
    """Every rank's message (``everyone[r]`` is rank ``r``'s), gathered from ``mine``, and the
    dense average of ``buffers``, launched at construction; ``wait()`` gives ``[everyone, *averages]``.
    ``wire_bytes``: what this rank sends (its message to each other rank, and its buffers)."""

    def __init__(
        self, mine: torch.Tensor, everyone: torch.Tensor, group: dist.ProcessGroup, buffers: list[torch.Tensor]
    ) -> None:
        world = dist.get_world_size(group)
        self._everyone = everyone
        self._work = start(dist.all_gather, list(everyone.unbind(0)), mine, group=group)
        self._buffers = average_async(buffers, group) if buffers else None
        self.wire_bytes = (world - 1) * mine.numel() + (self._buffers.wire_bytes if self._buffers else 0)

    def wait(self) -> list[torch.Tensor]:
        comm_wait(self._work)
        return [self._everyone, *(self._buffers.wait() if self._buffers is not None else [])]


def start_gather(everyone: torch.Tensor, mine: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Any:
    """Start the all-gather of ``mine`` into the rows of ``everyone`` over ``group``."""
    return start(dist.all_gather, list(everyone.unbind(0)), mine, group=group)


class NodePart:
    """Hierarchical: one fragment's layout cut between the local ranks at chunk boundaries
    (``bounds``), the codec of this rank's shard (None when its shard is empty: then it sends
    nothing, as the same local rank on every node), its message and every node's, and the float32
    buffer (``work``, in the fragment's layout) the node's rounds run in."""

    __slots__ = ("bounds", "codec", "mine", "everyone", "work")

    def __init__(
        self, levels: TwoLevel, tiles: Tiles, algo: SparseLoCo, device: torch.device, scratch: torch.Tensor
    ) -> None:
        self.bounds = tiles.bounds(levels.local_size)
        start, end = levels.shard(self.bounds)
        self.codec: Optional[TiledTopK] = None
        self.mine: Optional[torch.Tensor] = None
        self.everyone: Optional[torch.Tensor] = None
        if end > start:
            scale = SCALE_DTYPES[algo.scale_dtype]
            self.codec = TiledTopK(tiles.slice(start, end), algo.bits, algo.quantizer, scale, device)
            if 2 * self.codec.block_numel <= scratch.numel():
                self.codec.share(scratch)
            self.mine, self.everyone = self.codec.empty(), self.codec.empty(levels.nodes)
        self.work = torch.zeros(tiles.numel, dtype=torch.float32, device=device)


class NodeExchange:
    """A hierarchical sync in flight: the node's round on the levels' thread and the flat average of
    the buffers; ``wait()`` gives ``[dense average, *buffer averages]`` (the average copied: the
    node buffer is reused by the next sync)."""

    def __init__(self, pending: Any, buffers: Any) -> None:
        self._pending, self._buffers = pending, buffers

    def wait(self) -> list[torch.Tensor]:
        average = self._pending.wait()
        return [average, *(self._buffers.wait() if self._buffers is not None else [])]
