"""``emakit.compat.lightning.EMAWeightAveraging`` against Lightning's own callback, with a
real ``Trainer`` on CPU: the same updates and validation weights to float32 rounding
(Lightning computes ``decay * ema + (1 - decay) * w``, emakit ``lerp_``), the average left
in the module after fit, Lightning's checkpoint entries, and resumes from one callback's
checkpoint under the other. Also ``load_foreign_state`` on those checkpoints."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import EMAWeightAveraging as Theirs  # noqa: E402

from emakit import EMA, EMAStateError, EMATypeError, load_foreign_state  # noqa: E402
from emakit.compat.lightning import EMAWeightAveraging as Ours  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)
#: Per tensor, |ours - theirs| within this many float32 epsilons of its largest |value|.
ROUNDING_EPS = 4
#: Lightning averages the integer counter in float and truncates; emakit copies it.
INTEGER_BUFFERS = {"net.1.num_batches_tracked"}


class Regressor(pl.LightningModule):
    """Linear -> BatchNorm -> Tanh -> Linear; records the weights each validation saw."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.validated: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(self.net[0].weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


g = torch.Generator().manual_seed(0)
X = torch.randn(32, 4, generator=g)
Y = X.sum(1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)


def loader(n: int = 32) -> DataLoader:
    return DataLoader(TensorDataset(X[:n], Y[:n]), batch_size=8)  # 4 batches, fixed order


class Recorder(pl.Callback):
    """The module's floating tensors (float64) after every step and epoch, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict[str, Tensor]]] = []

    def _record(self, kind: str, index: int, module: pl.LightningModule) -> None:
        state = {k: v.double().clone() for k, v in module.state_dict().items()}
        self.events.append(
            (kind, index, {k: v for k, v in state.items() if k not in INTEGER_BUFFERS})
        )

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        self._record("step", trainer.global_step, module)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        self._record("epoch", trainer.current_epoch, module)


def exact_average(recorder: Recorder, settings: dict[str, Any]) -> dict[str, Tensor]:
    """The EMA in float64 of what ``recorder`` saw, at the updates Lightning's rule makes."""
    rule, decay = Theirs(**settings), settings.get("decay", 0.999)
    last_step, last_epoch, average = 0, -1, None
    for kind, i, state in recorder.events:
        if kind == "step" and i > last_step and rule.should_update(step_idx=i - 1):
            last_step = i
        elif kind == "epoch" and i > last_epoch and rule.should_update(epoch_idx=i):
            last_epoch = i
        else:
            continue
        if average is None:
            average = state
            continue
        for name, t in state.items():
            averaged = settings.get("use_buffers", True) or "running" not in name
            average[name] = decay * average[name] + (1 - decay) * t if averaged else t
    assert average is not None
    return average


def fit(
    callback: pl.Callback,
    max_epochs: int,
    *,
    ckpt_path: Path | None = None,
    save_dir: Path | None = None,
    recorder: Recorder | None = None,
) -> Regressor:
    module = Regressor()
    callbacks = [callback] if recorder is None else [recorder, callback]
    if save_dir is not None:  # a checkpoint at the end of every training epoch
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=save_dir, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(), loader(16), ckpt_path=ckpt_path)
    return module


def rounding_ratio(theirs: dict[str, Tensor], ours: dict[str, Tensor]) -> float:
    """The largest per-tensor |difference| over ``eps32 * max |value|`` (integer buffers
    left out); ``theirs`` may be a float64 reference."""
    assert theirs.keys() <= ours.keys()
    ratio = 0.0
    for name, a in theirs.items():
        b = ours[name]
        assert a.shape == b.shape and (a.dtype == b.dtype or a.dtype == torch.float64), name
        if name in INTEGER_BUFFERS:
            continue
        a, b = a.double(), b.double()
        diff = (a - b).abs().max().item()
        scale = torch.finfo(torch.float32).eps * max(a.abs().max().item(), b.abs().max().item())
        ratio = max(ratio, diff / scale if diff else 0.0)
    return ratio


