"""Lightning: an EMA of the LightningModule, validated on the EMA weights, saved in checkpoints.

``EMACallback`` updates the EMA once per optimizer step (here with gradient accumulation
over 2 batches), runs validation on the EMA weights (by swapping them in, no copy), and
stores the EMA in the Lightning checkpoint, from which a resumed ``fit`` continues exactly.

    pip install -e ".[lightning]"
    python examples/lightning_ema.py --epochs 3
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from emakit.integrations.lightning import EMACallback


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, prog_bar=True)  # computed on the EMA weights

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def loaders(seed: int = 0) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=g) * 1.5
    y = torch.randint(0, 4, (1200,), generator=g)
    x = centers[y] + torch.randn(1200, 16, generator=g) * 1.8
    train = TensorDataset(x[:1000], y[:1000])
    val = TensorDataset(x[1000:], y[1000:])
    return DataLoader(train, batch_size=32, shuffle=True, generator=g), DataLoader(val, 200)


def trainer(epochs: int, callback: EMACallback, root: Path) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accumulate_grad_batches=2,  # one EMA update per optimizer step, not per batch
        callbacks=[callback],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and noise)
    pl.seed_everything(0, verbose=False)
    train, val = loaders()
    model = Classifier()
    ema_cb = EMACallback(beta=0.99, update_after_step=10, update_every=1)
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(args.epochs, ema_cb, Path(tmp))
        t.fit(model, train, val)
        ema_acc = float(t.callback_metrics["val_acc"])
        ckpt = Path(tmp) / "last.ckpt"
        t.save_checkpoint(ckpt)  # the EMA is saved under checkpoint["emakit_ema"]
        saved = torch.load(ckpt, weights_only=True)  # tensors and containers only
    # the raw weights, evaluated without the callback
    x, y = val.dataset.tensors
    with torch.no_grad():
        online_acc = float((model(x).argmax(1) == y).float().mean())
    print(f"optimizer steps: {ema_cb.ema.step.item()} (batches / 2)")
    print(f"validation accuracy: online weights {online_acc:.3f}, EMA weights {ema_acc:.3f}")
    print(f"checkpoint keys with the EMA: {[k for k in saved if 'ema' in k]}")
    return {"online": online_acc, "ema": ema_acc}


if __name__ == "__main__":
    main()
