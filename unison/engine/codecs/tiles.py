"""Where SparseLoCo takes its top-k: a fragment's tensors cut into chunks, laid out chunk after
chunk in one flat buffer (pure layout, no arithmetic on values).

Two cuts, both as the reference code of their paper makes them:

- ``"tiles"`` (SparseLoCo's release, Templar): each tensor on its own. A matrix (a tensor of two
  or more dimensions, seen as ``shape[0] x rest``) is cut into ``h x w`` tiles, ``h`` the
  largest divisor of its rows and ``w`` of its columns not above ``tile`` (64: 64 x 64 tiles);
  a vector into chunks of ``tile`` values (the largest divisor of its length not above
  ``tile``, or evened chunks ending in zero padding when that divisor is under half of
  ``tile``). A matrix whose tiles would hold fewer than ``tile`` values is cut as a vector.
  Each chunk sends ``k = round(density * size)`` entries (at least 1), or with ``topk`` the
  reference's ``round(topk * size / tile**2)``: every tensor gets its share. Templar's form
  (``fixed_k``): every chunk sends a whole tile's ``k``, its length at most; ``dense_vectors``:
  a tensor cut as a vector is sent whole.
- ``"flat"``: the fragment's tensors end to end, cut into the fewest chunks of at most
  ``chunk`` values, all of one size (the last padded); tensors compete for each chunk's ``k``.

In the buffer each tile is contiguous (row by row), so a run of chunks is one ``[chunks, size]``
view; ``views(buffer)`` and ``shaped(tensors)`` pair each tensor with its place in the buffer
(both shaped ``[y, h, x, w]`` for tiles, flat otherwise), so ``torch._foreach_copy_`` moves
values between the two layouts.

See docs/algorithms.md#sparseloco.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

Cut = Literal["tiles", "flat"]


def divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (1 if none above it)."""
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1