SETTINGS = [
    {},
    {"decay": 0.9, "update_every_n_steps": 2, "update_starting_at_step": 3},
    {"decay": 0.8, "update_every_n_steps": 0, "update_starting_at_epoch": 1},
    {"decay": 0.9, "use_buffers": False},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s.items())))
def test_fit_same_average_and_validation_weights_as_lightning(settings):
    theirs_cb, ours_cb = Theirs(**settings), Ours(**settings)
    their_run, our_run = Recorder(), Recorder()
    theirs = fit(theirs_cb, 3, recorder=their_run)
    ours = fit(ours_cb, 3, recorder=our_run)
    # after fit the module holds the average, as Lightning leaves it: to rounding, and at
    # least as close as Lightning's to the exact (float64) EMA of the same training run
    assert rounding_ratio(theirs.state_dict(), ours.state_dict()) <= 2 * ROUNDING_EPS
    ours_off = rounding_ratio(exact_average(our_run, settings), ours.state_dict())
    theirs_off = rounding_ratio(exact_average(their_run, settings), theirs.state_dict())
    assert ours_off <= min(theirs_off, 2.0), (ours_off, theirs_off)
    assert not torch.equal(ours.net[0].weight, Regressor().net[0].weight)  # it trained
    assert ours_cb.ema is not None
    assert int(ours_cb.ema.step) == int(theirs_cb._average_model.n_averaged) > 0
    # every validation ran on the average of its time
    assert len(ours.validated) == len(theirs.validated) == 6  # 3 epochs, 2 batches
    for a, b in zip(theirs.validated, ours.validated, strict=True):
        assert rounding_ratio({"w": a}, {"w": b}) <= 2 * ROUNDING_EPS
    raw = [
        state["net.0.weight"] for kind, i, state in our_run.events if kind == "step" and i % 4 == 0
    ]
    for seen, weights in zip(ours.validated[::2], raw, strict=True):
        assert not torch.equal(seen.double(), weights)  # the average, not the raw weights


def test_signature_and_defaults_match_lightning():
    import inspect

    theirs = inspect.signature(Theirs.__init__).parameters
    ours = inspect.signature(Ours.__init__).parameters
    for name, p in theirs.items():
        assert name in ours and ours[name].default == p.default, name
    assert list(ours)[: len(theirs) - 1] == list(theirs)[:-1]  # same order, **kwargs last
    assert Ours().state_key == Theirs().state_key  # the callback state lands in one slot
    for step in range(12):
        for epoch in (None, 0, 2):
            kw = {"update_every_n_steps": 3, "update_starting_at_step": 4}
            kw_epoch = {"update_starting_at_epoch": 1}
            for settings in ({}, kw, kw_epoch):
                assert Ours(**settings).should_update(step, epoch) == Theirs(
                    **settings
                ).should_update(step, epoch)


