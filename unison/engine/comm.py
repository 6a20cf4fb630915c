"""Small collective helpers built on torch.distributed: launching work, coalesced
broadcast, cross-rank agreement checks, and the communication thread."""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import io
import pickle
import threading
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..runtime import ending, membership
from ..runtime.groups import private_group, src_rank  # noqa: F401  (re-exported: the engine's face)
from ..runtime.launch import wire_device  # noqa: F401  (re-exported)
from .buckets import MB
from .flat import by_kind

# The most recent works stay referenced from Python. A work whose last reference
# is dropped by gloo's worker thread needs the GIL to die; if that happens while
# the interpreter is exiting, the process aborts ("terminate called without an
# active exception"). Holding them here makes the main thread release them, once
# they have completed: a work keeps its tensors alive (a coalesced copy, a wire
# buffer), so holding completed ones would keep up to 64 collectives' buffers.
_recent_works: collections.deque = collections.deque(maxlen=64)
_works_lock = threading.Lock()  # comm threads start collectives too


def _release_completed() -> None:
    """Drop (on this thread) the references to the works that have completed."""
    with _works_lock:
        if any(w.is_completed() for w in _recent_works):
            live = [w for w in _recent_works if not w.is_completed()]
            _recent_works.clear()
            _recent_works.extend(live)


def _any_in_flight() -> bool:
    """Whether a work unison started has not completed (the job's end then keeps its groups)."""
    with _works_lock:
        return any(not w.is_completed() for w in _recent_works)


ending.in_flight.append(_any_in_flight)


