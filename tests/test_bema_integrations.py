"""The Lightning callback and the Accelerate helper keep a BEMA when asked
(``ema_class=BEMA``): its keywords checked up front, one update per optimizer step, and
the numbers of a BEMA driven by hand."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from emakit import BEMA, EMATypeError

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)
BEMA_KW: dict[str, Any] = {"update_freq": 2, "lag": 10}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(6, 4, generator=g) for _ in range(n)]
    return [(x, x.sum(1, keepdim=True)) for x in xs]


@pytest.fixture
def accelerator() -> Iterator[Any]:
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    yield acc
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def test_prepare_ema_builds_a_bema(accelerator: Any):
    from emakit.integrations.accelerate import AcceleratedBEMA, prepare_ema

    model = make_model()
    reference_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    bema = prepare_ema(accelerator, model, ema_class=BEMA, **BEMA_KW)
    assert isinstance(bema, AcceleratedBEMA)
    reference = BEMA(reference_model, **BEMA_KW)
    for x, y in data(8):  # 8 micro-batches, 4 optimizer steps
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            bema.update()
            if accelerator.sync_gradients:
                reference_model.load_state_dict(accelerator.unwrap_model(model).state_dict())
                reference.update()
    assert int(bema.step) == 4
    ours, theirs = bema.state_dict(), reference.state_dict()
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    with pytest.raises(EMATypeError, match="beta"):
        prepare_ema(accelerator, model, ema_class=BEMA, beta=0.9)
    with pytest.raises(EMATypeError, match="ema_class"):
        prepare_ema(accelerator, model, ema_class=int)


def test_lightning_callback_keeps_a_bema():
    pl = pytest.importorskip("lightning.pytorch")
    from emakit.integrations.lightning import EMACallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    xs, ys = zip(*data(6), strict=True)
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=6)
    cb = EMACallback(ema_class=BEMA, **BEMA_KW)
    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb],
        )
        trainer.fit(module, loader)
    assert isinstance(cb.ema, BEMA)
    assert int(cb.ema.step) == 6
    assert cb.ema.tracker.last == 6  # the third BEMA update (update_freq=2)
    with pytest.raises(EMATypeError, match="beta"):
        EMACallback(ema_class=BEMA, beta=0.9)