def even_chunks(numel: int, chunk: int) -> tuple[int, int]:
    """``(chunks, size)``: ``numel`` values cut into the fewest chunks of at most ``chunk``
    values, all of one size (the last padded by fewer than ``chunks`` values)."""
    chunks = max(1, -(-numel // chunk))
    return chunks, max(1, -(-numel // chunks))


@dataclass(frozen=True)
class Run:
    """``chunks`` chunks of ``size`` values from ``offset`` of a buffer, ``k`` sent from each;
    ``first``: where the run's first sent entry is among all the entries a message carries."""

    offset: int
    chunks: int
    size: int
    k: int
    first: int = 0

    @property
    def numel(self) -> int:
        return self.chunks * self.size

    @property
    def count(self) -> int:
        """The entries the run sends."""
        return self.chunks * self.k


@dataclass(frozen=True)
class Piece:
    """One tensor's place: from ``offset``, ``span`` values of the buffer (its values and any
    padding), and ``(y, h, x, w)`` for a matrix cut in tiles (None: its values lie flat)."""

    offset: int
    numel: int
    span: int
    grid: Optional[tuple[int, int, int, int]]


class Tiles:
    """The layout of one fragment's tensors in a chunked buffer.

    Args:
        shapes: the tensors' shapes, in the fragment's order.
        cut: ``"tiles"`` (each tensor its own tiles) or ``"flat"`` (chunks across the fragment).
        size: the tile's side (``"tiles"``) or the chunk's length (``"flat"``).
        density: the share of each chunk sent, in (0, 1].
        topk: the entries sent per ``size x size`` tile (``"tiles"``: scaled to smaller chunks)
            or per chunk (``"flat"``), instead of ``density``.
        fixed_k: (``"tiles"``) every chunk sends what a whole ``size x size`` tile sends (its
            length at most), as Templar does: a 48 x 40 tile sends 64 values at the defaults, not 30.
        dense_vectors: (``"tiles"``) a tensor cut as a vector (a bias, a norm's gain) is sent
            whole, as Templar's ``min(64, chunk)`` does for chunks of 64 values or fewer.

    Example::

        tiles = Tiles([p.shape for p in params], "tiles", 64, density=1 / 64)
        e = torch.zeros(tiles.numel)
        torch._foreach_copy_(tiles.views(e), tiles.shaped(params))   # params into tiles
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        cut: Cut = "tiles",
        size: int = 64,
        density: float = 1 / 64,
        topk: Optional[int] = None,
        fixed_k: bool = False,
        dense_vectors: bool = False,
    ) -> None:
        if cut == "flat" and (fixed_k or dense_vectors):
            raise ValueError("fixed_k and dense_vectors are forms of the 'tiles' cut (each tensor on its own)")
        self.cut, self.size = cut, size
        self.pieces: list[Piece] = []
        offset = 0

        def k_of(chunk: int, vector: bool = False) -> int:
            if vector and dense_vectors:
                return chunk
            if fixed_k:
                return min(chunk, topk if topk is not None else max(1, round(density * size**2)))
            if topk is None:
                return min(chunk, max(1, round(density * chunk)))
            if cut == "flat":
                return min(chunk, topk)
            return min(chunk, max(1, round(topk * chunk / size**2)))

        if cut == "flat":
            total = sum(_numel(s) for s in shapes)
            chunks, length = even_chunks(total, size)
            run = Run(0, chunks, length, k_of(length))
            self.runs = [run]
            first = 0
            for s in shapes:
                self.pieces.append(Piece(first, _numel(s), _numel(s), None))
                first += _numel(s)
            self.numel = run.numel
        else:
            self.runs = []
            for s in shapes:
                n = _numel(s)
                grid = _grid(s, size)
                if grid is not None:
                    y, h, x, w = grid
                    chunks, length = y * x, h * w
                else:
                    length = divisor_at_most(n, size)
                    chunks = n // length
                    if 2 * length < min(size, n):
                        chunks, length = even_chunks(n, size)
                run = Run(offset, chunks, length, k_of(length, vector=grid is None))
                self.runs.append(run)
                self.pieces.append(Piece(offset, n, run.numel, grid))
                offset += run.numel
            self.numel = offset
        self.runs = _numbered(self.runs)
        pad = [torch.arange(p.offset + p.numel, p.offset + p.span) for p in self.pieces if p.span > p.numel]
        values = sum(p.numel for p in self.pieces)
        if cut == "flat" and self.numel > values:
            pad = [torch.arange(values, self.numel)]
        #: positions of the buffer that hold no tensor's value (zero padding), or None
        self.pad: Optional[torch.Tensor] = torch.cat(pad) if pad else None

    @property
    def count(self) -> int:
        """The entries a message of the whole layout sends."""
        return sum(r.count for r in self.runs)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's values in ``buffer`` (``numel`` long), shaped as ``shaped`` shapes it."""
        out = []
        for p in self.pieces:
            if p.grid is None:
                out.append(buffer[p.offset : p.offset + p.numel])
            else:
                y, h, x, w = p.grid
                tiles = buffer[p.offset : p.offset + p.span].view(y, x, h, w)
                out.append(tiles.permute(0, 2, 1, 3))
        return out

    def shaped(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of ``tensors`` (contiguous, in the layout's order) paired with ``views``."""
        return [t.view(-1) if p.grid is None else t.view(p.grid) for p, t in zip(self.pieces, tensors)]

    def unpad(self, buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """New tensors of ``shapes`` holding what ``buffer`` holds of each."""
        out = []
        for s, v in zip(shapes, self.views(buffer)):
            t = torch.empty(s, dtype=buffer.dtype, device=buffer.device)
            t.view(v.shape).copy_(v)
            out.append(t)
        return out

    def zero_pad(self, buffer: torch.Tensor) -> None:
        """Zero the padding of ``buffer``."""
        if self.pad is not None:
            if self.pad.device != buffer.device:
                self.pad = self.pad.to(buffer.device)
            buffer.index_fill_(0, self.pad, 0.0)

    def bounds(self, parts: int) -> list[int]:
        """``parts + 1`` offsets cutting the buffer into ``parts`` runs of whole chunks, each
        about ``numel / parts`` values (a shard of a node's local rank)."""
        out = [0]
        for j in range(1, parts):
            target = self.numel * j / parts
            run = next(r for r in self.runs if r.offset + r.numel >= target)
            edge = run.offset + run.size * round((target - run.offset) / run.size)
            out.append(min(self.numel, max(out[-1], edge)))
        out.append(self.numel)
        return out

    def slice(self, start: int, end: int) -> list[Run]:
        """The runs of ``[start, end)`` (chunk boundaries), their offsets from ``start``."""
        out = []
        for r in self.runs:
            lo, hi = max(start, r.offset), min(end, r.offset + r.numel)
            if hi > lo:
                if (lo - r.offset) % r.size or (hi - r.offset) % r.size:
                    raise ValueError(f"[{start}, {end}) does not fall on chunk boundaries of the layout")
                out.append(Run(lo - start, (hi - lo) // r.size, r.size, r.k))
        return _numbered(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _grid(shape: Sequence[int], side: int) -> Optional[tuple[int, int, int, int]]:
    """``(y, h, x, w)`` tiles of a tensor seen as ``shape[0] x rest``, or None (a vector, or
    tiles of fewer than ``side`` values: cut as a vector)."""
    if len(shape) < 2 or shape[0] == 0:
        return None
    rows = shape[0]
    cols = _numel(shape) // rows
    h, w = divisor_at_most(rows, side), divisor_at_most(cols, side)
    if h * w < side:
        return None
    return rows // h, h, cols // w, w


def _numbered(runs: list[Run]) -> list[Run]:
    """``runs`` with ``first`` set: where each one's entries start in a message."""
    out, first = [], 0
    for r in runs:
        out.append(Run(r.offset, r.chunks, r.size, r.k, first))
        first += r.count
    return out


class TiledBuffer:
    """A float32 buffer (zeros) in a ``Tiles`` layout, with its views paired with the tensors
    (``Tiles.views``); the padding stays zero.

    Example::

        glob = TiledBuffer(tiles, params[0].device)
        glob.load(params)                                  # the params' values, tiled
        torch._foreach_copy_(tiles.shaped(params), glob.views)   # and back
    """

    __slots__ = ("tiles", "flat", "views")

    def __init__(self, tiles: Tiles, device: torch.device) -> None:
        self.tiles = tiles
        self.flat = torch.zeros(tiles.numel, dtype=torch.float32, device=device)
        self.views = tiles.views(self.flat)

    def load(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy ``tensors`` (in the layout's order) into the buffer; returns it."""
        with torch.no_grad():
            torch._foreach_copy_(self.views, self.tiles.shaped([t.detach() for t in tensors]))
        return self.flat
