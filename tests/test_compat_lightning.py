"""``emakit.compat.lightning.EMAWeightAveraging`` against Lightning's own callback, with a
real ``Trainer`` on CPU: the same updates and validation weights to float32 rounding
(Lightning computes ``decay * ema + (1 - decay) * w``, emakit ``lerp_``), the average left
in the module after fit, Lightning's checkpoint entries, and resumes from one callback's
checkpoint under the other. Also ``load_foreign_state`` on those checkpoints."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
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


#: Each argument refused, with its message: the argument's name, what it must be, the value.
REFUSED = [
    ({"use_buffers": 1}, "use_buffers must be True or False, got use_buffers=1 (int)"),
    ({"decay": -0.5}, "decay must be a finite number in [0, 1], got decay=-0.5"),
    ({"decay": 1.5}, "decay must be a finite number in [0, 1], got decay=1.5"),
    (
        {"update_every_n_steps": -1},
        "update_every_n_steps must be >= 0, got update_every_n_steps=-1",
    ),
    (
        {"update_starting_at_step": -1},
        "update_starting_at_step must be >= 0, got update_starting_at_step=-1",
    ),
    (
        {"update_starting_at_epoch": -1},
        "update_starting_at_epoch must be >= 0, got update_starting_at_epoch=-1",
    ),
    (
        {"ema_dtype": torch.int64},
        "ema_dtype must be a floating torch.dtype such as torch.float32, got ema_dtype=torch.int64",
    ),
    ({"skip_nonfinite": 1}, "skip_nonfinite must be True or False, got skip_nonfinite=1 (int)"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED, ids=lambda v: str(v)[:40])
def test_each_bad_argument_is_refused_naming_it(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as caught:
        Ours(**kwargs)
    assert str(caught.value) == message


def test_both_ends_of_the_decay_are_taken():
    assert [Ours(decay=d).decay for d in (0.0, 1.0)] == [0.0, 1.0]


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


# -- when an update happens: every comparison against Lightning's own callback ------------


def _updates_per_event(callback: pl.Callback, events: list[tuple[str, int]]) -> list[int]:
    """Drive ``callback``'s hooks as a Trainer would (``("step", global_step)`` after a
    batch, ``("epoch", current_epoch)`` after an epoch) and return the update count after
    each event: ``n_averaged`` for Lightning's, the EMA's step for ours."""
    from types import SimpleNamespace

    module = Regressor()
    trainer = SimpleNamespace(global_step=0, current_epoch=0)
    if isinstance(callback, Theirs):
        callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    else:
        callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    counts = []
    for kind, i in events:
        if kind == "step":
            trainer.global_step = i
            callback.on_train_batch_end(trainer, module, None, None, 0)  # type: ignore[arg-type]
        else:
            trainer.current_epoch = i
            callback.on_train_epoch_end(trainer, module)  # type: ignore[arg-type]
        with torch.no_grad():  # the weights move between events
            module.net[0].weight.add_(0.1)
        if isinstance(callback, Theirs):
            counts.append(int(callback._average_model.n_averaged))
        else:
            counts.append(int(callback.ema.step))
    return counts


#: Two batches per optimizer step (the global step repeats), epochs of four steps, and
#: an epoch hook called twice for one epoch.
EVENTS = [
    ("step", 0),
    *[("step", s) for s in (1, 1, 2, 2, 3, 3, 4, 4)],
    ("epoch", 0),
    ("epoch", 0),
    *[("step", s) for s in (5, 5, 6, 7, 8)],
    ("epoch", 1),
    ("epoch", 1),
    *[("step", s) for s in (9, 10, 11, 12)],
    ("epoch", 2),
    ("epoch", 3),
    ("epoch", 2),
]
BOUNDARIES = [
    {},
    {"update_starting_at_step": 4},  # step index 4 (global step 5): updates, not after
    {"update_starting_at_step": 3, "update_every_n_steps": 3},  # 3 is the first
    {"update_starting_at_step": 0, "update_every_n_steps": 2},
    {"update_every_n_steps": 0, "update_starting_at_epoch": 1},  # epoch 1 is the first
    {"update_every_n_steps": 0, "update_starting_at_epoch": 0},
    {"update_every_n_steps": 5, "update_starting_at_step": 5, "update_starting_at_epoch": 2},
]


@pytest.mark.parametrize("settings", BOUNDARIES, ids=lambda s: ",".join(map(str, s.items())))
def test_updates_happen_at_lightnings_boundaries(settings):
    theirs = _updates_per_event(Theirs(**settings), EVENTS)
    ours = _updates_per_event(Ours(**settings), EVENTS)
    assert ours == theirs
    assert theirs[-1] > 0


@pytest.mark.parametrize("start", [0, 1, 3, 4, 6])
@pytest.mark.parametrize("every", [0, 1, 2, 3])
def test_should_update_at_each_boundary_is_lightnings(start, every):
    for settings in (
        {"update_every_n_steps": every, "update_starting_at_step": start},
        {"update_every_n_steps": every, "update_starting_at_epoch": start},
        {"update_every_n_steps": every},
    ):
        ours, theirs = Ours(**settings), Theirs(**settings)
        for step in (None, *range(start - 1, start + 8)):
            for epoch in (None, start - 1, start, start + 1):
                want = theirs.should_update(step_idx=step, epoch_idx=epoch)
                assert ours.should_update(step_idx=step, epoch_idx=epoch) == want, (
                    settings,
                    step,
                    epoch,
                )
    assert Ours(update_starting_at_step=start).should_update(step_idx=start)
    assert not Ours(update_starting_at_step=start + 1).should_update(step_idx=start)
    assert Ours(update_starting_at_epoch=start).should_update(epoch_idx=start)
    assert not Ours(update_starting_at_epoch=start + 1).should_update(epoch_idx=start)


def test_an_overridden_should_update_decides_as_in_lightning():
    def late(self, step_idx=None, epoch_idx=None):  # Lightning's docstring example, shifted
        return step_idx is not None and step_idx >= 6

    theirs = _updates_per_event(type("T", (Theirs,), {"should_update": late})(), EVENTS)
    ours = _updates_per_event(type("O", (Ours,), {"should_update": late})(), EVENTS)
    assert ours == theirs and theirs[-1] == 6  # global steps 7..12


def test_gradient_accumulation_updates_once_per_optimizer_step_as_lightning():
    """With ``accumulate_grad_batches=2`` a batch ends twice per global step: one update."""
    outs = []
    for cls in (Theirs, Ours):
        module, callback = Regressor(), cls(decay=0.9)
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[callback], accumulate_grad_batches=2,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, loader(), loader(16))
        assert trainer.global_step == 4  # 2 epochs of 4 batches
        outs.append(module.state_dict())
        count = callback._average_model.n_averaged if cls is Theirs else callback.ema.step
        assert int(count) == 4
    assert rounding_ratio(outs[0], outs[1]) <= 2 * ROUNDING_EPS  # as after fit above


# -- a checkpoint saved while validation runs on the average ---------------------------------


class SavingInValidation(Regressor):
    """Saves a checkpoint during the first validation batch of epoch 1."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.current_epoch == 1 and batch_idx == 0:
            self.trainer.save_checkpoint(self.path)
        super().validation_step(batch, batch_idx)


