"""``DataParallel``: the nn.Module users wrap; a drop-in for torch's DistributedDataParallel.

It checks that every rank wraps the same model, broadcasts rank 0's parameters
and buffers, builds the ``Core`` that runs the algorithm (its Replica, its
Dispatcher, the gradient engine, the fault-tolerance policy), and fires the
events of a training step from its forward and its optimizers' steps. The
default algorithm, "allreduce", averages gradients in flat buckets overlapped
with backward. Join's hook is in ``unison.join``, the non-finite agreement in
``unison.engine.nonfinite``, the debug check in ``unison.debug``, torch DDP's
keywords and checks in ``unison.ddp_keywords``, torch's comm-hook contract in
``unison.comm_hook``, fault tolerance in ``unison.fault`` and what pickling keeps in
``unison.pickling``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import algorithms as algos
from . import comm_hook, ddp_keywords, pickling, sharded
from .algorithm_hooks import eager
from .algorithms import support
from .algorithms.support import Context
from .core import (
    ALGORITHM_KEY,
    Core,
    check_bucket_cap,
    check_ranks_agree,
    membership,
    new_tag,
    parameter_entries,
    sparse_parameter,
    weak,
)
from .debug import check_step_agrees
from .engine import nonfinite as nonfinite_
from .engine.averaging import average_optimizer_states, default_reduce
from .engine.comm import AsyncBroadcast, default_broadcast, raised_everywhere
from .engine.reducer import Callbacks, GradReducer, Sync
from .fault import FaultTolerance, joining_member
from .join import STEP, CoreJoinHook, Join, JoinHook, forward_code
from .runtime import ending, health, private_group, replica_group

__all__ = ["ALGORITHM_KEY", "DataParallel"]

ReduceFn = Callable[[Sequence[torch.Tensor], Optional[dist.ProcessGroup]], None]


@dataclasses.dataclass(frozen=True)
class Options:
    """DataParallel's own keywords (torch DDP's are ``ddp_keywords.Keywords``), checked when made:
    built inside the constructor's agreement, so a bad one raises on every rank."""

    bucket_cap_mb: float
    negotiate_grads: bool
    find_unused_parameters: bool
    delay_reduce: bool
    reduce_function: Optional[ReduceFn]
    broadcast_function: Optional[ReduceFn]
    nonfinite: Optional[str]
    debug: bool
    fault_tolerant: bool
    ft_offload: bool

    def __post_init__(self) -> None:
        if self.ft_offload and not self.fault_tolerant:
            raise ValueError(
                "ft_offload=True keeps fault tolerance's saved gradients on the host: it needs fault_tolerant=True"
            )
        object.__setattr__(self, "bucket_cap_mb", check_bucket_cap(self.bucket_cap_mb))
        if self.nonfinite not in nonfinite_.MODES:
            raise ValueError(f"nonfinite must be None, 'raise' or 'skip', got {self.nonfinite!r}")
        for name, fn in (("reduce_function", self.reduce_function), ("broadcast_function", self.broadcast_function)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable as fn(tensors, group)")
        if self.find_unused_parameters and not self.negotiate_grads:
            raise ValueError(
                "find_unused_parameters=True needs negotiate_grads=True (negotiation is how unison finds them); "
                "with negotiate_grads=False a parameter with no gradient anywhere gets a zero gradient"
            )


def _the_module(module: Any) -> nn.Module:
    """The module to wrap: a restored wrapper's own module when one is wrapped again."""
    if isinstance(module, DataParallel) and module._restored:
        module = module.__dict__["_modules"]["module"]
    if not isinstance(module, nn.Module):
        raise TypeError(f"DataParallel wraps an nn.Module, not {type(module).__name__}")
    return module


def _replica_group(
    module: nn.Module, process_group: Optional[dist.ProcessGroup], ddp_kwargs: Mapping[str, Any], fault_tolerant: bool
) -> tuple[Optional[dist.ProcessGroup], bool]:
    """The group of the replicas, and whether the module is sharded over ``unison.node_mesh()``
    (then the replicas are the processes of this local rank on every node)."""
    group = ddp_keywords.group_of(process_group, ddp_kwargs.get("device_mesh"))
    on_nodes = group is None and sharded.on_node_mesh(module)
    if on_nodes:
        return replica_group(), True
    if fault_tolerant and any(sharded.is_dtensor(p) for p in module.parameters()):
        sharded.refuse_call(
            "fault_tolerant=True",
            " over a device_mesh: shard over unison.node_mesh(), whose group outlives the memberships, and leave "
            "device_mesh out",
        )
    return group, False


def _context(module: nn.Module, options: Options, fsdp2: bool) -> Context:
    """What this model and these options ask of any algorithm (``support.check``)."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return Context(options.fault_tolerant, fsdp2, sparse_parameter(trainable, module.modules()))


def _optimizers(optimizer: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None]) -> list[Any]:
    """``optimizer=`` as a list (one, several, or none)."""
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


logger = logging.getLogger("unison")


class DataParallel(nn.Module):
    """Data-parallel wrapper: every rank holds a replica, and the algorithm keeps them in agreement.

    Args:
        module: the model; it must already be on this process's device.
        optimizer: an optimizer (or several) whose ``step()`` fires the
            algorithm's after-step event. Gradient averaging needs none.
        algorithm: a name for ``unison.algorithms.create`` or an Algorithm.
        process_group: the group the replicas talk over (default: the world).
        broadcast_buffers: keep buffers (BatchNorm statistics) equal to rank 0's
            after every synchronized backward, and broadcast them at construction
            (default: True; False does neither, as in torch DDP).
        bucket_cap_mb: size of a gradient bucket in MiB (default 25; the first is at most 1 MiB).
        negotiate_grads: agree each step on which parameters have a gradient on
            some rank, so dynamic graphs need no flag and never hang. With False,
            a parameter with no gradient anywhere gets a zero gradient. Only a
            rank whose backward left a parameter without a gradient reads the
            agreement on the host (a wait for the device on a GPU).
        find_unused_parameters: torch DDP's flag; negotiation already lets
            parameters go without a gradient (one used on no rank keeps
            ``grad=None``, as torch's), so it needs ``negotiate_grads=True``.
        delay_reduce: reduce after backward instead of overlapping with it.
        reduce_function: ``fn(tensors, group)`` that averages ``tensors`` in
            place; replaces the algorithm's reduction (called after backward).
        broadcast_function: ``fn(tensors, group)`` that broadcasts ``tensors``
            in place from the group's first rank.
        nonfinite: what to do when a gradient holds nan or inf: None (nothing,
            as torch DDP), "raise" (every rank raises FloatingPointError naming
            the rank and the first such parameter), or "skip" (every rank skips
            that optimizer step together; the bad gradient never leaves its
            rank). ``model.skipped_steps`` counts skipped steps. With
            ``torch.amp.GradScaler`` leave it None: the scaler skips a step
            whose gradients overflowed on any rank itself, and its ``step``
            refuses an optimizer whose gradients "skip" dropped. The checks
            run on the device, but the agreed answer is read on the host once
            per synchronized step (on a GPU, one wait for the device per step):
            raising or skipping is decided before ``optimizer.step()`` runs.
        debug: check before every forward that all ranks are about to run the
            same step (forward count, synchronization, bucket plan, algorithm,
            world size) and raise naming the ranks that differ, instead of
            hanging or mixing data. Costs one 16-byte allreduce per forward.
            Default: the environment variable ``UNISON_DEBUG=1``.
        fault_tolerant: keep training when a member of the job dies, hangs,
            joins or leaves (the job must run under ``unison launch
            --fault-tolerant``; needs ``optimizer``). ``model.ft`` then gives
            the committed ``step``, the ``members`` and the ``events``; see
            docs/fault-tolerance.md. Without it, ``model.ft`` is None. Over a
            model sharded by FSDP2, the node's processes agree at each step's
            end whether to recover now, and read the answer on the host (over
            NCCL, one wait for the device per step).
        ft_offload: with ``fault_tolerant=True``, keep the one copy fault
            tolerance adds (each member's local gradients of the round in
            flight, to redo it after a failure) in host memory, pinned under
            CUDA, rather than on the parameters' device, and with it what an
            algorithm copies for the same redo (demo's momentum, powersgd's
            residuals before their round); default False. The same values,
            those copies off the device, a device-to-host copy per step.
        **ddp_kwargs: torch DDP's other keywords, with torch's meaning
            (``unison.ddp_keywords``): ``device_ids`` (one GPU; inputs are moved
            there), ``output_device``, ``dim``, ``init_sync`` (False: no initial
            broadcast), ``device_mesh`` (a 1-D mesh: its group),
            ``forward_sync_buffers``, ``static_graph`` (which parameters get
            gradients is agreed once, in the first synchronized backward),
            ``gradient_as_bucket_view`` (default True here, False in torch: the
            same values, one copy of the gradients less; False gives each
            ``.grad`` its own tensor), ``check_reduction`` (deprecated),
            ``skip_all_reduce_unused_params`` and ``batched_grad_copy`` (speed
            options of torch's; the same gradients here). ``mixed_precision``,
            ``bucket_cap_mb_list`` and the delayed-allreduce pair are refused
            with the reason.

    The module is checked as torch DDP checks it, with torch's error types and
    messages (a trainable parameter, one device type, ``device_ids`` only for a
    single-device GPU module, no uninitialized parameter, no SyncBatchNorm on
    CPU), and every rank raises when any rank's check fails: none is left
    waiting in a collective.

    Pickling (``torch.save(model)``, ``copy.deepcopy(model)``) keeps the module,
    the settings and the algorithm's configuration, and drops what is live, as
    torch DDP's ``__getstate__`` drops its process group and reducer: the group,
    the gradient engine, hooks, optimizers, custom reduce/broadcast functions and
    the algorithm's running state (save those with ``state_dict()`` or
    ``unison.save``). The restored wrapper has no process group: use it for
    inference, or wrap it (or its ``.module``) in a new ``DataParallel`` to
    train. Its forward runs the module; a forward with gradients enabled warns
    once that backward computes this process's gradients only, synchronizing
    nothing (it never waits for other ranks); ``join``, ``average``,
    ``register_comm_hook``, ``register_optimizer`` and ``switch_to`` raise.

    Example::

        model = unison.DataParallel(net)
        loss = loss_fn(model(x), y)
        loss.backward()          # gradients are now averaged across ranks
        optimizer.step()
    """

    #: True for a wrapper restored from a pickle or a deepcopy: no group, no engine.
    _restored = False

    def __init__(
        self,
        module: nn.Module,
        optimizer: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer], None] = None,
        algorithm: Union[str, algos.Algorithm] = "allreduce",
        process_group: Optional[dist.ProcessGroup] = None,
        broadcast_buffers: Optional[bool] = None,
        bucket_cap_mb: Optional[float] = None,
        negotiate_grads: bool = True,
        find_unused_parameters: bool = False,
        delay_reduce: bool = False,
        reduce_function: Optional[ReduceFn] = None,
        broadcast_function: Optional[ReduceFn] = None,
        nonfinite: Optional[str] = None,
        debug: Optional[bool] = None,
        fault_tolerant: bool = False,
        ft_offload: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        module = _the_module(module)
        algorithm = algos.as_algorithm(algorithm)  # resolved once: the instance every check and the Core see
        group, on_nodes = _replica_group(module, process_group, ddp_kwargs, fault_tolerant)
        worker = joining_member(fault_tolerant, algorithm, None if on_nodes else group, optimizer)
        self.process_group, self.world_size, self.rank = membership(group, "DataParallel")
        # Checks that may differ between ranks are agreed on before any other collective.
        with raised_everywhere(self.process_group if worker is None else None):
            torch_keywords = ddp_keywords.parse(ddp_kwargs, stacklevel=3)
            ddp_keywords.refuse_positional_device_ids(optimizer)
            options = Options(
                bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb,
                negotiate_grads=negotiate_grads,
                find_unused_parameters=find_unused_parameters,
                delay_reduce=delay_reduce,
                reduce_function=reduce_function,
                broadcast_function=broadcast_function,
                nonfinite=nonfinite,
                debug=os.environ.get("UNISON_DEBUG", "") not in ("", "0") if debug is None else bool(debug),
                fault_tolerant=fault_tolerant,
                ft_offload=ft_offload,
            )
            fsdp2 = sharded.check(module, torch_keywords.device_mesh)
            context = _context(module, options, fsdp2)
            support.check(algorithm, context)  # switch_to checks against the same (the Core keeps it)
            if fsdp2:
                custom = "reduce_function" if options.reduce_function is not None else None
                custom = "broadcast_function" if options.broadcast_function is not None else custom
                sharded.refuse_options(nonfinite=options.nonfinite, debug=options.debug, custom=custom)
            placement = ddp_keywords.check_module(module, torch_keywords.device_ids, torch_keywords.output_device)
            buffers = ddp_keywords.buffer_sync(broadcast_buffers, torch_keywords.forward_sync_buffers, stacklevel=3)
        self._keep(module, options, torch_keywords, placement, buffers)
        # Over FSDP2 the algorithm trains the local shards, talking across the replicate dimension.
        named, requires_grad = sharded.local_parameters(module) if fsdp2 else (list(module.named_parameters()), None)
        self._core = Core(
            algorithm,
            named,
            list(module.named_buffers()),
            self.process_group,
            self.serial,
            modules=list(module.modules()),
            broadcast_buffers=self.broadcast_buffers,
            bucket_cap_mb=options.bucket_cap_mb,
            requires_grad=requires_grad,
            context=context,
            optimizers=_optimizers(optimizer),
            around_steps=(weak(self._before_step), weak(self._after_step)),
        )
        self._join_hook = CoreJoinHook(self._core, module, weak(self._shadow_step))
        self._guard(worker, options, named)
        # A wrapper that is garbage-collected without close() leaves no hook or thread behind; the
        # job's end (runtime/ending.py) lets go of its groups.
        self._finalizer = weakref.finalize(self, self._core.release)
        if self.process_group is not None:
            ending.hold(self._let_go_of_groups, self._release)
        # Fault tolerance: a joiner takes the members' state (at the job's start, rank 0's), and a
        # member lost while the algorithm builds its groups is recovered from.
        self._core.fault.start(self._start_algorithm)
        logger.info(
            "DataParallel: %d parameter tensor(s), algorithm %s, %d rank(s)%s",
            len(self._core.replica.named_parameters),
            self.algorithm.describe(),
            self.world_size,
            ", fault tolerant" if worker is not None else "",
        )

    # ---- construction steps ------------------------------------------
    def _keep(
        self,
        module: nn.Module,
        options: Options,
        torch_keywords: ddp_keywords.Keywords,
        placement: tuple[Any, Any],
        buffers: tuple[bool, bool],
    ) -> None:
        """The checked settings, as the wrapper's attributes (torch DDP's among them, with torch's values)."""
        self.module = module
        self.broadcast_buffers, self._initial_buffers = buffers
        self.negotiate_grads = options.negotiate_grads
        self.find_unused_parameters = options.find_unused_parameters
        self.delay_reduce = options.delay_reduce
        self.nonfinite = options.nonfinite
        self.debug = options.debug
        self.device_ids, self.output_device = placement
        self.dim = torch_keywords.dim
        self.init_sync = torch_keywords.init_sync
        self.skip_all_reduce_unused_params = torch_keywords.skip_all_reduce_unused_params
        self.static_graph = torch_keywords.static_graph
        self.gradient_as_bucket_view = torch_keywords.gradient_as_bucket_view
        self.device = next(iter(module.parameters())).device
        self.device_type = self.device.type
        self._reduce_function = options.reduce_function
        self._broadcast_function = options.broadcast_function or default_broadcast
        self._require_sync = True
        self._forwards = 0
        self._skipped_local = 0
        self._buffer_sync: Optional[AsyncBroadcast] = None
        self._step_group: Optional[dist.ProcessGroup] = None
        self.serial = new_tag("model")

    def _guard(self, worker: Any, options: Options, named: list[tuple[str, nn.Parameter]]) -> None:
        """Under fault tolerance its policy (its first settle makes the replicas equal); otherwise the
        collectives that check the ranks agree and make the replicas equal."""
        self.optimizers = self._core.optimizers
        if worker is not None:
            self._core.fault = FaultTolerance(self, worker)
            self._core.saved_on_host = options.ft_offload
        if self.process_group is not None and not self._core.fault.active:
            with self._core.entry("building DataParallel"):
                self._construct_collectives(named)

    def _construct_collectives(self, named: list[tuple[str, nn.Parameter]]) -> None:
        health.start(dist.get_rank(), dist.get_world_size())  # if unison.init() did not (a group made by hand)
        self._check_ranks_agree(named)
        self._step_group = private_group(self.process_group, f"{self.serial}/step")
        if not self.init_sync:
            return  # torch's init_sync=False: the user made the replicas equal
        with torch.no_grad():
            tensors: list[torch.Tensor] = [p for _, p in named]
            if self._initial_buffers:
                tensors += [b for _, b in self.module.named_buffers()]
            if tensors:
                self._broadcast_function(tensors, self.process_group)

    def _check_ranks_agree(self, named: list[tuple[str, nn.Parameter]]) -> None:
        entries = parameter_entries(named, self._core.replica.requires_grad)
        entries += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in self.module.named_buffers()]
        entries += [
            ("setting", "algorithm", self.algorithm.describe()),
            ("setting", "bucket_cap_mb", self.bucket_cap_mb),
            ("setting", "broadcast_buffers", self.broadcast_buffers),
            ("setting", "init_sync", self.init_sync),
            ("setting", "buffers broadcast at construction", self._initial_buffers),
            ("setting", "negotiate_grads", self.negotiate_grads),
            ("setting", "delay_reduce", self.delay_reduce),
            ("setting", "static_graph", self.static_graph),
            ("setting", "gradient_as_bucket_view", self.gradient_as_bucket_view),
            ("setting", "nonfinite", self.nonfinite),
            ("setting", "debug", self.debug),
            ("setting", "world size", self.world_size),
            ("setting", "optimizers", len(self.optimizers)),
        ]
        check_ranks_agree("the wrapped models", entries, self.process_group)

    def _start_algorithm(self) -> None:
        events = self._core.start()
        group = events.gradient_group() if self.process_group is not None else None
        distributed = group is not None and dist.get_world_size(group) > 1
        if self._core.fsdp2:  # FSDP2 reduce-scatters the gradients inside the node; allreduce averages them across
            if distributed and sharded.averages_gradients(self.algorithm):
                private = self._core.replica.private_group("allreduce")
                wire = sharded.gradient_wire(self.algorithm)
                self._core.hooks.keep(sharded.ReplicaAllReduce(self.module, private, self._core.count_bytes, wire))
            return
        if self.algorithm.reduces_gradients and distributed or self._reduce_function is not None:
            self._build_reducer(group if distributed else None)

    def _build_reducer(self, group: Optional[dist.ProcessGroup]) -> GradReducer:
        """The gradient engine over the trainable parameters (``group`` None: one replica)."""
        has_buffers = self.broadcast_buffers and group is not None and any(True for _ in self.module.buffers())
        return self._core.build_reducer(
            group,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            sync=Sync(
                negotiate=self.negotiate_grads,
                delay=self.delay_reduce,
                nonfinite=self.nonfinite,
                defers_completion=self.algorithm.defers_completion,
            ),
            callbacks=Callbacks(
                self._reduce_function,
                on_begin=[weak(self._start_buffer_sync)] if has_buffers else [],
                on_end=[weak(self._finish_buffer_sync)] if has_buffers else [],
            ),
        )

    @property
    def core(self) -> Core:
        """The algorithm, its engine and hooks on this model (for fault tolerance and integrations)."""
        return self._core

    @property
    def ft(self) -> Optional[FaultTolerance]:
        """With ``fault_tolerant=True``: the committed ``step``, the ``members``, the ``events``
        (docs/fault-tolerance.md); None otherwise."""
        fault = self._core.fault
        return fault if isinstance(fault, FaultTolerance) else None

    def regrouped(self) -> None:
        """Fault tolerance built the world again over new members: run the algorithm on it,
        its state carried over. Not for users to call."""
        group = replica_group() if self._core.fsdp2 else None  # over FSDP2: this local rank's replicas
        self.process_group, self.world_size, self.rank = membership(group, "DataParallel")
        entry = self._core.regroup(self.process_group)
        self._start_algorithm()
        if entry is not None:
            self._core.load_algorithm_entry(entry, strict=False, what="model")

    def switch_to(self, algorithm: Union[str, algos.Algorithm[Any]]) -> "DataParallel":
        """Change the algorithm mid-training, on every rank at the same step; returns the model.

        Pending communication completes, the replicas' parameters are averaged
        (and buffers set to rank 0's), then the new algorithm takes over.
        Registered comm hooks belong to the old algorithm and are dropped.

        Example::

            model = model.switch_to("local_sgd:period=8")
        """
        self._require_live("switch_to()")
        new = algos.as_algorithm(algorithm)
        self._core.refuse_unsupported(new)  # before the running algorithm stops
        with self._core.entry("switch_to()"):
            if self.process_group is not None:
                check_ranks_agree(
                    "the algorithms switched to", [("setting", "algorithm", new.describe())], self.process_group
                )
            self.average()
            self._core.stop()
            self._core.algorithm = new
            self._start_algorithm()
        logger.info("%s: switched to %s", self.serial, new.describe())
        return self

    def close(self) -> None:
        """Stop using this wrapper: finish pending work, stop the algorithm's threads and
        remove every hook it put on the module, its parameters and the optimizers.

        The module keeps its trained weights and can be wrapped again. Called
        automatically when the wrapper is garbage-collected.
        """
        if self._core.dispatcher is None:
            return
        try:
            self._core.stop()
        finally:
            self._finalizer()  # no hook is left behind, even when the algorithm's teardown raised

    def _release(self) -> None:
        """The job ends (``unison.shutdown()``, or the interpreter's exit without it): released as
        when collected (no collective, no thread, no hook left)."""
        self._finalizer()

    def _let_go_of_groups(self) -> None:
        """Then its groups are dropped, so that their threads are joined before the interpreter
        finalizes (runtime/ending.py)."""
        self.process_group = self._step_group = self._buffer_sync = None
        self._core.replica.group = None

    @property
    def algorithm(self) -> algos.Algorithm[Any]:
        """The running algorithm's configuration (``switch_to`` changes it)."""
        return self._core.algorithm

    @property
    def algorithm_state(self) -> Optional[algos.State]:
        """The running algorithm's per-model state (what its ``setup`` built), or None."""
        return None if self._core.dispatcher is None else self._core.dispatcher.state

    @property
    def bucket_cap_mb(self) -> float:
        """The gradient bucket size, in MiB (``set_bucket_size`` changes it)."""
        return self._core.bucket_cap_mb

    def set_bucket_size(self, bucket_cap_mb: float) -> None:
        """Re-plan the gradient buckets at ``bucket_cap_mb`` MiB each, now and for later algorithms.

        No collective, but every rank must call it with the same value between
        the same two steps (autotuners pick it from scores agreed by all ranks).
        """
        self._core.set_bucket_size(bucket_cap_mb)

    def _start_buffer_sync(self) -> None:
        reducer = self._core.reducer
        if self._broadcast_function is default_broadcast and reducer is not None:
            # Over the gradient group: the node under DASO, the process group otherwise.
            self._buffer_sync = AsyncBroadcast(list(self.module.buffers()), reducer.group)

    def _finish_buffer_sync(self) -> None:
        if self._buffer_sync is not None:
            self._buffer_sync.finish()
            self._buffer_sync = None
        elif self._core.reducer is not None:
            with torch.no_grad():
                self._broadcast_function(list(self.module.buffers()), self._core.reducer.group)

    # ---- the training step ---------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.device_ids:  # torch DDP's device_ids: inputs are moved to the module's device
            args, kwargs = ddp_keywords.moved((args, kwargs), torch.device(self.device_type, self.device_ids[0]))
        if self._restored:
            return self._restored_forward(*args, **kwargs)
        watch = self._before_module()
        if torch.compiler.is_compiling():  # the module is compiled; the wrapper's bookkeeping is not
            output = self.module(*args, **kwargs)
        else:
            with self._core.entry("forward"):
                output = self.module(*args, **kwargs)
        return self._after_module(output, watch)

    # Under torch.compile the wrapper's bookkeeping runs eagerly, between the module's graphs
    # (as torch DDP's pre- and post-forward do): traced, its counters would be guarded on and
    # the forward recompiled at every step, and the reducer's autograd hooks cannot be traced.
    @eager
    def _before_module(self) -> bool:
        """Join's announcement, the debug check, the algorithm's before-forward, the engine's
        pass; True if the output is to be watched for the synchronized backward."""
        with self._core.entry("forward"):
            join = self._join_hook.active
            if join is not None:
                join.notify(forward_code(torch.is_grad_enabled(), self._require_sync))
            elif self.debug and self.process_group is not None:
                check_step_agrees(self._core, self._forwards, self._require_sync, self._step_group)
            self._forwards += 1
            self._core.before_forward()
            reducer = self._core.reducer
            if reducer is None or not torch.is_grad_enabled():
                return False
            reducer.prepare(self._require_sync)
            return self._require_sync

    @eager
    def _after_module(self, output: Any, watch: bool) -> Any:
        with self._core.entry("forward"):
            reducer = self._core.reducer
            if watch and reducer is not None:
                reducer.watch(output)
            self._core.events.after_forward(output)
            return output

    def _restored_forward(self, *args: Any, **kwargs: Any) -> Any:
        """A restored wrapper's forward: the module's, synchronizing nothing (said once when training)."""
        if torch.is_grad_enabled() and not self.__dict__.get("_warned_restored"):
            self._warned_restored = True
            warnings.warn(pickling.RESTORED + " Backward computes this process's gradients only.", stacklevel=3)
        return self.module(*args, **kwargs)

    def _require_live(self, what: str) -> None:
        if self._restored:
            raise RuntimeError(f"{what}: {pickling.RESTORED}")

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False while inside ``no_sync()`` (setting it is ``no_sync``'s switch)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._require_sync = bool(value)

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """A context manager for uneven inputs: wrap the training loop in it.

        A rank whose loop ends first keeps answering the other ranks'
        collectives (contributing zero gradients and no update) until every
        rank is done; then all ranks take the parameters and buffers of the rank
        that trained longest. Works for every algorithm; torch's ``Join``
        arguments mean the same here. While it is active, each forward and
        optimizer step costs one extra tiny allreduce, whose result every rank
        reads on the host (over NCCL, a wait for the device each time): a rank
        that ran out learns what to shadow, the others check that they run the
        same step and take the divisor.

        Example::

            with model.join():
                for x, y in loader:          # ranks may have different lengths
                    optimizer.zero_grad()
                    loss_fn(model(x), y).backward()
                    optimizer.step()
        """
        self._require_live("join()")
        if self._core.fsdp2:
            sharded.refuse_call("join()")
        return Join(self.join_hook(), divide_by_initial_world_size, enable, throw_on_early_termination)

    def join_hook(self) -> JoinHook:
        """What ``join()`` runs on this model: announces, shadow steps, the final agreement."""
        return self._join_hook

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped on every rank because a gradient was not finite (``nonfinite="skip"``)."""
        reducer = self._core.reducer
        return self._skipped_local + (reducer.skipped_steps if reducer is not None else 0)

    def average(self) -> None:
        """Make every replica identical now: a collective, so every rank must call it.

        Pending work is finished, the algorithm does its final sync, then the
        parameters are averaged and the buffers set to rank 0's. For
        model-averaging algorithms, whose replicas drift apart between syncs,
        call it at the end of training before saving; ``state_dict()`` itself
        never communicates, so saving on rank 0 alone cannot hang.

        With ``fault_tolerant=True`` a membership change during it is recovered from and the
        average done again over the new members.
        """
        self._require_live("average()")
        with self._core.entry("average()"):
            self._core.recovering(self._average)

    def _average(self) -> None:
        events = self._core.events
        events.flush()
        if self.process_group is None:
            return
        events.average()
        with torch.no_grad():
            params = self._core.replica.parameters  # the module's, or FSDP2's local shards
            if params:
                default_reduce(params, self.process_group)
            buffers = list(self.module.buffers())
            if buffers and self.broadcast_buffers:
                self._broadcast_function(buffers, self.process_group)
        if self.algorithm.replicas_drift:
            self._core.retired_bytes += average_optimizer_states(self.optimizers, self.process_group, sharded.local)

    def flush(self) -> None:
        """Finish the algorithm's pending communication and updates now (eval() and state_dict() do this too)."""
        self._core.flush()

    def train(self, mode: bool = True) -> "DataParallel":
        """Set training mode; leaving it (``eval()``) first flushes pending updates."""
        if not mode and "_core" in self.__dict__:
            self.flush()
        return super().train(mode)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this block accumulate local
        gradients without communicating; the next synchronized one averages the sum.
        Over FSDP2 (allreduce, fp16, bf16) it is FSDP2's ``set_requires_gradient_sync(False)``:
        no reduce-scatter inside the node either, as torch's HSDP."""
        fsdp2 = self._core.fsdp2 and sharded.averages_gradients(self.algorithm)
        if self._core.fsdp2 and self.algorithm.reduces_gradients and not fsdp2:
            sharded.refuse_call(f"no_sync() with {self.algorithm.name}")
        previous = self._require_sync
        self._require_sync = False
        if fsdp2:  # FSDP2 keeps the unsharded gradients and sends nothing, inside the node or across
            sharded.gradient_sync(self.module, False)
        try:
            yield
        finally:
            self._require_sync = previous
            if fsdp2 and previous:
                sharded.gradient_sync(self.module, True)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Fire the algorithm's after-step event after each ``optimizer.step()``."""
        self._require_live("register_optimizer()")
        self._core.add_optimizer(optimizer, weak(self._before_step), weak(self._after_step))

    def _before_step(self, optimizer: torch.optim.Optimizer, shadow: bool = False) -> None:
        """Before a registered optimizer's step: the algorithm's pre-step hooks, tell joined ranks,
        check gradients if asked."""
        with self._core.entry("optimizer.step()"):
            if not shadow:
                self._core.before_step(optimizer)
            if self.process_group is None or self._core.hooks.replaced(optimizer):
                return  # nonblocking runs the real step layer by layer inside forward
            join = self._join_hook.active
            if join is not None and not shadow:
                join.notify(STEP + self.optimizers.index(optimizer))
            if optimizer is self.optimizers[0]:
                self._agree_finite(shadow)

    def _agree_finite(self, shadow: bool) -> None:
        """Gradients the engine did not screen this step (model averaging): agree on the first bad one."""
        reducer = self._core.reducer
        if self.nonfinite is None or (reducer is not None and reducer.screened(self.world_size)):
            return
        trainable = self._core.replica.trainable
        if nonfinite_.agree_at_step(trainable, self.nonfinite, self.rank, self.world_size, self._step_group, shadow):
            self._skipped_local += 1

    def _after_step(self, optimizer: torch.optim.Optimizer, shadow: bool = False) -> None:
        with self._core.entry("the algorithm's step"):
            self._core.after_step(optimizer, shadow)

    def _shadow_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A rank that ran out of inputs under ``join()`` takes part in the others' step, updating nothing."""
        self._before_step(optimizer, shadow=True)
        self._after_step(optimizer, shadow=True)

    def end_epoch(self, loss: Optional[float] = None, averaged: bool = False) -> None:
        """Tell the algorithm an epoch ended (schedules such as DASO's use the loss).

        Args:
            loss: this rank's loss of the epoch, or None.
            averaged: the loss is already the mean over the ranks (HeAT's
                ``loss_globally_averaged``): DASO does not average it again.
        """
        self._core.events.end_epoch(None if loss is None else float(loss), averaged)

    def add_scaler(self, scaler: Any) -> None:
        """Tell the algorithm about a ``torch.amp.GradScaler`` (DASO counts a batch whose step
        the scaler skipped at ``scaler.update()``). Call it once per scaler."""
        self._core.hooks.watch_scaler(scaler)

    # ---- hooks ----------------------------------------------------------
    def register_comm_hook(
        self, state: Any = comm_hook.NOT_GIVEN, hook: Any = comm_hook.NOT_GIVEN
    ) -> Optional[RemovableHandle]:
        """Register a communication hook, in torch DDP's form or pytorch-pfn-extras'.

        ``register_comm_hook(state, hook)`` or ``register_comm_hook(state=..., hook=...)``
        (torch DDP): ``hook(state, bucket)`` returns a ``torch.futures.Future`` of the
        reduced bucket and replaces the reduction, so torch's own hooks
        (``default_hooks.fp16_compress_hook``, PowerSGD, ...) run unchanged. torch's
        checks and messages apply (``unison.comm_hook``): the hook is callable, its
        ``bucket`` annotated ``dist.GradBucket`` if at all, its return annotated
        ``torch.futures.Future[torch.Tensor]`` if at all; it is registered once only
        (RuntimeError after); one that returns no Future raises torch's RuntimeError
        in backward. Returns None.

        ``register_comm_hook(hook)`` (pytorch-pfn-extras): ``hook(model)`` runs
        after backward, before gradients are synchronized; returns a handle
        whose ``remove()`` unregisters it. Both forms may be registered together.

        Example::

            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            model.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
        """
        self._require_live("register_comm_hook()")
        if self._core.fsdp2:
            sharded.refuse_call("register_comm_hook()")
        kind, state, hook = comm_hook.form(state, hook)
        if kind == comm_hook.PFN:
            if not callable(hook):
                raise TypeError("register_comm_hook(hook): hook must be callable as hook(model)")
            model = weakref.ref(self)
            return self._require_reducer().add_before_sync(lambda: hook(model()))
        comm_hook.check(hook)
        if not self.algorithm.reduces_gradients:
            raise RuntimeError(
                f"algorithm {self.algorithm.name!r} never averages gradients, so a (state, hook) comm hook "
                "would never run; register a hook(model) instead, which runs after every backward"
            )
        reducer = self._require_reducer()
        if reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        reducer.register_comm_hook(state, comm_hook.FutureChecked(hook))
        return None

    def _require_reducer(self) -> GradReducer:
        """The gradient engine; built on demand for hooks where none runs (one replica,
        one process per node under DASO, model averaging)."""
        if not self._core.replica.trainable:
            raise RuntimeError("this DataParallel has no trainable parameters, so it has no communication hooks")
        if self._core.reducer is None:
            return self._build_reducer(None)
        return self._core.reducer

    # ---- state ----------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # torch.nn.Module.state_dict's overloads
        """The wrapped module's state dict (same keys, no ``module.`` prefix),
        plus the algorithm's state under ``"_unison_algorithm"`` if it keeps any."""
        self.flush()
        state = self.module.state_dict(*args, **kwargs)
        entry = self._core.algorithm_entry() if self._core.dispatcher is not None else None
        if entry is not None:
            state[kwargs.get("prefix", "") + ALGORITHM_KEY] = entry
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved by ``state_dict()``, by the wrapped module, or by
        torch DDP (``module.`` prefix). The algorithm's state is restored when it
        was saved by the same algorithm; from another one it is refused when
        ``strict`` and ignored otherwise."""
        state = dict(state_dict)
        entry = state.pop(ALGORITHM_KEY, None) or state.pop("module." + ALGORITHM_KEY, None)
        if state and all(k.startswith("module.") for k in state):
            state = {k[len("module.") :]: v for k, v in state.items()}
        if entry is not None and self._restored:
            if strict:
                raise ValueError(f"the state dict holds an algorithm's state: {pickling.RESTORED}")
            entry = None
        ours = entry is not None and self._core.accepts(
            entry, strict, "model", _SWITCH_FIRST
        )  # before any weight changes
        result = self.module.load_state_dict(state, strict=strict, assign=assign)
        if self._core.fsdp2:
            sharded.check_views(self.module, self._core.replica.named_parameters)
        if ours and entry is not None:
            self._core.events.load_state_dict(entry["state"])
        return result

    # ---- pickling (unison.pickling) ---------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What ``torch.save(model)`` and ``copy.deepcopy(model)`` keep: pending updates are
        applied first, then the live parts are left out (the class docstring says which)."""
        live = "_core" in self.__dict__
        if live:
            self.flush()
        hooks = self._core.hooks.module_hooks if live else []
        return pickling.picklable(self.__dict__, self.module, hooks, self.algorithm, self.bucket_cap_mb)

    def __setstate__(self, state: dict[str, Any]) -> None:
        module = state["_modules"]["module"]
        core = pickling.idle_core(state, module, state["serial"], state["broadcast_buffers"])
        super().__setstate__(state)
        self._restored = True
        self.process_group, self.world_size, self.rank = None, 1, 0
        self._reduce_function = None
        self._broadcast_function = default_broadcast
        self._buffer_sync = None
        self._step_group = None
        self._core = core
        self.optimizers = core.optimizers
        self._join_hook = CoreJoinHook(core, self.module, weak(self._shadow_step))
        self._finalizer = weakref.finalize(self, core.release)

    @property
    def comm_stats(self) -> dict[str, float]:
        """What this rank sent: gradient buckets plus the algorithm's own traffic (weights,
        pseudo-gradients), in total, in the last backward pass, and per optimizer step
        (per synchronized backward pass when no optimizer was given)."""
        core = self._core
        total = core.bytes_total
        steps = core.clock.steps if self.optimizers else core.passes
        return {
            "steps": steps,
            "bytes_total": total,
            "bytes_last_step": core.reducer.bytes_last if core.reducer is not None else 0,
            "bytes_per_step": total / steps if steps else 0.0,
        }


_SWITCH_FIRST = "; call switch_to({saved}) first, or load with strict=False to keep only the weights"
