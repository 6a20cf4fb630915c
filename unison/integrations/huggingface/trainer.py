"""transformers: ``UnisonTrainer(..., algorithm="diloco")`` is a ``transformers.Trainer`` that trains
with :class:`unison.DataParallel` and any unison algorithm, where the Trainer would use torch's DDP.

The Trainer builds its ``Accelerator``; the mixin makes it a ``UnisonAccelerator`` (so
``prepare(model, optimizer)`` wraps the model in unison's wrapper) and adds what a unison run needs
of the Trainer: the bytes unison sent since the last log beside the loss (``unison_bytes_sent``),
drifting replicas averaged before each evaluation and at the end of training, and checkpoints
(``save_steps``) that carry each rank's algorithm state (and with drifting replicas each rank's
weights and optimizer state), put back by ``resume_from_checkpoint``. The manual is
docs/huggingface.md.
"""

from __future__ import annotations

from typing import Any, Optional, Union

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'unison.integrations.huggingface needs transformers: pip install "unison[hf]" '
        f'(or pip install "transformers>=5.0" "accelerate>=1.10") [{exc}]'
    ) from exc

from ... import algorithms
from ...parallel import DataParallel
from . import rank_state
from .accelerator import UnisonAccelerator, checked

__all__ = ["UnisonTrainer", "UnisonTrainerMixin"]


class UnisonTrainerMixin:
    """Put it before a ``transformers.Trainer`` class (TRL's trainers included) to train with
    unison: ``class MyTrainer(UnisonTrainerMixin, SFTTrainer)``. ``UnisonTrainer`` is it over
    ``Trainer``.

    Args:
        algorithm: a unison algorithm: a name with options (``"diloco:period=50"``) or an instance;
            refused at once when unknown.
        dataparallel_kwargs: more arguments of ``unison.DataParallel`` (``bucket_cap_mb``,
            ``nonfinite``, ...). The Trainer's ``ddp_*`` arguments are passed too.
        average_before_eval: with an algorithm whose replicas drift (model averaging), average
            them before each evaluation (a collective: every process evaluates, as the Trainer does).
        *args, **kwargs: the Trainer's own.
    """

    def __init__(
        self,
        *args: Any,
        algorithm: Union[str, algorithms.Algorithm[Any]] = "allreduce",
        dataparallel_kwargs: Optional[dict[str, Any]] = None,
        average_before_eval: bool = True,
        **kwargs: Any,
    ) -> None:
        # Before the Trainer's constructor, which builds the accelerator (create_accelerator_and_postprocess).
        self.unison_algorithm = checked(algorithm, dataparallel_kwargs)
        self.unison_kwargs = dict(dataparallel_kwargs or {})
        self.average_before_eval = bool(average_before_eval)
        self._unison_logged = 0
        super().__init__(*args, **kwargs)
        self.add_callback(_EndOfTraining(self))  # type: ignore[attr-defined]

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, made a ``UnisonAccelerator`` before anything is prepared."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        UnisonAccelerator.adopt(self.accelerator, self.unison_algorithm, self.unison_kwargs)  # type: ignore[attr-defined]

    @property
    def unison_model(self) -> Optional[DataParallel]:
        """The ``unison.DataParallel`` training the model (None before ``train`` or in one process)."""
        accelerator = getattr(self, "accelerator", None)
        return accelerator.unison_model if isinstance(accelerator, UnisonAccelerator) else None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with ``unison_bytes_sent`` (by this process since the last training
        log) beside the training loss."""
        model = self.unison_model
        if model is not None and "loss" in logs:
            sent = int(model.comm_stats["bytes_total"])
            logs["unison_bytes_sent"] = sent - self._unison_logged
            self._unison_logged = sent
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's evaluation, of averaged replicas when they drift (``average_before_eval``)."""
        model = self.unison_model
        if self.average_before_eval and model is not None and model.algorithm.replicas_drift:
            model.average()
        return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    # ---- checkpoints ----------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        model = self.unison_model
        if model is not None:
            rank_state.save(output_dir, model, self.accelerator.torch_optimizers())  # type: ignore[attr-defined]

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        model = self.unison_model
        if model is not None and checkpoint is not None:
            rank_state.load(checkpoint, model, self.accelerator.torch_optimizers())  # type: ignore[attr-defined]


class UnisonTrainer(UnisonTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with ``unison.DataParallel`` and ``algorithm``.

    Example::

        trainer = UnisonTrainer(model=model, args=TrainingArguments("out", use_cpu=True),
                                train_dataset=data, algorithm="diloco:period=20")
        trainer.train()                       # torchrun --nproc-per-node 2 train.py
    """


class _EndOfTraining(TrainerCallback):
    """Averages drifting replicas when training ends, so that the saved model is their average."""

    def __init__(self, trainer: UnisonTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.unison_model
        if model is not None and model.algorithm.replicas_drift:
            model.average()
