"""Lightning runs for tests/test_lightning.py, on 2 CPU processes.

    python lightning_run.py OUTDIR main   # Lightning's own launcher starts rank 1; many fits, one process group
    python lightning_run.py OUTDIR fail   # launched torchrun-style by the test: rank 1 dies at step 3

Each rank writes OUTDIR/<mode>-<rank>.pt: per scenario, its flat weights and
what the checks need; the test compares them across ranks and scenarios.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import unison
from unison.integrations.lightning import UnisonStrategy

torch.set_num_threads(1)

EPOCHS = 3
# Options that make every algorithm act within a few steps (8 optimizer steps per epoch
# here), and let model-averaging replicas drift apart at validation time.
OPTIONS = {
    "async": "async:sync_interval_ms=5",
    "bytegrad": "bytegrad:error_feedback=True",
    "daso": "daso:warmup_epochs=1,cooldown_epochs=0",
    "decentralized": "decentralized:communication_interval=3",
    "diloco": "diloco:inner_steps=5",
    "local_sgd": "local_sgd:period=5",
    "low_precision_decentralized": "low_precision_decentralized:communication_interval=3",
    "powersgd": "powersgd:rank=1,start_iter=2",
    "sparseloco": "sparseloco:period=5,tile=16",
}
RESUMED = (
    "allreduce",
    "local_sgd",
    "diloco",
    "powersgd",
    "bytegrad",
    "daso",
    "decentralized",
    "nonblocking",
    "sparseloco",
    "demo",
)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long()
    return TensorDataset(x, y)


TRAIN, VAL = data(256, 1), data(64, 2)


class Net(L.LightningModule):
    """A small MLP with BatchNorm (buffers) and Dropout (RNG)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(32, 4),
        )
        self.optimizer = optimizer
        self.val_weights: list[torch.Tensor] = []
        self.epoch_losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0 and not self.trainer.sanity_checking:
            self.val_weights.append(flat(self))  # the weights validation sees
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer == "qadam":
            return unison.QAdamOptimizer(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TRAIN, batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(VAL, batch_size=32)


class ManualNet(Net):
    """The same training with manual optimization (backward and step inside training_step)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in module.state_dict().values()]).clone()


class Switch(L.Callback):
    """Switch algorithm at the start of an epoch, on every rank."""

    def __init__(self, epoch: int, to: str) -> None:
        self.epoch, self.to = epoch, to

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.strategy.switch_to(self.to)


class EndEpochSpy(L.Callback):
    """Records what the strategy passes to model.end_epoch (and still calls it)."""

    def __init__(self) -> None:
        self.losses: list = []

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model
        real = model.end_epoch

        def end_epoch(loss=None):
            self.losses.append(loss)
            real(loss)

        model.end_epoch = end_epoch


class CommStats(L.Callback):
    """What the unison wrapper sent during fit (its public comm_stats)."""

    def on_train_end(self, trainer, pl_module):
        self.stats = dict(trainer.strategy.model.comm_stats)


def trainer(strategy, epochs: int = EPOCHS, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        **kwargs,
    )


def fit(
    strategy,
    *,
    init: int = 0,
    optimizer: str = "sgd",
    epochs: int = EPOCHS,
    ckpt_path=None,
    manual: bool = False,
    **kwargs,
) -> tuple[Net, L.Trainer]:
    L.seed_everything(0, verbose=False)  # also the seed of the data order (DistributedSampler)
    torch.manual_seed(init)
    model = ManualNet() if manual else Net(optimizer)
    t = trainer(strategy, epochs, **kwargs)
    t.fit(model, ckpt_path=ckpt_path)
    return model, t


def unison_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("unison") and t.name != "unison-heartbeat")


def main(outdir: str) -> dict:
    results: dict = {}
    # First a unison fit: Lightning launches rank 1 here, and unison.init() starts the group.
    stats = CommStats()
    model, t = fit(UnisonStrategy("allreduce"), callbacks=[stats])
    results["parity"] = {
        "weights": flat(model),
        "nodes": unison.topology().num_nodes,
        "bytes": stats.stats["bytes_total"],
    }
    stats = CommStats()
    model, _ = fit(UnisonStrategy("allreduce"), accumulate_grad_batches=3, callbacks=[stats])
    results["allreduce_accumulate"] = {"weights": flat(model), "bytes": stats.stats["bytes_total"]}
    model, _ = fit(UnisonStrategy("allreduce"), manual=True)
    results["manual"] = {"weights": flat(model)}
    model, _ = fit(DDPStrategy())
    results["ddp"] = {"weights": flat(model)}
    model, _ = fit(DDPStrategy(), accumulate_grad_batches=3)
    results["ddp_accumulate"] = {"weights": flat(model)}

    # Every algorithm, with a checkpoint after each epoch; then resume some from epoch 1.
    for name in unison.algorithms.names():
        spec = OPTIONS.get(name, name)
        ckpt = ModelCheckpoint(dirpath=os.path.join(outdir, "ckpt", name), save_top_k=-1, save_on_train_epoch_end=True)
        spy = EndEpochSpy()
        model, t = fit(
            UnisonStrategy(spec),
            optimizer="qadam" if name == "qadam" else "sgd",
            callbacks=[ckpt, spy],
            enable_checkpointing=True,
        )
        results[name] = {
            "weights": flat(model),
            "val_weights": model.val_weights,
            "epoch_losses": model.epoch_losses,
            "end_epoch": spy.losses,
            "threads": unison_threads(),
            "algorithm": t.strategy.algorithm.name,
        }
    for name in RESUMED:
        path = os.path.join(outdir, "ckpt", name, "epoch=0-step=8.ckpt")
        model, _ = fit(UnisonStrategy(OPTIONS.get(name, name)), init=1, ckpt_path=path)
        results[f"{name}_resumed"] = {"weights": flat(model), "val_weights": model.val_weights}
    # The last checkpoint publishes the averaged replicas; validating from it works on every rank.
    path = os.path.join(outdir, "ckpt", "local_sgd", "epoch=2-step=24.ckpt")
    ckpt = torch.load(path, weights_only=True)
    L.seed_everything(0, verbose=False)
    model = Net()
    metrics = trainer(UnisonStrategy("local_sgd")).validate(model, ckpt_path=path, verbose=False)
    results["local_sgd_checkpoint"] = {
        "state_dict": flat_state(ckpt["state_dict"]),
        "unison_ranks": len(ckpt["unison"]["ranks"]),
        "validated": flat(model),
        "val_loss": metrics[0]["val_loss"],
    }

    # Drifting replicas validated without averaging: each rank sees its own.
    model, _ = fit(UnisonStrategy("local_sgd:period=100", average_before_eval=False))
    results["local_sgd_local_eval"] = {"val_weights": model.val_weights, "weights": flat(model)}

    # Switch from a callback; the resumed algorithm is the one the checkpoint was saved with.
    ckpt = ModelCheckpoint(dirpath=os.path.join(outdir, "ckpt", "switch"), save_top_k=-1, save_on_train_epoch_end=True)
    model, t = fit(
        UnisonStrategy("local_sgd:period=100"),
        callbacks=[Switch(1, "diloco:inner_steps=3"), ckpt],
        enable_checkpointing=True,
    )
    results["switch"] = {"weights": flat(model), "algorithm": t.strategy.algorithm.describe()}
    model, t = fit(
        UnisonStrategy("local_sgd:period=100"),
        init=1,
        ckpt_path=os.path.join(outdir, "ckpt", "switch", "epoch=1-step=16.ckpt"),
    )
    results["switch_resumed"] = {"weights": flat(model), "algorithm": t.strategy.algorithm.describe()}
    return results


def flat_state(state: dict) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in state.values()])


class DieAt(L.Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(3)


def fail(outdir: str) -> dict:
    try:
        fit(UnisonStrategy("allreduce", timeout=30), callbacks=[DieAt(1, 3)])
    except unison.RankFailure as exc:
        return {"raised": "RankFailure", "ranks": list(exc.ranks), "message": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the test reports what else came
        return {"raised": type(exc).__name__, "message": traceback.format_exc()}
    return {"raised": None}


if __name__ == "__main__":
    outdir, mode = sys.argv[1], sys.argv[2]
    result = {"main": main, "fail": fail}[mode](outdir)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("LOCAL_RANK", 0))
    torch.save(result, os.path.join(outdir, f"{mode}-{rank}.pt"))
    unison.shutdown()