def test_a_checkpoint_saved_during_validation_holds_lightnings_entries(tmp_path):
    """Saved while the module holds the average: ``state_dict`` is still the average and
    ``current_model_state`` the training weights, and validation goes on on the average."""
    module, callback = SavingInValidation(tmp_path / "mid.ckpt"), Ours(decay=0.9)
    seen: list[tuple[Tensor, Tensor]] = []

    class Before(pl.Callback):  # runs before the swap: the module holds its own weights
        def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            assert callback.ema is not None
            average = callback.ema.ema_model.net[0].weight.detach().clone()
            seen.append((pl_module.net[0].weight.detach().clone(), average))

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Before(), callback],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(), loader(16))
    training, average = seen[-1]
    assert not torch.equal(average, training)
    ckpt = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    assert torch.equal(ckpt["state_dict"]["net.0.weight"], average)
    assert torch.equal(ckpt["current_model_state"]["net.0.weight"], training)
    assert int(ckpt["averaging_state"]["n_averaged"]) == 8
    # both batches of that validation ran on the average, the one after the save included
    assert [torch.equal(w, average) for w in module.validated[-2:]] == [True, True]


def test_outside_fit_a_checkpoint_is_read_and_written_as_lightning(tmp_path):
    """``validate(ckpt_path=...)`` keeps no average: a warning (as Lightning's), the module
    holds the checkpoint's state_dict (the average), and a checkpoint saved then has no
    averaging entries."""
    fit(Ours(decay=0.9), 2, save_dir=tmp_path)
    ckpt_path = tmp_path / "epoch=1-step=8.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    for i, (cls, says) in enumerate([(Theirs, "outside the 'fit' stage"), (Ours, "during fit")]):
        module = Regressor()
        trainer = pl.Trainer(
            accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cls(decay=0.9)],
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.validate(module, loader(16), ckpt_path=ckpt_path, verbose=False)
        for name, t in ckpt["state_dict"].items():
            assert torch.equal(module.state_dict()[name], t), (cls, name)
        assert any(says in str(w.message) for w in caught), (cls, [str(w.message) for w in caught])
        trainer.save_checkpoint(tmp_path / f"after-{i}.ckpt")
        saved = torch.load(tmp_path / f"after-{i}.ckpt", weights_only=False)
        assert "averaging_state" not in saved and "current_model_state" not in saved, cls
        assert saved["state_dict"]["net.0.weight"].equal(ckpt["state_dict"]["net.0.weight"])


