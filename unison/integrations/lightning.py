"""PyTorch Lightning: ``Trainer(strategy=UnisonStrategy("local_sgd"))`` trains with
:class:`unison.DataParallel` and any unison algorithm.

The strategy is Lightning's ``DDPStrategy`` with unison underneath: the process
group comes from ``unison.init()`` (so ``UNISON_NODES`` and the node layout
work under every launcher Lightning supports), the LightningModule is wrapped
in ``unison.DataParallel`` with the Trainer's optimizers registered, and
replicas that drift (model averaging) are averaged before validation, in
checkpoints and at the end of ``fit``. The manual is docs/lightning.md.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'unison.integrations.lightning needs PyTorch Lightning 2.2 or later: pip install "unison[lightning]" '
        f'(or pip install "lightning>=2.2") [{exc}]'
    ) from exc

import unison
from unison import algorithms
from unison.checkpoint import entry_for_rank, rng_states, set_rng_states, to_cpu
from unison.engine.averaging import average_
from unison.engine.comm import default_broadcast, gather_objects
from unison.parallel import ALGORITHM_KEY

from ..runtime import torch_private

__all__ = ["UnisonStrategy"]

# The key of unison's part of a Lightning checkpoint, and its format version.
CHECKPOINT_KEY = "unison"
_CHECKPOINT_VERSION = 1
# DataParallel arguments the strategy provides itself.
_OWN_ARGS = ("module", "optimizer")


class UnisonStrategy(DDPStrategy):
    """Lightning strategy that trains the LightningModule with :class:`unison.DataParallel`.

    Each process holds a replica and the chosen unison algorithm keeps the
    replicas in agreement: gradient averaging ("allreduce", "powersgd", ...)
    behaves as ``DDPStrategy``; model averaging ("local_sgd", "diloco", "daso",
    ...) lets replicas drift between syncs, and the strategy averages them
    before each validation, in every checkpoint's ``state_dict`` and when
    ``fit`` ends, so what is evaluated, saved and returned is one model.

    It launches like ``DDPStrategy`` (Lightning's own subprocess launcher,
    torchrun, SLURM, ...; ``num_nodes``; CPUs or GPUs) and starts the process
    group with ``unison.init()``, which ``UNISON_NODES=N`` turns into N
    simulated nodes. The process group then lives as long as the process (as
    with ``DDPStrategy``), so several ``fit``/``test`` calls share it; call
    ``unison.shutdown()`` at the end of the script to release it.

    Args:
        algorithm: a name for ``unison.algorithms.create`` (options may be
            written in it: ``"powersgd:rank=2"``) or an ``Algorithm``. A name
            gives every ``fit`` a fresh algorithm; an instance is used as is.
        average_before_eval: for algorithms whose replicas drift, average them
            (``model.average()``) before each validation run during ``fit``,
            so the metrics are those of the averaged model; training then goes
            on from the average (one extra synchronization per validation).
            With False each rank validates its own replica and metrics logged
            with ``sync_dist=True`` are the mean of the replicas' metrics.
        epoch_loss: the logged metric given to ``model.end_epoch(loss)`` at the
            end of each training epoch (DASO's schedule uses it); default the
            first of "train_loss", "loss" that was logged (``on_epoch=True``).
        process_group_backend: "gloo" or "nccl"; default from the device.
        timeout: seconds (or a timedelta) a collective may wait for a silent
            rank before failing with ``unison.RankFailure``; default unison's.
        start_method: how Lightning starts the processes when it launches them:
            "popen" (re-runs the script, the default), "spawn", "fork" or "forkserver".
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision_plugin: as for ``DDPStrategy``; the Trainer fills them in.
        **dataparallel_kwargs: passed to ``unison.DataParallel``
            (``bucket_cap_mb``, ``broadcast_buffers``, ``nonfinite``, ``debug``, ...).

    Example::

        import lightning as L
        from unison.integrations.lightning import UnisonStrategy

        trainer = L.Trainer(strategy=UnisonStrategy("local_sgd"), accelerator="cpu", devices=2, max_epochs=5)
        trainer.fit(model)           # every rank ends with the same (averaged) weights

        # switch algorithm from a callback, on every rank at the same step
        class Switch(L.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                if trainer.current_epoch == 3:
                    trainer.strategy.switch_to("allreduce")
    """

    def __init__(
        self,
        algorithm: Union[str, algorithms.Algorithm] = "allreduce",
        *,
        average_before_eval: bool = True,
        epoch_loss: Optional[str] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[Union[float, datetime.timedelta]] = None,
        start_method: str = "popen",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        **dataparallel_kwargs: Any,
    ) -> None:
        own = sorted(set(dataparallel_kwargs) & set(_OWN_ARGS))
        if own:
            raise TypeError(
                f"UnisonStrategy sets DataParallel's {', '.join(own)} itself: the module is the LightningModule "
                "and the optimizers are those configure_optimizers() returns"
            )
        if not isinstance(algorithm, (str, algorithms.Algorithm)):
            raise TypeError(f"algorithm must be a name or a unison Algorithm, not {type(algorithm).__name__}")
        if isinstance(algorithm, str):
            algorithms.create(algorithm)  # refuse an unknown name or option now, not after the processes started
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = datetime.timedelta(seconds=timeout)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,  # type: ignore[arg-type]
            start_method=start_method,  # type: ignore[arg-type]
        )
        self._algorithm_spec = algorithm
        self._dataparallel_kwargs = dataparallel_kwargs
        self.average_before_eval = bool(average_before_eval)
        self.epoch_loss = epoch_loss
        self._hooks: Optional[_UnisonHooks] = None
        self._hooks_trainer: Optional["pl.Trainer"] = None
        self._failed = False
        self._final_average_done = False
        self._warned_no_loss = False
        self._last_algorithm: Optional[algorithms.Algorithm] = None

    # ---- what users call ---------------------------------------------------
    @property
    def algorithm(self) -> algorithms.Algorithm:
        """The algorithm running now (after a ``switch_to``, the new one); after ``fit``, the
        one that ran last; before, the one the next ``fit`` starts with."""
        if isinstance(self.model, unison.DataParallel):
            return self.model.algorithm
        if self._last_algorithm is not None:
            return self._last_algorithm
        spec = self._algorithm_spec
        return algorithms.create(spec) if isinstance(spec, str) else spec

    def switch_to(self, algorithm: Union[str, algorithms.Algorithm]) -> algorithms.Algorithm:
        """Change the algorithm mid-training: a collective, call it on every rank at the same
        step (from a callback hook such as ``on_train_epoch_start`` or ``on_train_batch_end``).

        Pending communication completes and the replicas are averaged, then the new
        algorithm takes over (``DataParallel.switch_to``). Returns the new algorithm.
        Outside ``fit`` it sets the algorithm the next ``fit`` starts with.
        """
        if isinstance(self.model, unison.DataParallel):
            self.model.switch_to(algorithm)
            return self.model.algorithm
        if isinstance(algorithm, str):
            algorithms.create(algorithm)
        elif not isinstance(algorithm, algorithms.Algorithm):
            raise TypeError(f"algorithm must be a name or a unison Algorithm, not {type(algorithm).__name__}")
        self._algorithm_spec = algorithm
        self._last_algorithm = None
        return self.algorithm

    # ---- process group --------------------------------------------------------
    def setup_distributed(self) -> None:
        """Start (or adopt) the process group with ``unison.init()``, from the ranks Lightning's
        cluster environment reports (its own launcher, torchrun, SLURM, LSF, ...)."""
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address  # as Lightning's DDP does
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        launch = {
            "RANK": self.global_rank,
            "WORLD_SIZE": self.world_size,
            "LOCAL_RANK": self.local_rank,
            "LOCAL_WORLD_SIZE": self.num_processes,
        }
        with _environment({k: str(v) for k, v in launch.items()}):
            unison.init(backend=self._process_group_backend, timeout=self._timeout)

    # ---- wrapping the model ----------------------------------------------------
    def setup(self, trainer: "pl.Trainer") -> None:
        """Set up the accelerator, the optimizers and then the unison wrapper (its
        algorithm acts on optimizer steps, so it needs the optimizers when it is built)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._failed = self._final_average_done = False
        self._last_algorithm = None
        if fitting:
            self.setup_optimizers(trainer)
            self.configure_ddp()
            self._attach_hooks(trainer)
        else:
            _broadcast_module(self.model)  # not wrapped: start every rank from rank 0's weights, as DDPStrategy does
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to(self.optimizers, self.root_device)
            self._connect_scaler()

    def configure_ddp(self) -> None:
        """Wrap the LightningModule in ``unison.DataParallel`` with the Trainer's optimizers."""
        assert isinstance(self.model, pl.LightningModule)
        self.model = self._setup_model(self.model)

    def _setup_model(self, model: nn.Module) -> "unison.DataParallel":  # type: ignore[override]  # not a DDP
        spec = self._algorithm_spec
        algorithm = algorithms.create(spec) if isinstance(spec, str) else spec
        optimizers = list(self.optimizers) or None
        return unison.DataParallel(model, optimizer=optimizers, algorithm=algorithm, **self._dataparallel_kwargs)

    def _attach_hooks(self, trainer: "pl.Trainer") -> None:
        """Put the strategy's callback first, so users' callbacks see averaged replicas."""
        trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, _UnisonHooks)]  # type: ignore[attr-defined]
        self._hooks = _UnisonHooks(self)
        trainer.callbacks.insert(0, self._hooks)  # type: ignore[attr-defined]
        self._hooks_trainer = trainer

    def _connect_scaler(self) -> None:
        """Under AMP with a GradScaler, let algorithms that count steps see skipped ones (DASO)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and isinstance(self.model, unison.DataParallel):
            self.model.add_scaler(scaler)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the wrapped model, so each rank gets its own replica and
        the algorithm its state (the wrapper broadcasts rank 0's weights when it is built)."""
        return True

    # ---- the training step ------------------------------------------------------
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the training step's closure (forward, backward, Lightning's hooks and gradient
        clipping) before ``optimizer.step()``, as Lightning's AMP plugin does: unison's
        step hooks then see this step's averaged gradients, and algorithms that defer
        the step ("nonblocking") work. LBFGS, which re-evaluates its closure, keeps it."""
        if isinstance(self.model, unison.DataParallel) and not isinstance(optimizer, torch.optim.LBFGS):
            with _closure_first(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside accumulate locally (``model.no_sync()``)."""
        if isinstance(self.model, unison.DataParallel):
            with self.model.no_sync():
                yield None
        else:
            with super().block_backward_sync():
                yield None

    # Evaluation runs on the LightningModule itself, not through the wrapper's forward:
    # those forwards are not training steps (no algorithm event, no heartbeat step).
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # ---- events of the loops (called by _UnisonHooks) -----------------------------
    def _drifting(self) -> bool:
        return (
            isinstance(self.model, unison.DataParallel) and self.model.algorithm.replicas_drift and self.world_size > 1
        )

    def _before_validation(self, trainer: "pl.Trainer") -> None:
        model = self.model
        if not isinstance(model, unison.DataParallel):
            return
        if self.average_before_eval and self._drifting() and not trainer.sanity_checking:
            model.average()
        else:
            model.flush()  # pending updates (nonblocking, diloco's overlap) land before evaluating

    def _end_epoch(self, trainer: "pl.Trainer") -> None:
        model = self.model
        if isinstance(model, unison.DataParallel):
            model.end_epoch(self._logged_epoch_loss(trainer))

    def _logged_epoch_loss(self, trainer: "pl.Trainer") -> Optional[float]:
        names = [self.epoch_loss] if self.epoch_loss else ["train_loss", "loss"]
        metrics = trainer.callback_metrics
        for name in names:
            for key in (f"{name}_epoch", name):
                value = metrics.get(key)
                if value is not None:
                    return float(value)
        alg = self.algorithm
        uses_loss = getattr(type(alg), "end_epoch", None) is not getattr(algorithms.Algorithm, "end_epoch", None)
        if uses_loss and not self._warned_no_loss:
            self._warned_no_loss = True
            rank_zero_warn(
                f"unison algorithm {alg.name!r} uses the epoch's loss, but none of {names} was logged with on_epoch=True "
                "in training_step; it gets None. Log it (self.log('train_loss', loss, on_epoch=True)) or name the "
                "metric with UnisonStrategy(..., epoch_loss=NAME)."
            )
        return None

    def _end_training(self) -> None:
        """After the last step: every rank takes the average of the replicas (when they drift)."""
        model = self.model
        if not isinstance(model, unison.DataParallel) or self._final_average_done:
            return
        if self._drifting():
            model.average()
        else:
            model.flush()
        self._final_average_done = True

    # ---- checkpoints ---------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights a checkpoint publishes: with drifting replicas, their average
        (a collective, as saving is: every rank calls it); the replicas are left as they are."""
        model = self.model
        if not isinstance(model, unison.DataParallel):
            return super().lightning_module_state_dict()
        model.flush()
        module = self.lightning_module
        assert module is not None
        state = module.state_dict()
        if self._drifting():
            state = _averaged(state, module)
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Add unison's part (every rank's algorithm state and RNG states, and with drifting
        replicas each rank's weights and optimizer states) and let rank 0 write the file."""
        model = self.model
        if isinstance(model, unison.DataParallel) and "optimizer_states" in checkpoint:  # not weights-only
            entry = to_cpu(self._rank_entry(model))
            if self.world_size > 1:
                gathered: Optional[list] = gather_objects(entry)
            else:
                gathered = [entry]
            if self.global_rank == 0:
                alg = model.algorithm
                checkpoint[CHECKPOINT_KEY] = {
                    "version": _CHECKPOINT_VERSION,
                    "world_size": self.world_size,
                    "algorithm": {"name": alg.name, "options": dict(alg.options), "describe": alg.describe()},
                    "ranks": gathered,
                }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _rank_entry(self, model: "unison.DataParallel") -> dict[str, Any]:
        state = model.state_dict()  # the module's weights plus the algorithm's state
        entry: dict[str, Any] = {"algorithm": state.pop(ALGORITHM_KEY, None), "rng": rng_states()}
        if self._drifting():
            entry["model"] = state
            entry["optimizers"] = [opt.state_dict() for opt in self.optimizers]
        return entry

    def _unison_entry(self, checkpoint: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """This rank's entry of unison's part of ``checkpoint`` (rank 0's if the world size changed)."""
        part = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(self.model, unison.DataParallel) or not part:
            return None
        if part.get("version") != _CHECKPOINT_VERSION:
            raise ValueError(
                f"this checkpoint's unison part has version {part.get('version')!r}; this unison reads {_CHECKPOINT_VERSION}"
            )
        entry, same_world = entry_for_rank(part["ranks"], self.global_rank, self.world_size)
        if same_world:
            return entry
        return {**entry, "model": None, "optimizers": None, "rng": None, "resized": True}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Restore each rank's own replica, the algorithm that was running and its state."""
        entry = self._unison_entry(checkpoint)
        if entry is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        model = self.model
        assert isinstance(model, unison.DataParallel)
        part = checkpoint[CHECKPOINT_KEY]
        saved = part["algorithm"]
        if saved["describe"] != model.algorithm.describe():
            rank_zero_info(
                f"unison: resuming with algorithm {saved['describe']}, which was running when the checkpoint was saved"
            )
            model.switch_to(algorithms.create(saved["name"], **saved["options"]))
        if entry.get("resized"):
            rank_zero_warn(
                f"the checkpoint was saved by {part['world_size']} ranks and is loaded by {self.world_size}: every rank "
                "takes the averaged weights and rank 0's optimizer and algorithm states; training resumes, but not along "
                "the saved trajectory"
            )
        state = dict(entry.get("model") or checkpoint["state_dict"])
        if entry.get("algorithm") is not None:
            state[ALGORITHM_KEY] = entry["algorithm"]
        model.load_state_dict(state, strict=strict)
        if entry.get("rng") is not None:  # Lightning isolates the sanity check's draws: the next are training's
            set_rng_states(entry["rng"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each rank takes its own optimizer states when the replicas drift, else the shared ones."""
        entry = self._unison_entry(checkpoint)
        states = (entry or {}).get("optimizers") or checkpoint["optimizer_states"]
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)
        _optimizers_to(self.optimizers, self.root_device)

    # ---- the end ----------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not start a collective the other ranks may never join
        super().on_exception(exception)

    def teardown(self) -> None:
        """Average what still drifts (a ``fit`` that ran no epoch), release the wrapper's hooks
        and threads, and hand the LightningModule back."""
        model = self.model
        if isinstance(model, unison.DataParallel):
            if not self._failed:
                self._end_training()
            model.close()  # removes unison's hooks from the module and optimizers, stops the algorithm's threads
            self._last_algorithm = model.algorithm
            self.model = self.lightning_module
        if self._hooks is not None:
            if self._hooks_trainer is not None:
                self._hooks_trainer.callbacks[:] = [cb for cb in self._hooks_trainer.callbacks if cb is not self._hooks]  # type: ignore[attr-defined]
            self._hooks = None
            self._hooks_trainer = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers nothing (DDPStrategy's names stay DDPStrategy's); build it with UnisonStrategy(...)."""


class _UnisonHooks(Callback):
    """The strategy's reactions to Lightning's loop events, placed before the user's callbacks."""

    def __init__(self, strategy: UnisonStrategy) -> None:
        self.strategy = strategy

    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.strategy._before_validation(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.strategy._end_epoch(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.strategy._end_training()


# ---- helpers ----------------------------------------------------------------------------
@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then put back what was there."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _closure_first(optimizer: Optimizer) -> Iterator[None]:
    """While inside, ``optimizer.step(closure)`` runs the closure, then ``step()`` without it."""
    step = optimizer.step
    own = "step" in vars(optimizer)  # an LR scheduler or an algorithm may have wrapped it already

    def closure_first_step(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        step(**kwargs)
        return result

    optimizer.step = closure_first_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        if vars(optimizer).get("step") is closure_first_step:  # unless something replaced it meanwhile
            if own:
                optimizer.step = step  # type: ignore[method-assign]
            else:
                del optimizer.step


def _broadcast_module(module: nn.Module) -> None:
    """Set every rank's parameters and buffers to rank 0's."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    default_broadcast(list(module.parameters()) + list(module.buffers()), None)


def _averaged(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A copy of ``state`` with the floating-point parameters averaged over the ranks and
    everything else rank 0's (what ``model.average()`` makes of the replicas)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    out = type(state)((name, v.detach().clone() if isinstance(v, Tensor) else v) for name, v in state.items())
    torch_private.copy_state_metadata(state, out)
    tensors = [(name, v) for name, v in out.items() if isinstance(v, Tensor)]
    mean = [v for name, v in tensors if name in params and v.is_floating_point()]
    first = [v for name, v in tensors if not (name in params and v.is_floating_point())]
    if mean:
        average_(mean, None)
    if first:
        default_broadcast(first, None)
    return out


def _optimizers_to(optimizers: list[Optimizer], device: torch.device) -> None:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device)
