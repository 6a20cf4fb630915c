"""DeMo (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870): Decoupled Momentum Optimization.

Each rank folds its gradient into a momentum of its own (``m = beta m + g``), takes the DCT of
each chunk of it (``layout="tiles"``: the 2-D DCT of each tile of a matrix, as the paper's code
does), sends the top-k coefficients of each chunk and removes them from ``m`` (the
rest stays, as error feedback does). The ranks all-gather the fixed-size messages
(``engine.codecs.dct``), each decodes and averages them and takes the inverse DCT: that average (or
its sign, ``sign=True``) is the gradient the user's optimizer sees. Bucket by bucket, so the
exchange overlaps with backward. ``hierarchical``: the node sums the gradients at full precision
and each local rank keeps the momentum of its shard (whole chunks) of the node's mean; only its
sparse message crosses nodes (``engine.hierarchy.TwoLevel``). Under fault tolerance a round a
failure interrupts is done again with each gradient folded once: the engine's saved copy of the
gradient is rewritten so that folding it into the momentum the round left gives the momentum the
round folded (``Entry.lend``); hierarchical, each shard's momentum is copied before its fold and
put back (``Entry.before``). See docs/algorithms.md#demo.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal, Optional, Union

import torch
import torch.distributed as dist

from ...engine import offload
from ...engine.buckets import Bucket
from ...engine.codecs.dct import Codec, codec, dct_matrix, message_bytes, transform_, transform_tiles_
from ...engine.codecs.schedule import WHOLE, schedule_for
from ...engine.codecs.tiled_topk import BLOCK as TILED_BLOCK
from ...engine.codecs.tiled_topk import TiledTopK
from ...engine.codecs.tiles import Tiles
from ...engine.codecs.topk import BITS, BLOCK, SCALE_DTYPES
from ...engine.comm import Pending, Waitable, start
from ...engine.comm import wait as comm_wait
from ...engine.hierarchy import TwoLevel
from ...replica import Replica
from .. import options
from ..contract import Algorithm, Recovery, State
from .qadam_optimizer import QAdamOptimizer

#: Optimizers that scale each step by statistics of their own: a sign in [-1, 1] is not what they expect.
ADAPTIVE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.SparseAdam,
)


class Entry:
    """One bucket's momentum in DeMo's layout, in one float32 flat: ``layout="chunks"``, each
    parameter's values from a whole chunk on, padded with zeros to whole chunks; ``"tiles"``,
    the parameters cut in tiles (``tiles``, ``engine.codecs.tiles.Tiles``), each tile contiguous.
    ``views`` pair with the parameters as ``pair`` shapes them, ``pad`` lists the padding's
    positions (kept at zero). Under fault tolerance a hierarchical rank's ``before`` holds its
    shard's momentum as it was before the fold of the round in flight (``folded``: the slice it
    folded into)."""

    __slots__ = ("flat", "views", "shapes", "tiles", "offsets", "pad", "target", "targets", "before", "folded")

    def __init__(
        self, like: list[torch.Tensor], chunk: int, device: torch.device, tiles: Optional[Tiles] = None
    ) -> None:
        self.shapes = [t.shape for t in like]
        self.tiles = tiles
        self.offsets: list[int] = []  # chunks: where each parameter starts in ``flat``
        if tiles is not None:
            self.flat = torch.zeros(tiles.numel, dtype=torch.float32, device=device)
            self.views = tiles.views(self.flat)
            self.pad = None if tiles.pad is None else tiles.pad.to(device)
        else:
            sizes = [-(-t.numel() // chunk) * chunk for t in like]
            self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
            self.views = [self.flat[o : o + t.numel()].view(t.shape) for o, t in zip(self.offsets, like)]
            pad = [torch.arange(o + t.numel(), o + n) for o, t, n in zip(self.offsets, like, sizes) if n > t.numel()]
            self.pad = torch.cat(pad).to(device) if pad else None
        self.target: Optional[torch.Tensor] = None  # the shared decode buffer these views are of
        self.targets: list[torch.Tensor] = []
        self.before: Optional[torch.Tensor] = None  # fault tolerance: the momentum before this round's fold
        self.folded: Optional[slice] = None  # what this round folded a gradient into (``before`` holds it)

    def pair(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``tensors`` (shaped as the parameters, contiguous) shaped as ``views``."""
        return tensors if self.tiles is None else self.tiles.shaped(tensors)

    def named(self) -> list[torch.Tensor]:
        """Copies of the momentum, one per parameter, shaped as it."""
        return [view.reshape(shape).clone() for view, shape in zip(self.views, self.shapes)]

    def keep(self, on_host: bool, first: int = 0, last: Optional[int] = None) -> None:
        """Copy ``flat[first:last]`` (what the fold is about to change) into ``before``, in host
        memory if ``on_host`` (``DataParallel(ft_offload=True)``)."""
        if self.before is None:
            self.before = offload.empty_like(self.flat, on_host)
        self.folded = slice(first, last)
        self.before[self.folded].copy_(self.flat[self.folded])

    def lend(self, saved: list[torch.Tensor], beta: float, folded: bool) -> None:
        """Rewrite ``saved``, the engine's copies of this round's gradients
        (``Replica.saved_gradients``), instead of keeping the momentum before the fold: right
        after the fold (``folded``) they take the momentum folded, ``f = beta m + g``; once the
        sent coefficients have left the momentum (``m'``), ``f - beta m'``. A round a failure
        interrupts is done again from them over the momentum it left, which folds to
        ``beta m' + (f - beta m') = f`` (to float rounding) and sends the same message; where no
        redo comes (the others finished the round) the momentum stands as the round left it."""
        for out, view in zip(self.pair(saved), self.views):
            if folded:
                out.copy_(view)
            else:
                out.sub_(view.to(out.device), alpha=beta)

    def undo(self) -> None:
        """Put back what this round's fold changed (nothing if it folded nothing)."""
        if self.folded is not None and self.before is not None:
            self.flat[self.folded].copy_(self.before[self.folded])
        self.folded = None

    def target_views(self, target: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``target`` (the decode buffer) laid out as ``views`` are in ``flat``."""
        if self.target is not target:
            self.target = target
            flat = target[: self.flat.numel()]
            if self.tiles is not None:
                self.targets = self.tiles.views(flat)
            else:
                self.targets = [flat[o : o + v.numel()].view(v.shape) for o, v in zip(self.offsets, self.views)]
        return self.targets


class Momenta:
    """Every bucket's momentum (``Entry``), created at zero on a bucket's first use and saved by
    parameter name, so a checkpoint restores exactly whatever the bucket plan (as ``FlatState``)."""

    def __init__(self, chunk: int, density: Optional[float] = None) -> None:
        self.chunk = chunk
        self.density = density  # layout="tiles": the share of each tile sent (else chunks)
        self._entries: dict[tuple[str, ...], Entry] = {}
        self._loose: dict[str, torch.Tensor] = {}

    def get(self, bucket: Bucket) -> Entry:
        key = tuple(bucket.names)
        entry = self._entries.get(key)
        if entry is None:
            self._retire(set(key))
            entry = self._entries[key] = Entry(list(bucket.views), self.chunk, bucket.flat.device, self.tiles(bucket))
            for name, view in zip(key, entry.views):
                if name in self._loose:
                    view.copy_(self._loose.pop(name).reshape(view.shape))
        return entry

    def tiles(self, bucket: Bucket) -> Optional[Tiles]:
        """``layout="tiles"``: the bucket's tiles (None: chunks)."""
        if self.density is None:
            return None
        return Tiles([v.shape for v in bucket.views], "tiles", self.chunk, self.density)

    def _retire(self, names: set[str]) -> None:
        """Turn the entries of buckets sharing any of ``names`` (a re-plan) back into per-parameter tensors."""
        for key in [k for k in self._entries if names.intersection(k)]:
            entry = self._entries.pop(key)
            self._loose.update(zip(key, entry.named()))

    def settle(self) -> None:
        """The round completed: its folds stand."""
        for entry in self._entries.values():
            entry.folded = None

    def undo(self) -> None:
        """The round in flight was abandoned: every momentum it folded a gradient into goes back to
        what it was before, so the round done again folds it once."""
        for entry in self._entries.values():
            entry.undo()

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {name: t.clone() for name, t in self._loose.items()}
        for key, entry in self._entries.items():
            out.update(zip(key, entry.named()))
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._entries.clear()
        self._loose = {name: t.detach().clone().float() for name, t in state.items()}


class DemoState(State):
    """The rank's momenta (rank-local: saved as ``feedback``), each bucket's codec and message buffers, and the shared work buffers."""

    __slots__ = (
        "momenta",
        "keeps",
        "on_host",
        "codecs",
        "scratch",
        "target",
        "counts",
        "matrices",
        "tile_matrices",
        "wire",
        "levels",
        "node_parts",
    )

    def __init__(
        self,
        chunk: int,
        levels: Optional[TwoLevel] = None,
        keeps: bool = False,
        on_host: bool = False,
        density: Optional[float] = None,
    ) -> None:
        super().__init__()
        # internal state
        self.momenta = Momenta(chunk, density)
        self.keeps = keeps  # fault tolerance: a round can be done again (``Entry.lend``, ``Entry.keep``)
        self.on_host = on_host  # ft_offload=True: copies of the momentum before a fold live in host memory
        self.levels = levels  # hierarchical: the node layout and its rounds' thread
        self.node_parts: dict[int, NodePart] = {}  # hierarchical, per bucket index: its shard and buffers
        # per bucket index: (its padded length, codec, this rank's message, every rank's [world, nbytes])
        self.codecs: dict[int, tuple[int, Union[Codec, TiledTopK], torch.Tensor, torch.Tensor]] = {}
        self.wire: dict[tuple[str, ...], int] = {}  # layout="tiles": a message's bytes, by the bucket's names
        # work buffers shared by the buckets (used one at a time, on the main thread)
        self.scratch: Optional[torch.Tensor] = None  # a block of rows (transforms, magnitudes): 256 KiB
        self.target: Optional[torch.Tensor] = None  # the decoded average: the largest bucket's padded length
        # mean="senders": how many ranks sent each coefficient, as long as ``target`` (used by the flat
        # rounds on the main thread or the node rounds on the levels' thread, never both)
        self.counts: Optional[torch.Tensor] = None
        self.matrices: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the DCT and its transpose
        self.tile_matrices: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layout="tiles": the same, by size

    def close(self) -> None:
        if self.levels is not None:
            self.levels.close()
            self.levels = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's momentum by parameter name (what it has not sent yet)."""
        return {"feedback": self.momenta.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = sorted(set(state) - {"feedback"})
        if unknown:
            raise ValueError(f"demo state has unknown entries {unknown}; expected 'feedback' (the momentum)")
        self.momenta.load_state_dict(state.get("feedback", {}))


class Demo(Algorithm[DemoState]):
    """DeMo: each rank's momentum, chunk-wise DCT, top-k coefficients all-gathered and averaged.

    Args:
        beta: the momentum's decay, in [0, 1) (the paper's 0.999).
        chunk: values per DCT chunk; each parameter is cut into chunks of exactly this many
            (the last padded with zeros). The DCT is a ``chunk x chunk`` matrix product: cost
            grows with ``chunk``.
        topk: coefficients sent per chunk (at most ``chunk``).
        sign: the optimizer sees the sign of the averaged direction (the paper's signum: pair it
            with ``torch.optim.SGD``, as the paper does); False: the direction itself.
        mean: ``"senders"`` (the paper's code): each coefficient's mean over the ranks that sent
            it; ``"world"``: the sum of the messages over the number of ranks (a coefficient one
            rank of four sent moves a quarter as far).
        bits: 2, 4 or 8 quantizes the values sent with one scale per chunk (``engine.codecs.topk``);
            32 sends them as float32, as the paper does.
        scale_dtype: with 2, 4 or 8 ``bits``, the dtype of each chunk's scale on the wire:
            ``"bf16"`` (the default) or ``"fp32"`` (4 bytes instead of 2: with
            ``chunk=64,topk=2,bits=2`` a chunk sends 6.5 bytes instead of 4.5).
        layout: ``"chunks"``: every parameter cut into chunks of ``chunk`` values, a 1-D DCT
            each; ``"tiles"`` (the paper's code): a matrix (seen as ``shape[0] x rest``) cut into
            ``chunk x chunk`` tiles (each side the largest divisor of its dimension not above
            ``chunk``: ``engine.codecs.tiles.Tiles``), a 2-D DCT each, and ``topk / chunk`` of each
            tile's coefficients sent (128 of a 64 x 64 tile at the defaults: the same share);
            vectors in chunks as before. Its indices take 12 bits (a tile holds up to 4096
            values) and its ``bits``-bit values one scale per tile. Not with ``hierarchical``.
        hierarchical: the node sums the gradients at full precision; each local rank keeps the
            momentum of its shard (whole chunks) of the node's mean and all-gathers its message
            with the same local rank of the other nodes; the node gathers the direction.

    A message is, per chunk, ``topk`` uint8 indices (chunk up to 256), their ``bits``-bit codes and
    a scale: 4.5 bytes per 64 values at the defaults, 1.8% of the fp32 gradient's bytes (with
    float32 values, ``5 topk / (4 chunk)``); every rank sends it to every other (all-gather), so
    against a ring allreduce's ``2 (W-1)/W`` copies it is ``W/2`` times that ratio: 1/28 of
    allreduce's bytes on 4 ranks. With ``layout="tiles"`` a 64 x 64 tile sends 128 entries with
    12-bit indices and one scale: 3.5 bytes per 64 values. The defaults are the paper's algorithm (sign, SGD, the mean
    over senders) with values in 2 bits instead of its float32: on charlm (4 ranks, 20 epochs,
    3 seeds) 0.4% above allreduce's validation loss (docs/benchmarks.md).

    Memory: the momentum, float32 (1 P); each bucket's messages (``W + 1`` of them, about
    ``0.02 (W + 1)`` P at the defaults); one bucket-sized decode buffer and, with
    ``mean="senders"``, one bucket-sized count buffer (``layout="tiles"``: the tiled codec's
    chosen entries and their positions instead, 8 bytes for each value sent, 0.06 P at the
    defaults); hierarchical, a float32 buffer per bucket the node's rounds run in (+1 P). Under ``fault_tolerant=True`` nothing more
    than the saved gradients every gradient algorithm keeps (+1 P), rewritten so that an
    interrupted round done again from them folds what it folded; hierarchical, a copy of each
    shard's momentum before its fold (+1 P, in host memory with ``ft_offload=True``).

    Example::

        opt = torch.optim.SGD(net.parameters(), lr=1e-2)
        model = unison.DataParallel(net, optimizer=opt, algorithm="demo")
    """

    name = "demo"
    #: It sends each rank's momentum, which must see every gradient: sparse gradients are refused.
    sparse_gradients: ClassVar[bool] = False
    # A failure that interrupts a round has it done again from the saved gradients, rewritten so that
    # each gradient is folded once (``Entry.lend``; hierarchical: ``release`` puts each shard's momentum
    # back). The momentum belongs to the rank.
    recovery = Recovery(rank_local=("feedback",))
    beta: float = 0.999
    chunk: int = 64
    topk: int = 2
    sign: bool = True
    mean: Literal["senders", "world"] = "senders"
    bits: int = 2
    scale_dtype: Optional[Literal["fp32", "bf16"]] = None  # bf16 for quantized values
    layout: Literal["chunks", "tiles"] = "chunks"
    hierarchical: bool = False

    def __post_init__(self) -> None:
        options.number("beta", self.beta, 0.0, open_low=False, high=1.0)
        options.integer("chunk", self.chunk)
        options.integer("topk", self.topk)
        if self.topk > self.chunk:
            raise options.OptionError(
                "topk",
                f"at most chunk ({self.chunk}): the coefficients sent per chunk; lower it or raise chunk",
                self.topk,
            )
        options.boolean("sign", self.sign)
        options.choice("mean", self.mean, ("senders", "world"))
        options.choice("bits", self.bits, (*BITS, 32))
        if self.scale_dtype is not None:
            options.choice("scale_dtype", self.scale_dtype, tuple(SCALE_DTYPES))
            if self.value_bits is None:
                raise options.OptionError(
                    "scale_dtype",
                    "unset when bits is 32 (float32 values carry no scale); set bits=2, 4 or 8",
                    self.scale_dtype,
                )
        options.choice("layout", self.layout, ("chunks", "tiles"))
        options.boolean("hierarchical", self.hierarchical)
        if self.hierarchical and self.layout == "tiles":
            raise options.OptionError(
                "layout",
                "'chunks' with hierarchical=True (the node's shards are cut at chunk boundaries; tiles "
                "are not built for them): pass layout='chunks' or hierarchical=False",
                self.layout,
            )
        super().__post_init__()

    @property
    def value_bits(self) -> Optional[int]:
        """The bits of a value sent: 2, 4 or 8, or None for float32 (``bits=32``)."""
        return None if self.bits == 32 else self.bits

    @property
    def _scale(self) -> torch.dtype:
        """The torch dtype of the scales: ``scale_dtype``'s, bfloat16 unless it says."""
        return SCALE_DTYPES[self.scale_dtype or "bf16"]

    def setup(self, replica: Replica) -> DemoState:
        self.check_optimizers(replica)
        if self.sign and any(isinstance(o, QAdamOptimizer) for o in replica.optimizers):
            raise ValueError(
                "demo steps on the sign of its direction (sign=True, the default), and QAdamOptimizer "
                "freezes Adam's variance after its warm-up: steps of +-1 over that variance blow the "
                "weights up. Pair demo with torch.optim.SGD (the paper's pairing), or pass demo:sign=false"
            )
        adaptive = sorted({type(o).__name__ for o in replica.optimizers if isinstance(o, ADAPTIVE)})
        if self.sign and adaptive and replica.rank == 0:
            warnings.warn(
                f"demo steps on the sign of its direction (sign=True, the default), and {', '.join(adaptive)} "
                "scales each step by running statistics of its own, which a step of +-1 in every coordinate does "
                "not suit: demo trains far worse so. Pair demo with torch.optim.SGD, the paper's pairing (within "
                "0.4% of allreduce on charlm: docs/algorithms.md#demo)",
                UserWarning,
                stacklevel=2,
            )
        levels = None
        if self.hierarchical and replica.distributed:
            levels = TwoLevel.build(replica.topology, replica.group, replica.private_group, self.name, thread=True)
        density = self.topk / self.chunk if self.layout == "tiles" else None
        return DemoState(
            self.chunk, levels, keeps=replica.fault_tolerant, on_host=replica.saved_on_host, density=density
        )

    def grad_scale(self, replica: Replica, state: DemoState, world_size: int) -> float:
        return 1.0  # the bucket holds this rank's own gradient: it goes into its momentum

    def reduce_bucket(
        self, replica: Replica, state: DemoState, bucket: Bucket, group: Optional[dist.ProcessGroup]
    ) -> Optional[Waitable]:
        world = dist.get_world_size(group)
        if bucket.flat.numel() == 0:
            return None
        if not bucket.flat.is_floating_point():
            raise TypeError(f"demo needs floating-point gradients; bucket {bucket.index} holds {bucket.flat.dtype}")
        entry = state.momenta.get(bucket)
        if state.levels is not None:
            return self._reduce_nodes(state, bucket, entry)
        _, code, mine, everyone = self._codec(state, bucket, entry, world)
        saved = self._saved(replica, bucket) if state.keeps else None
        self.encode(state, bucket, entry, code, mine, saved)
        work = start(dist.all_gather, list(everyone.unbind(0)), mine, group=group)
        return Gathered(work, self, state, bucket, entry, code, everyone)

    def encode(
        self,
        state: DemoState,
        bucket: Bucket,
        entry: Entry,
        code: Union[Codec, TiledTopK],
        mine: torch.Tensor,
        saved: Optional[list[torch.Tensor]] = None,
    ) -> None:
        """Fold the bucket's gradients into the momentum, take its DCT, write its top-k into
        ``mine`` and leave the rest in the momentum (back through the inverse DCT). The
        transforms and the codec run their device's schedule (``engine.codecs.schedule``): on a
        GPU a fixed number of ops whatever the bucket's size."""
        m = entry.flat
        with torch.no_grad():
            if state.keeps and saved is None:
                entry.keep(state.on_host)
            m.mul_(self.beta)
            torch._foreach_add_(entry.views, entry.pair(list(bucket.views)))
            if saved is not None:
                entry.lend(saved, self.beta, folded=True)
            self._transform(state, entry, m)  # the coefficients, in place
            code.encode(m, mine)  # m keeps the coefficients not sent
            self._transform(state, entry, m, inverse=True)  # back: m - idct(sent)
            if entry.pad is not None:
                m.index_fill_(0, entry.pad, 0.0)  # the padding holds no momentum
            if saved is not None:
                entry.lend(saved, self.beta, folded=False)

    def after_backward(self, replica: Replica, state: DemoState) -> None:
        state.momenta.settle()

    @staticmethod
    def _saved(replica: Replica, bucket: Bucket) -> Optional[list[torch.Tensor]]:
        """The engine's saved gradients of ``bucket`` when they can hold the fold (float32 like the
        momentum: a lower precision would round it), else None (``Entry.keep`` then)."""
        saved = replica.saved_gradients(bucket)
        if saved is None or any(t.dtype != torch.float32 for t in saved):
            return None
        return saved

    def release(self, replica: Replica, state: DemoState) -> None:
        """The members changed (or the wrapper is gone): once the node rounds have stopped, each
        shard's momentum the round in flight folded a gradient into goes back to what it was before
        (hierarchical; flat, the saved gradients were rewritten instead: ``Entry.lend``), so that the
        round done again on the new membership folds each gradient once."""
        super().release(replica, state)
        with torch.no_grad():
            state.momenta.undo()

    def bucket_wire_bytes(self, replica: Replica, state: DemoState, bucket: Bucket, world_size: int) -> int:
        """This rank's message to every other rank (an all-gather); hierarchical, both legs inside
        the node and its shard's message to the other nodes."""
        if self.layout == "tiles":
            key = tuple(bucket.names)
            if key not in state.wire:
                if not bucket.flat.numel():
                    return 0
                tiles = state.momenta.tiles(bucket)
                assert tiles is not None
                state.wire[key] = self._tiled_codec(tiles, torch.device("cpu")).nbytes
            return (world_size - 1) * state.wire[key]
        padded = sum(-(-v.numel() // self.chunk) * self.chunk for v in bucket.views)
        if not padded:
            return 0
        levels = state.levels
        if levels is not None:
            bounds = shard_bounds(padded, self.chunk, levels.local_size)
            shard = levels.shard_numel(padded, bounds)
            cross = (
                (levels.nodes - 1) * message_bytes(shard, self.chunk, self.topk, self.value_bits, self._scale)
                if shard
                else 0
            )
            return 2 * levels.leg_bytes(padded, 4, bounds) + cross
        return (world_size - 1) * message_bytes(padded, self.chunk, self.topk, self.value_bits, self._scale)

    def _reduce_nodes(self, state: DemoState, bucket: Bucket, entry: Entry) -> Waitable:
        """Hierarchical: the bucket's gradients into its node buffer (in the momentum's layout), the
        node's round on the levels' thread; ``wait()`` writes the direction into the bucket."""
        levels = state.levels
        assert levels is not None
        n, device = entry.flat.numel(), entry.flat.device
        scratch = self._scratch(state, device)
        self._matrices(state, device)
        part = state.node_parts.get(bucket.index)
        if part is None or part.work.numel() != n:
            part = state.node_parts[bucket.index] = NodePart(levels, n, self, device, scratch)
        with torch.no_grad():
            torch._foreach_copy_(entry.target_views(part.work), list(bucket.views))
            if entry.pad is not None:
                part.work.index_fill_(0, entry.pad, 0.0)  # left over from the last direction
        pending = levels.submit(self._node_round, state, entry, part)
        return NodeGathered(pending, bucket, entry, part)

    def _node_round(self, state: DemoState, entry: Entry, part: "NodePart") -> None:
        """On the levels' thread: the node's sum of this rank's shard, folded (as the node's mean) into
        this rank's momentum of the shard, its DCT's top-k all-gathered across nodes, decoded in node
        order, averaged and transformed back; every shard's direction gathered in the node."""
        levels = state.levels
        assert levels is not None and state.matrices is not None and state.scratch is not None
        d, dt = state.matrices
        work, (first, last) = part.work, levels.shard(part.bounds)
        with torch.no_grad():
            shard = levels.scatter(work, part.bounds)
            code, message, everyone = part.codec, part.mine, part.everyone
            if code is not None and message is not None and everyone is not None:
                m = entry.flat[first:last]
                rows = m.view(-1, self.chunk)
                if state.keeps:
                    entry.keep(state.on_host, first, last)
                m.mul_(self.beta).add_(shard, alpha=1.0 / levels.local_size)
                transform_(rows, dt, state.scratch)
                code.encode(m, message)
                transform_(rows, d, state.scratch)
                if entry.pad is not None:
                    entry.flat.index_fill_(0, entry.pad, 0.0)  # the padding holds no momentum
                comm_wait(start(dist.all_gather, list(everyone.unbind(0)), message, group=levels.inter))
                levels.inter_bytes += (levels.nodes - 1) * message.numel()
                shard = work[first:last].zero_()
                counts = self._counts(state, shard.numel(), shard.device)
                self.mean_into(code, everyone, shard, counts)  # in node order: the same bits on every node
                transform_(shard.view(-1, self.chunk), d, state.scratch)
                if self.sign:
                    shard.sign_()
            levels.gather(work, shard, part.bounds)

    def _codec(
        self, state: DemoState, bucket: Bucket, entry: Entry, world: int
    ) -> tuple[int, Union[Codec, TiledTopK], torch.Tensor, torch.Tensor]:
        """The bucket's codec and messages (rebuilt when its layout changed), and the shared buffers grown to it."""
        n, device = entry.flat.numel(), entry.flat.device
        scratch = self._scratch(state, device)
        if state.target is None or state.target.numel() < n:
            state.target = torch.empty(n, dtype=torch.float32, device=device)
        self._counts(state, n, device)
        found = state.codecs.get(bucket.index)
        if found is None or found[0] != n or found[3].shape[0] != world:
            c: Union[Codec, TiledTopK]
            if entry.tiles is not None:
                c = self._tiled_codec(entry.tiles, device)
                c.share(scratch)
            else:
                c = codec(n, self.chunk, self.topk, self.value_bits, device, scratch, self._scale)
            found = state.codecs[bucket.index] = (n, c, c.empty(), c.empty(world))
        return found

    def _tiled_codec(self, tiles: Tiles, device: torch.device) -> TiledTopK:
        """``layout="tiles"``: the codec of a bucket's tiles (a scale per tile with ``bits``-bit values)."""
        return TiledTopK(tiles.runs, self.bits, "max", self._scale, device)

    def _counts(self, state: DemoState, n: int, device: torch.device) -> Optional[torch.Tensor]:
        """``mean="senders"``: the shared count buffer, grown to ``n`` values; else None."""
        if self.mean != "senders" or self.layout == "tiles":  # the tiled codec counts block by block
            return None
        if state.counts is None or state.counts.numel() < n:
            state.counts = torch.empty(n, dtype=torch.float32, device=device)
        return state.counts

    def mean_into(
        self, code: Union[Codec, TiledTopK], messages: torch.Tensor, out: torch.Tensor, counts: Optional[torch.Tensor]
    ) -> None:
        """``out`` (zeros) takes the mean of the ``messages`` (in rank order: the same bits on every
        rank): each coefficient's over the ranks that sent it (``counts``), or over all of them."""
        if isinstance(code, TiledTopK):
            code.mean_into(messages, out, senders=self.mean == "senders")
            return
        if counts is None:  # the messages read once, a scatter-add each
            code.add_all(messages, out, 1.0 / messages.shape[0])
            return
        counts = counts[: out.numel()].zero_()
        code.add_all(messages, out, counts=counts)
        out.div_(counts.clamp_(min=1))

    def _scratch(self, state: DemoState, device: torch.device) -> torch.Tensor:
        """The block of rows the transforms and the codecs' magnitudes share (256 KiB)."""
        if state.scratch is None:
            numel = max(BLOCK, self.chunk)
            if self.layout == "tiles":  # the tiled codec's two blocks (a tile at least)
                numel = max(numel, 2 * max(TILED_BLOCK, self.chunk * self.chunk))
            state.scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return state.scratch

    def _matrices(self, state: DemoState, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if state.matrices is None or state.matrices[0].device != device:
            d = dct_matrix(self.chunk, device)
            state.matrices = (d, d.t().contiguous())
        return state.matrices

    def _dct(self, state: DemoState, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``layout="tiles"``: the DCT of ``size`` values and its transpose (kept by size)."""
        found = state.tile_matrices.get(size)
        if found is None or found[0].device != device:
            d = dct_matrix(size, device)
            found = state.tile_matrices[size] = (d, d.t().contiguous())
        return found

    def _transform(self, state: DemoState, entry: Entry, values: torch.Tensor, inverse: bool = False) -> None:
        """``values`` (in ``entry``'s layout) into their DCT coefficients in place, or (``inverse``)
        back: each chunk's 1-D DCT, or with tiles each tile's 2-D DCT and each vector chunk's 1-D."""
        scratch = self._scratch(state, values.device)
        if entry.tiles is None:
            d, dt = self._matrices(state, values.device)
            transform_(values.view(-1, self.chunk), d if inverse else dt, scratch)
            return
        merge = schedule_for(values.device) == WHOLE  # a transform a run of tensors, not a tensor
        for offset, numel, size, tile in spans(entry.tiles, merge):
            block = values[offset : offset + numel]
            if tile is None:
                d, dt = self._dct(state, size, values.device)
                transform_(block.view(-1, size), d if inverse else dt, scratch)
                continue
            h, w = tile
            (dh, dht), (dw, dwt) = self._dct(state, h, values.device), self._dct(state, w, values.device)
            transform_tiles_(block.view(-1, h, w), dht if inverse else dh, dw if inverse else dwt, scratch)

    def direction(
        self, state: DemoState, bucket: Bucket, entry: Entry, code: Union[Codec, TiledTopK], everyone: torch.Tensor
    ) -> None:
        """Decode every rank's message (in rank order: the same bits on every rank), average, take
        the inverse DCT and write it (or its sign) into the bucket, which the gradients view."""
        assert state.target is not None
        target = state.target[: entry.flat.numel()]
        with torch.no_grad():
            target.zero_()
            self.mean_into(code, everyone, target, self._counts(state, target.numel(), target.device))
            self._transform(state, entry, target, inverse=True)
            if self.sign:
                target.sign_()
            torch._foreach_copy_(entry.pair(list(bucket.views)), entry.target_views(state.target))


def spans(tiles: Tiles, merge: bool) -> list[tuple[int, int, int, Optional[tuple[int, int]]]]:
    """``(offset, numel, size, tile)`` of each run of ``tiles``: ``tile`` the ``(h, w)`` of a matrix's
    tiles (``size = h w``), None for a vector's chunks of ``size``. With ``merge`` the runs of one
    kind lying one after the other are one span (the whole schedule: a transform each, not a tensor each)."""
    out: list[tuple[int, int, int, Optional[tuple[int, int]]]] = []
    for run, piece in zip(tiles.runs, tiles.pieces):
        tile = None if piece.grid is None else (piece.grid[1], piece.grid[3])
        if merge and out and out[-1][2:] == (run.size, tile) and out[-1][0] + out[-1][1] == run.offset:
            out[-1] = (out[-1][0], out[-1][1] + run.numel, run.size, tile)
        else:
            out.append((run.offset, run.numel, run.size, tile))
    return out


def shard_bounds(numel: int, chunk: int, parts: int) -> list[int]:
    """``parts + 1`` offsets cutting ``numel`` values (whole chunks) into ``parts`` runs of whole chunks."""
    chunks = numel // chunk
    return [chunk * (chunks * k // parts) for k in range(parts + 1)]


class NodePart:
    """Hierarchical, one bucket: its momentum's layout cut between the local ranks at chunk
    boundaries (``bounds``), the codec of this rank's shard (None when it is empty, as for the
    same local rank on every node), its message and every node's, and the float32 buffer the
    node's rounds run in (the bucket's gradients in, its direction out)."""

    __slots__ = ("bounds", "codec", "mine", "everyone", "work")

    def __init__(self, levels: TwoLevel, numel: int, algo: Demo, device: torch.device, scratch: torch.Tensor) -> None:
        self.bounds = shard_bounds(numel, algo.chunk, levels.local_size)
        start, end = levels.shard(self.bounds)
        self.codec: Optional[Codec] = None
        self.mine: Optional[torch.Tensor] = None
        self.everyone: Optional[torch.Tensor] = None
        if end > start:
            self.codec = codec(end - start, algo.chunk, algo.topk, algo.value_bits, device, scratch, algo._scale)
            self.mine, self.everyone = self.codec.empty(), self.codec.empty(levels.nodes)
        self.work = torch.zeros(numel, dtype=torch.float32, device=device)


class NodeGathered:
    """A bucket's node round in flight; ``wait()`` writes the direction it gathered into the bucket."""

    def __init__(self, pending: Pending, bucket: Bucket, entry: Entry, part: NodePart) -> None:
        self._pending, self._bucket, self._entry, self._part = pending, bucket, entry, part

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        with torch.no_grad():
            torch._foreach_copy_(list(self._bucket.views), self._entry.target_views(self._part.work))
        return self._bucket.flat

    def is_completed(self) -> bool:
        return bool(self._pending.is_completed())


class Gathered:
    """A bucket's all-gather in flight; ``wait()`` writes the averaged direction into the bucket."""

    def __init__(
        self,
        work: Any,
        algorithm: Demo,
        state: DemoState,
        bucket: Bucket,
        entry: Entry,
        code: Union[Codec, TiledTopK],
        everyone: torch.Tensor,
    ) -> None:
        self._work, self._args = work, (state, bucket, entry, code, everyone)
        self._algorithm = algorithm

    def wait(self) -> torch.Tensor:
        comm_wait(self._work)
        self._algorithm.direction(*self._args)
        return self._args[1].flat

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())