def test_resuming_from_a_checkpoint_without_averaging_warns_and_starts_there(tmp_path):
    """A checkpoint written without weight averaging: a warning (as Lightning's), and the
    average starts from its weights, as Lightning's does."""
    module = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(), loader(16))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    outs = []
    for cls, says in ((Theirs, "not created with WeightAveraging"), (Ours, "not written with")):
        callback, recorder = cls(decay=0.9), Recorder()
        module = Regressor()
        trainer = pl.Trainer(
            accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[recorder, callback],
        )  # fmt: skip
        with pytest.warns(UserWarning, match=says):
            trainer.fit(module, loader(), loader(16), ckpt_path=tmp_path / "plain.ckpt")
        count = callback._average_model.n_averaged if cls is Theirs else callback.ema.step
        assert int(count) == 4  # the 4 steps of epoch 1, the first copying
        outs.append(module.state_dict())
    assert rounding_ratio(outs[0], outs[1]) <= 2 * ROUNDING_EPS


# -- emakit's keywords, and the EMA underneath ---------------------------------------------


def fit_started(callback: pl.Callback, module: pl.LightningModule) -> SimpleNamespace:
    """``callback`` set up for ``module`` as when fit starts (Lightning's builds its average
    in ``setup``, ours in ``on_fit_start``); the Trainer stand-in, its global step at 0."""
    trainer = SimpleNamespace(global_step=0, current_epoch=0, state=SimpleNamespace(fn="fit"))
    if isinstance(callback, Theirs):
        callback.setup(trainer, module, "fit")  # type: ignore[arg-type]
    else:
        callback.on_fit_start(trainer, module)  # type: ignore[arg-type]
    return trainer


def test_device_and_ema_dtype_reach_the_ema():
    """``device=`` (a str or a ``torch.device``) is where the callback's EMA keeps the
    average, ``ema_dtype=`` the dtype it keeps it in; the module keeps its own."""
    for device in ("cpu", torch.device("cpu")):
        callback, module = Ours(device=device, ema_dtype=torch.float64), Regressor()
        fit_started(callback, module)
        assert callback.ema is not None and callback.ema.device == torch.device("cpu")
        average = callback.ema.ema_model.state_dict().values()
        assert {t.dtype for t in average if t.is_floating_point()} == {torch.float64}
        assert {t.dtype for t in module.parameters()} == {torch.float32}
    default = Ours()
    fit_started(default, Regressor())
    assert default.ema is not None and default.ema.device is None
    assert {t.dtype for t in default.ema.ema_model.parameters()} == {torch.float32}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_int_device_is_a_cuda_index_as_in_lightning():
    """``device=0`` keeps the average of a CPU module on ``cuda:0``, as Lightning's does."""
    theirs, ours = Theirs(device=0), Ours(device=0)
    fit_started(theirs, Regressor())
    fit_started(ours, Regressor())
    assert theirs._average_model is not None and ours.ema is not None
    for average in (theirs._average_model.module, ours.ema.ema_model):
        assert {t.device for t in average.state_dict().values()} == {torch.device("cuda", 0)}


def test_an_update_with_a_nan_weight_is_taken_unless_skip_nonfinite():
    """By default an update whose weights hold NaN puts NaN in the average, as Lightning's
    does; with ``skip_nonfinite=True`` that update is skipped."""
    averages = {}
    for name, callback in (
        ("lightning", Theirs(decay=0.5)),
        ("default", Ours(decay=0.5)),
        ("skip_nonfinite", Ours(decay=0.5, skip_nonfinite=True)),
    ):
        module = Regressor()
        trainer = fit_started(callback, module)
        for step in (1, 2):  # the first update copies, the second averages the NaN in
            if step == 2:
                with torch.no_grad():
                    module.net[0].weight[0, 0] = float("nan")
            trainer.global_step = step
            callback.on_train_batch_end(trainer, module, None, None, 0)  # type: ignore[arg-type]
        if isinstance(callback, Theirs):
            assert callback._average_model is not None
            averages[name] = callback._average_model.module.net[0].weight.detach().clone()
        else:
            assert callback.ema is not None
            averages[name] = callback.ema.ema_model.net[0].weight.detach().clone()
    assert averages["lightning"][0, 0].isnan() and averages["default"][0, 0].isnan()
    assert torch.equal(averages["skip_nonfinite"], Regressor().net[0].weight)  # the copy