def start(collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Launch ``collective(*args, async_op=True, **kwargs)`` and return its work.

    Every asynchronous collective in unison goes through here so the newest
    works are released by Python, never by a communication thread at exit.
    """
    work = collective(*args, async_op=True, **kwargs)
    _release_completed()
    with _works_lock:
        _recent_works.append(work)
    return work


def wait(work: Any, p2p: bool = False) -> Any:
    """``work.wait()`` for a Work or Future; under fault tolerance the wait is polled together
    with the membership (``MembershipChanged`` instead of blocking on a dead or stopped peer).
    ``p2p``: the work of a send or receive (never waited on with a timeout)."""
    result = membership.wait(work, timed=not p2p)
    _release_completed()
    return result


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group)


def ring_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of an ``nbytes`` buffer: 2 (n-1)/n of it."""
    return 2 * (world - 1) * nbytes // world


def chunks(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """Group tensors by dtype and device, then into chunks of at most ``cap_bytes``."""
    out: list[list[torch.Tensor]] = []
    for idx in by_kind(tensors):
        group = [tensors[i] for i in idx]
        current: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > cap_bytes:
                out.append(current)
                current, size = [], 0
            current.append(t)
            size += nbytes
        if current:
            out.append(current)
    return out


def from_host(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device`` without a host sync: a GPU gets it by an
    asynchronous copy from pinned memory (``torch.tensor(..., device=gpu)`` waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


#: The most a blocking collective over many tensors (a broadcast, an average) copies at once.
STAGING_BYTES = 4 * MB


def staged(tensors: Sequence[torch.Tensor], cap_bytes: int = STAGING_BYTES) -> list[list[torch.Tensor]]:
    """``tensors`` in chunks of at most ``cap_bytes`` (``chunks``), a contiguous tensor larger than
    that cut into flat views that fit: a blocking collective copies one chunk at a time into a
    staging buffer and back, so it costs one chunk, never a model, and leaves a tensor untouched
    until its chunk has arrived whole (a peer failing half-way corrupts nothing)."""
    pieces: list[torch.Tensor] = []
    for t in tensors:
        per = max(1, cap_bytes // max(1, t.element_size()))
        if t.is_contiguous() and t.numel() > per:
            flat = t.detach().view(-1)
            pieces.extend(flat[i : i + per] for i in range(0, flat.numel(), per))
        else:
            pieces.append(t)
    return chunks(pieces, cap_bytes)


def default_broadcast(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Broadcast ``tensors`` in place from the group's first rank, through one staging chunk at a
    time (``staged``: the transient copy is at most ``STAGING_BYTES``, never the whole model)."""
    src = src_rank(group)
    for chunk in staged(tensors):
        flat = flatten(chunk)
        wait(start(dist.broadcast, flat, src=src, group=group))
        unflatten_into(flat, chunk)


class AsyncBroadcast:
    """A coalesced broadcast from group rank ``source`` (default the first), started now
    and written back by ``finish()``."""

    def __init__(self, tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], source: int = 0) -> None:
        self._parts = []
        src = src_rank(group, source)
        for chunk in chunks(tensors, 25 * MB):
            flat = flatten(chunk)
            self._parts.append((chunk, flat, start(dist.broadcast, flat, src=src, group=group)))

    def finish(self) -> None:
        for chunk, flat, work in self._parts:
            wait(work)
            unflatten_into(flat, chunk)
        self._parts = []


# Objects travel pickled in uint8 tensors. torch's *_object collectives do the same but read
# the bytes back through NumPy, which neither torch nor unison requires.


def _pickled(obj: Any, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, list[int]]:
    """``obj`` pickled into a uint8 tensor padded to the longest of the group's, and every
    rank's length (one collective). The tensors live on the group's wire device (a GPU under NCCL)."""
    data = pickle.dumps(obj)
    wire = wire_device(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(group_size(group))]
    wait(start(dist.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64, device=wire), group=group))
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded.to(wire), lengths


def tensor_bytes(t: torch.Tensor, length: Optional[int] = None) -> bytes:
    """The first ``length`` bytes (default: all) of the contiguous CPU tensor ``t``, read
    without NumPy (``t.numpy().tobytes()`` needs it)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size() if length is None else length)


def _unpickled(t: torch.Tensor, length: int) -> Any:
    return pickle.loads(tensor_bytes(t.cpu(), length))


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's ``obj``, in group rank order (two collectives, no NumPy)."""
    padded, lengths = _pickled(obj, group)
    out = [torch.empty_like(padded) for _ in lengths]
    wait(start(dist.all_gather, out, padded, group=group))
    return [_unpickled(o, n) for o, n in zip(out, lengths)]


def gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None, dst: int = 0) -> list[Any]:
    """Every rank's ``obj`` on group rank ``dst`` (an empty list elsewhere); no NumPy."""
    padded, lengths = _pickled(obj, group)
    mine = dist.get_rank(group) == dst
    out = [torch.empty_like(padded) for _ in lengths] if mine else None
    wait(start(dist.gather, padded, out, dst=src_rank(group, dst), group=group))
    return [_unpickled(o, n) for o, n in zip(out, lengths)] if out is not None else []


def broadcast_object(obj: Any, group: Optional[dist.ProcessGroup] = None, src: int = 0) -> Any:
    """Group rank ``src``'s ``obj`` on every rank (two collectives, no NumPy)."""
    data = pickle.dumps(obj) if dist.get_rank(group) == src else b""
    wire = wire_device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=wire)
    wait(start(dist.broadcast, size, src=src_rank(group, src), group=group))
    t = torch.zeros(int(size.item()), dtype=torch.uint8)
    if data:
        t[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    t = t.to(wire)
    wait(start(dist.broadcast, t, src=src_rank(group, src), group=group))
    return _unpickled(t, t.numel())


#: The devices whose tensors a heal streams raw (others travel inside the pickled skeleton).
_STREAMED = ("cpu", "cuda")


class _TensorsApart(pickle.Pickler):
    """Pickles everything but the dense CPU and CUDA tensors, which it lists apart (their bytes
    travel raw, in pieces, whatever the device: see ``_send_pieces``)."""

    def __init__(self, file: Any, names: Optional[dict[int, str]] = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.raw: list[torch.Tensor] = []  # each tensor's bytes, in order, on its own device
        self._names = names or {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.device.type not in _STREAMED or obj.layout != torch.strided:
            return None
        if obj.is_quantized or obj.requires_grad or obj.dtype.is_complex:
            return None
        flat = obj.detach().contiguous().reshape(-1).view(torch.uint8)
        self.raw.append(flat)
        return (obj.dtype, tuple(obj.shape), self._names.get(id(obj)), obj.device.type)


class _TensorsFrom(pickle.Unpickler):
    """Unpickles ``_TensorsApart``'s skeleton, each tensor made empty (on the receiver's own device
    of the sender's type: its current GPU for a CUDA tensor) and listed in ``tensors``, its bytes,
    for the stream to fill."""

    def __init__(self, file: Any, into: Optional[dict[str, torch.Tensor]] = None) -> None:
        super().__init__(file)
        self.tensors: list[torch.Tensor] = []  # each tensor's bytes, in order
        self._into = into or {}

    def persistent_load(self, pid: Any) -> torch.Tensor:
        dtype, shape, name, kind = pid
        t = self._into.get(name) if name is not None else None
        if t is None or t.dtype != dtype or tuple(t.shape) != shape or t.device.type != kind or not t.is_contiguous():
            device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
            t = torch.empty(shape, dtype=dtype, device=device)
        flat = t.detach().reshape(-1).view(torch.uint8)
        self.tensors.append(flat)
        return t


#: Heal pieces a sender or a receiver keeps in flight at once, per peer (``share_state``).
HEAL_WINDOW = 8
#: The tags of a heal's messages: its header, its skeleton, then piece k's is PIECE_TAG + k.
HEADER_TAG, SKELETON_TAG, PIECE_TAG = 1, 2, 3
#: A tensor of at least this many bytes travels from and into its own memory (no staging copy);
#: smaller ones are packed together into pieces of at most ``STAGING_BYTES``.
DIRECT_BYTES = 64 * 1024


def _pieces(sizes: Sequence[int], cap: int) -> list[list[tuple[int, int, int]]]:
    """The pieces a sharded heal sends, from the byte sizes of the tensors it carries, in order:
    each piece a list of ``(tensor index, start, end)`` byte ranges, at most ``cap`` bytes in all.
    A tensor of at least ``DIRECT_BYTES`` is cut into pieces of its own (sent from and received
    into its memory); smaller ones are packed together (staged). Sender and receivers compute it
    from the same sizes, so they agree on every piece."""
    out: list[list[tuple[int, int, int]]] = []
    pack: list[tuple[int, int, int]] = []
    packed = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= min(DIRECT_BYTES, cap):
            out.extend([(i, b, min(n, b + cap))] for b in range(0, n, cap))
            continue
        if pack and packed + n > cap:
            out.append(pack)
            pack, packed = [], 0
        pack.append((i, 0, n))
        packed += n
    if pack:
        out.append(pack)
    return out


def _layout(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A sharded heal's header: the bytes in all, the tensors, and a checksum of their sizes."""
    sizes = [t.numel() for t in tensors]
    check = zlib.crc32(pickle.dumps(sizes))
    return torch.tensor([sum(sizes), len(sizes), check], dtype=torch.int64)


def _p2p(send: bool, t: torch.Tensor, peer: int, group: Any, tag: int) -> Any:
    """An isend or irecv of ``t`` with group rank ``peer`` (its work, kept from release at exit)."""
    op = dist.isend if send else dist.irecv
    work = op(t, src_rank(group, peer), group=group, tag=tag)
    _release_completed()
    with _works_lock:
        _recent_works.append(work)
    return work


def _send_pieces(
    tensors: list[torch.Tensor],
    pieces: list[list[tuple[int, int, int]]],
    mine: list[int],
    receivers: list[int],
    group: Any,
    wire: torch.device,
) -> None:
    """Send the pieces numbered ``mine`` (of ``pieces``, ``_pieces`` of ``tensors``) to every
    receiver, at most ``HEAL_WINDOW`` per receiver in flight: a piece of one tensor straight from
    its memory, a packed one (or one on another device than the wire's) through a staging copy of
    at most ``STAGING_BYTES``. ``wire``: the group's ``wire_device``."""
    flight: collections.deque = collections.deque()
    for k in mine:
        piece = pieces[k]
        if len(piece) == 1:
            i, b, e = piece[0]
            data = tensors[i][b:e].to(wire)  # itself where it is on the wire's device
        else:
            data = torch.cat([tensors[i][b:e].to(wire) for i, b, e in piece])
        for r in receivers:
            flight.append(_p2p(True, data, r, group, tag=PIECE_TAG + k))
        while len(flight) > HEAL_WINDOW * len(receivers):
            wait(flight.popleft(), p2p=True)
    while flight:
        wait(flight.popleft(), p2p=True)


def _receive_pieces(tensors: list[torch.Tensor], sources: list[int], group: Any, wire: torch.device) -> None:
    """Receive every piece (``_pieces`` of ``tensors``), piece k from ``sources[k % len(sources)]``,
    at most ``HEAL_WINDOW`` per source in flight: a piece of one tensor straight into its memory,
    a packed one (or one of a tensor on another device than the wire's) into a staging buffer
    copied out once it has arrived. ``wire``: the group's ``wire_device``."""
    pieces = _pieces([t.numel() for t in tensors], STAGING_BYTES)
    flight: collections.deque = collections.deque()

    def land(piece: list[tuple[int, int, int]], staging: Optional[torch.Tensor]) -> None:
        if staging is None:
            return
        at = 0
        for i, b, e in piece:
            tensors[i][b:e].copy_(staging[at : at + e - b])
            at += e - b

    for k, piece in enumerate(pieces):
        if len(piece) == 1 and tensors[piece[0][0]].device == wire:
            i, b, e = piece[0]
            into, staging = tensors[i][b:e], None
        else:
            staging = torch.empty(sum(e - b for _, b, e in piece), dtype=torch.uint8, device=wire)
            into = staging
        flight.append((_p2p(False, into, sources[k % len(sources)], group, tag=PIECE_TAG + k), piece, staging))
        while len(flight) > HEAL_WINDOW * len(sources):
            work, done, buffer = flight.popleft()
            wait(work, p2p=True)
            land(done, buffer)
    while flight:
        work, done, buffer = flight.popleft()
        wait(work, p2p=True)
        land(done, buffer)


def share_state(
    obj: Any,
    sources: Sequence[int],
    receivers: Sequence[int],
    group: Optional[dist.ProcessGroup] = None,
    into: Optional[dict[str, torch.Tensor]] = None,
    names: Optional[dict[int, str]] = None,
) -> Any:
    """``obj`` of the group ranks ``sources`` (which hold the same state) on the ranks ``receivers``,
    point to point, in shards from every source at once, streamed: the fault-tolerant heal.

    The first source sends the pickled skeleton (everything but the CPU and CUDA tensors, and their
    shapes);
    the tensors' bytes are cut into pieces of at most ``STAGING_BYTES`` (``_pieces``), piece k sent
    by ``sources[k % len(sources)]`` to every receiver. A big tensor's pieces go from the source's
    memory into the receiver's (its new tensors, or ``into``'s); small tensors are packed, so
    neither side ever holds a buffer of the whole state. Ranks in neither list receive nothing and
    return ``obj``; a source returns its own ``obj``.

    Args:
        obj: the state (on the sources; ignored elsewhere).
        sources: group ranks holding the same state (the same tensor layout: checked).
        receivers: group ranks that receive it.
        into: on a receiver, tensors to write the bytes into, by name: a tensor that the sender
            named so (``names``) with the same dtype and shape is filled in place and stands in the
            result (a joiner's own parameters), instead of a new one.
        names: on a source, ``{id(tensor): name}`` for the tensors of ``obj`` that a receiver may
            hold as ``into[name]``.

    Example::

        >>> state = share_state(own if rank in (0, 1) else None, sources=[0, 1], receivers=[2])
    """
    rank = dist.get_rank(group)
    wire = wire_device(group)  # the header and skeleton travel there too (CUDA under NCCL)
    if rank in sources:
        buffer = io.BytesIO()
        pickler = _TensorsApart(buffer, names)
        pickler.dump(obj)
        tensors = pickler.raw
        lead = rank == sources[0]
        skeleton = buffer.getvalue() if lead else b""
        header = torch.cat([torch.tensor([len(skeleton)], dtype=torch.int64), _layout(tensors)]).to(wire)
        works = []
        for r in receivers:
            works.append(_p2p(True, header, r, group, tag=HEADER_TAG))
            if skeleton:
                works.append(
                    _p2p(
                        True,
                        torch.frombuffer(bytearray(skeleton), dtype=torch.uint8).to(wire),
                        r,
                        group,
                        tag=SKELETON_TAG,
                    )
                )
        for work in works:
            wait(work, p2p=True)
        pieces = _pieces([t.numel() for t in tensors], STAGING_BYTES)
        mine = list(range(list(sources).index(rank), len(pieces), len(sources)))
        _send_pieces(tensors, pieces, mine, list(receivers), group, wire)
        return obj
    if rank not in receivers:
        return obj
    headers = [torch.empty(4, dtype=torch.int64, device=wire) for _ in sources]
    for work in [_p2p(False, h, s, group, tag=HEADER_TAG) for h, s in zip(headers, sources)]:
        wait(work, p2p=True)
    headers = [h.cpu() for h in headers]
    head = torch.empty(int(headers[0][0]), dtype=torch.uint8, device=wire)
    if head.numel():
        wait(_p2p(False, head, sources[0], group, tag=SKELETON_TAG), p2p=True)
    loader = _TensorsFrom(io.BytesIO(tensor_bytes(head.cpu(), head.numel())), into)
    out = loader.load()
    layout = _layout(loader.tensors)
    for s, h in zip(sources, headers):
        if not torch.equal(h[1:], layout):
            raise RuntimeError(
                f"the heal's sources hold states of different layouts (rank {s}: {h[1:].tolist()}, rank "
                f"{sources[0]}: {layout.tolist()}); they were taken for replicas of the same state"
            )
    _receive_pieces(loader.tensors, list(sources), group, wire)
    return out


def check_same_everywhere(
    what: str, entries: Sequence[Any], group: Optional[dist.ProcessGroup], describe: Callable[[Any], str]
) -> None:
    """Raise ValueError on every rank if ``entries`` differ between ranks.

    Each rank's list is gathered (one collective), so every rank sees every
    other rank's and raises the same message naming the first difference.
    """
    world = group_size(group)
    gathered = all_gather_objects(list(entries), group)
    reference = gathered[0]
    for r in range(1, world):
        other = gathered[r]
        if other == reference:
            continue
        for i, (a, b) in enumerate(zip(reference, other)):
            if a != b:
                raise ValueError(
                    f"{what} differ between ranks: entry {i} is {describe(a)} on rank 0 "
                    f"but {describe(b)} on rank {r}. Every rank must wrap the same model "
                    f"with the same settings."
                )
        longer, shorter = (0, r) if len(reference) > len(other) else (r, 0)
        extra = (reference if longer == 0 else other)[min(len(reference), len(other))]
        raise ValueError(
            f"{what} differ between ranks: rank 0 has {len(reference)}, rank {r} has {len(other)}; "
            f"the first one only rank {longer} has is {describe(extra)}. Every rank must wrap "
            f"the same model with the same settings."
        )


class Waitable(Protocol):
    """A result on its way: a torch Work, a ``Pending``, a ``Finished``, an average in flight."""

    def wait(self) -> Any: ...


class Pending:
    """A result still being computed on a CommThread; ``wait()`` returns it or re-raises its error."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self._future = future

    def wait(self) -> Any:
        return self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()


class Finished:
    """A result already in hand, with ``Pending``'s face: ``wait()`` returns it at once (a sync
    restored from a checkpoint, the average over a single process)."""

    wire_bytes = 0

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value

    def is_completed(self) -> bool:
        return True


class CommThread:
    """One background thread running blocking communication routines in submission order.

    Algorithms whose reduction takes several dependent collectives (compress,
    exchange, decompress, exchange again) submit one routine per bucket; a
    single thread keeps every rank's collective sequence identical, and the
    routine overlaps backward. Give it a private process group
    (``private_group``) so its collectives never interleave with the main
    thread's on the same group.
    """

    def __init__(self, name: str = "unison-comm") -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Pending:
        return Pending(self._pool.submit(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@contextmanager
def raised_everywhere(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Run construction checks that may fail on some ranks only: if any rank's fails, every
    rank raises (the failing rank its own error, the others its type and message), so none
    is left waiting in a later collective. One small collective over ``group`` (None: none)."""
    problem: Optional[Exception] = None
    try:
        yield
    except (TypeError, ValueError, RuntimeError) as exc:  # NotImplementedError is a RuntimeError
        problem = exc
    if group is not None and dist.get_world_size(group) > 1:
        mine = None if problem is None else (type(problem), str(problem))
        for rank, theirs in enumerate(all_gather_objects(mine, group)):
            if theirs is not None and problem is None:
                kind, message = theirs
                raise kind(f"on rank {rank}: {message}")
    if problem is not None:
        raise problem