def test_checkpoint_entries_are_lightnings(tmp_path):
    callback = Ours(decay=0.9)
    fit(callback, 2, save_dir=tmp_path)
    ckpt = torch.load(tmp_path / "epoch=1-step=8.ckpt", weights_only=False)
    assert ckpt["averaging_state"].keys() == {"n_averaged"}
    assert int(ckpt["averaging_state"]["n_averaged"]) == 8
    assert ckpt["callbacks"]["EMAWeightAveraging"] == {"latest_update_step": 8}
    assert ckpt["state_dict"].keys() == ckpt["current_model_state"].keys()
    assert not torch.equal(
        ckpt["state_dict"]["net.0.weight"], ckpt["current_model_state"]["net.0.weight"]
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [(Theirs, Ours), (Ours, Theirs), (Ours, Ours)],
    ids=["L->O", "O->L", "O->O"],
)
def test_resume_from_the_other_callbacks_checkpoint(tmp_path, first, second):
    """Two epochs under ``first``, a checkpoint, two more under ``second``: the same
    training weights and (to rounding) the same average as four epochs in one go."""
    fit(first(decay=0.9), 2, save_dir=tmp_path / "a")
    ckpt = tmp_path / "a" / "epoch=1-step=8.ckpt"
    resumed = fit(second(decay=0.9), 4, ckpt_path=ckpt, save_dir=tmp_path / "b")
    whole = fit(second(decay=0.9), 4, save_dir=tmp_path / "c")  # uninterrupted
    # the average went on: to rounding, and bit for bit when emakit wrote and reads it
    assert rounding_ratio(whole.state_dict(), resumed.state_dict()) <= ROUNDING_EPS
    if first is second:
        for name, t in whole.state_dict().items():
            assert torch.equal(t, resumed.state_dict()[name]), name
    final = torch.load(tmp_path / "b" / "epoch=3-step=16.ckpt", weights_only=False)
    reference = torch.load(tmp_path / "c" / "epoch=3-step=16.ckpt", weights_only=False)
    assert int(final["averaging_state"]["n_averaged"]) == 16  # the count went on
    assert final["callbacks"]["EMAWeightAveraging"] == {"latest_update_step": 16}
    # and the training weights came back from current_model_state, not from the average
    for name, t in reference["current_model_state"].items():
        assert torch.equal(t, final["current_model_state"][name]), name


def test_load_foreign_state_reads_lightning_checkpoints(tmp_path):
    theirs = Theirs(decay=0.9)
    fit(theirs, 2, save_dir=tmp_path)
    path = tmp_path / "epoch=1-step=8.ckpt"
    ckpt = torch.load(path, weights_only=False)
    ema = EMA(Regressor(), update_after_step=0, update_every=1)
    assert load_foreign_state(ema, ckpt) == "lightning"
    assert int(ema.step) == 8  # from averaging_state, not 0
    for name, t in ema.ema_model.state_dict().items():
        assert torch.equal(t, ckpt["state_dict"][name]), name
    from_path = EMA(Regressor(), update_after_step=0, update_every=1)  # the file itself
    assert load_foreign_state(from_path, path) == "lightning" and int(from_path.step) == 8
    # a plain state dict: refused without step=, since the next update would copy over
    fresh = EMA(Regressor(), update_after_step=0, update_every=1)
    with pytest.raises(EMAStateError, match=r"step=.*global_step.*whole checkpoint"):
        load_foreign_state(fresh, ckpt["state_dict"])
    assert int(fresh.step) == 0
    load_foreign_state(fresh, ckpt["state_dict"], step=ckpt["global_step"])
    assert int(fresh.step) == 8
    # a Lightning checkpoint with no average in it says so
    plain = {k: v for k, v in ckpt.items() if k not in ("averaging_state", "current_model_state")}
    with pytest.raises(EMAStateError, match=r"without weight averaging.*global_step"):
        load_foreign_state(EMA(Regressor()), plain)


def test_bad_arguments_raise():
    with pytest.raises(EMATypeError, match="avg_fn"):
        Ours(avg_fn=lambda a, b, n: a)
    with pytest.raises(ValueError, match="decay"):
        Ours(decay=1.5)
    with pytest.raises(ValueError, match="update_every_n_steps"):
        Ours(update_every_n_steps=-1)


def test_fit_with_an_exception_in_validation_leaves_the_training_weights():
    class Failing(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            super().validation_step(batch, batch_idx)  # records the weights it saw
            raise RuntimeError("boom")

    module = Failing()
    callback = Ours(decay=0.9)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[callback],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, loader(), loader(16))
    assert callback.ema is not None
    average = callback.ema.ema_model.net[0].weight
    assert torch.equal(module.validated[-1], average)  # validation saw the average
    assert not torch.equal(module.net[0].weight, average)  # and the training weights are back