def test_the_callbacks_ema_holds_the_average_and_not_the_module():
    """``callback.ema.state_dict()`` is the average and its count: the module's weights,
    which the Lightning checkpoint holds already, are not in it again (``online_model.*``)."""
    callback, module = Ours(), Regressor()
    fit_started(callback, module)
    assert callback.ema is not None
    expected = {"initted", "step", *(f"ema_model.{k}" for k in module.state_dict())}
    assert set(callback.ema.state_dict()) == expected


def test_train_end_copies_the_average_into_its_own_module_only():
    """``on_train_end`` leaves a module it holds no average of alone: before fit started,
    and another module than the one it averages; into its own it copies the average."""
    module, other = Regressor(), Regressor()
    trainer = SimpleNamespace(global_step=0, current_epoch=0)
    Ours().on_train_end(trainer, module)  # type: ignore[arg-type]
    assert torch.equal(module.net[0].weight, other.net[0].weight)
    callback = Ours(decay=0.5)
    fit_started(callback, module)
    assert callback.ema is not None
    callback.ema.update()  # the average: the module's weights now
    with torch.no_grad():
        module.net[0].weight.add_(1.0)
        other.net[0].weight.add_(2.0)
    before = [m.net[0].weight.detach().clone() for m in (module, other)]
    callback.on_train_end(trainer, other)  # type: ignore[arg-type]
    assert torch.equal(module.net[0].weight, before[0])
    assert torch.equal(other.net[0].weight, before[1])
    callback.on_train_end(trainer, module)  # type: ignore[arg-type]
    assert torch.equal(module.net[0].weight, callback.ema.ema_model.net[0].weight)
    assert not torch.equal(module.net[0].weight, before[0])


def test_a_checkpoint_saved_before_fit_is_left_as_is_and_the_log_says_why(caplog):
    """No average yet (saved outside fit): the checkpoint stays as the Trainer made it and
    an info line says why, as Lightning's does."""
    for cls in (Theirs, Ours):
        module = Regressor()
        checkpoint = {"state_dict": module.state_dict()}
        caplog.clear()
        with caplog.at_level(logging.INFO):
            cls().on_save_checkpoint(SimpleNamespace(), module, checkpoint)  # type: ignore[arg-type]
        assert list(checkpoint) == ["state_dict"], cls
        said = [r.getMessage() for r in caplog.records if r.name.startswith("lightning")]
        assert len(said) == 1, (cls, said)
    assert said == [
        "EMAWeightAveraging has no average of this module outside fit: the checkpoint holds "
        "the module's weights and no averaging state"
    ]


def test_a_checkpoint_with_a_corrupt_averaging_state_is_refused_naming_it():
    """``averaging_state`` that is not Lightning's mapping (a damaged file) is refused when
    the average is loaded, naming the entry as Lightning's format holds it."""
    module, callback = Regressor(), Ours()
    state = module.state_dict()
    checkpoint = {"state_dict": state, "current_model_state": state, "averaging_state": 8}
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    callback.on_load_checkpoint(trainer, module, checkpoint)  # type: ignore[arg-type]
    with pytest.raises(  # the wording of the type: test_foreign_formats
        EMAStateError,
        match=r"^the checkpoint\['state_dict'\] \(Lightning weight averaging\): averaging_state is ",
    ):
        callback.on_fit_start(trainer, module)  # type: ignore[arg-type]


def test_a_save_during_validation_calls_the_hooks_with_the_trainer():
    """A checkpoint saved while validation runs on the average puts the training weights
    back and the average in again through the callback's hooks, with the Trainer each
    hook is given, so that an override of them sees it."""
    seen: list[object] = []

    class Recording(Ours):
        def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            seen.append(trainer)
            super().on_validation_epoch_start(trainer, pl_module)

    callback, module = Recording(decay=0.5), Regressor()
    trainer = fit_started(callback, module)
    trainer.strategy = SimpleNamespace(lightning_module_state_dict=module.state_dict)
    assert callback.ema is not None
    callback.ema.update()
    with torch.no_grad():
        module.net[0].weight.add_(1.0)
    training = module.net[0].weight.detach().clone()
    callback.on_validation_epoch_start(trainer, module)  # type: ignore[arg-type]
    checkpoint: dict[str, Any] = {"state_dict": module.state_dict()}
    callback.on_save_checkpoint(trainer, module, checkpoint)  # type: ignore[arg-type]
    assert seen == [trainer, trainer]
    assert torch.equal(checkpoint["current_model_state"]["net.0.weight"], training)
    assert torch.equal(module.net[0].weight, callback.ema.ema_model.net[0].weight)  # again
