"""PyTorch Lightning: every unison algorithm behind the Trainer.

python examples/lightning_classifier.py --algorithm local_sgd --max-epochs 5

Lightning starts the second process itself (torchrun and SLURM work too, and UNISON_NODES).
Needs the lightning extra: pip install -e ".[lightning]". See docs/lightning.md.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from unison.integrations.lightning import UnisonStrategy


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True)  # the epoch's loss also feeds DASO's schedule
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def dataset(n, seed):
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4:8].sum(1) > 0).long())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="local_sgd")
    parser.add_argument("--max-epochs", type=int, default=5)
    args = parser.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=UnisonStrategy(args.algorithm),
        accelerator="cpu",
        devices=2,
        max_epochs=args.max_epochs,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    model = Classifier()
    train = DataLoader(dataset(2048, 1), batch_size=32, shuffle=True)
    trainer.fit(model, train, DataLoader(dataset(512, 2), batch_size=64))
    print(f"rank {trainer.global_rank}: first weight {model.net[0].weight[0, 0].item():.6f}")  # the same on every rank
