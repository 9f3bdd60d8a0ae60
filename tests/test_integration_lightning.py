"""EMACallback with the real Lightning Trainer on CPU: EMA validation, one update per
optimizer step, the EMA in checkpoints, bit-exact resume, restore on exceptions."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from _launch import FSDP2_MARK  # noqa: E402
from emakit import EMAError  # noqa: E402
from emakit.integrations.lightning import (  # noqa: E402
    CHECKPOINT_KEY,
    ONLINE_STATE_DICT_KEY,
    EMACallback,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)

EMA_KW: dict[str, Any] = {"beta": 0.9, "update_after_step": 0, "update_every": 1}


class Regressor(pl.LightningModule):
    """Linear -> BatchNorm -> Tanh -> Linear: parameters and buffers, no randomness."""

    def __init__(self, fail_on_validation: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        self.fail_on_validation = fail_on_validation
        self.validations = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validations += 1
        if self.validations == self.fail_on_validation:
            raise RuntimeError("boom in validation")
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(48, 1, generator=g)


X, Y = _data()


def train_loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=8)  # 6 batches, fixed order


def val_loader() -> DataLoader:
    return DataLoader(TensorDataset(X[:32], Y[:32]), batch_size=32)  # one batch: exact mean


def make_trainer(callbacks: list, **kw: Any) -> Any:
    opts: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    opts.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(callbacks=callbacks, **opts)


def raw_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_validation_metrics_come_from_the_ema_weights():
    cb = EMACallback(**EMA_KW)
    module = Regressor()
    trainer = make_trainer([cb], max_epochs=3)
    trainer.fit(module, train_loader(), val_loader())

    logged = trainer.callback_metrics["val_loss"]
    from_ema = F.mse_loss(cb.ema(X[:32]), Y[:32])
    module.eval()
    with torch.no_grad():
        from_raw = F.mse_loss(module(X[:32]), Y[:32])
    torch.testing.assert_close(logged, from_ema, rtol=1e-6, atol=0)
    assert abs(float(from_raw) - float(from_ema)) > 1e-3  # the two really differ

    trainer.test(module, val_loader())
    torch.testing.assert_close(trainer.callback_metrics["test_loss"], from_ema, rtol=1e-6, atol=0)


def test_validation_leaves_the_training_trajectory_alone():
    with_val, without_val = Regressor(), Regressor()
    make_trainer([EMACallback(**EMA_KW)]).fit(with_val, train_loader(), val_loader())
    make_trainer([EMACallback(**EMA_KW)], limit_val_batches=0).fit(without_val, train_loader())
    assert_same(raw_state(with_val), raw_state(without_val))


def test_validate_with_ema_false_uses_raw_weights():
    cb = EMACallback(validate_with_ema=False, **EMA_KW)
    module = Regressor()
    trainer = make_trainer([cb])
    trainer.fit(module, train_loader(), val_loader())
    module.eval()
    with torch.no_grad():
        from_raw = F.mse_loss(module(X[:32]), Y[:32])
    torch.testing.assert_close(trainer.callback_metrics["val_loss"], from_raw, rtol=1e-6, atol=0)


def test_one_update_per_optimizer_step_under_accumulation():
    cb = EMACallback(**EMA_KW)
    trainer = make_trainer([cb], accumulate_grad_batches=3, limit_val_batches=0)
    trainer.fit(Regressor(), train_loader())
    assert trainer.global_step == 4  # 2 epochs x 6 batches / 3
    assert int(cb.ema.step) == 4


def test_raw_weights_come_back_when_validation_raises():
    cb = EMACallback(**EMA_KW)
    module = Regressor(fail_on_validation=2)
    storages = [p.data_ptr() for p in module.parameters()]
    trainer = make_trainer([cb], max_epochs=3)
    with pytest.raises(RuntimeError, match="boom in validation"):
        trainer.fit(module, train_loader(), val_loader())
    assert [p.data_ptr() for p in module.parameters()] == storages
    assert not any(
        torch.equal(p, s)
        for p, s in zip(module.parameters(), cb.ema.ema_model.parameters(), strict=True)
    )
    cb.ema.update()  # not stuck inside swap()


def test_checkpoint_holds_the_ema_and_the_raw_weights(tmp_path: Path):
    cb = EMACallback(**EMA_KW)
    module = Regressor()
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = make_trainer([cb, ckpt_cb], enable_checkpointing=True)
    trainer.fit(module, train_loader(), val_loader())  # saved at validation end

    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt[CHECKPOINT_KEY]["version"] == 1
    assert_same(ckpt[CHECKPOINT_KEY]["ema"], cb.ema.state_dict())
    # the checkpoint holds the module once: the EMA's state leaves it out
    assert not any(k.startswith("online_model.") for k in ckpt[CHECKPOINT_KEY]["ema"])
    assert_same(ckpt["state_dict"], raw_state(module))  # not the swapped-in EMA weights
    assert ONLINE_STATE_DICT_KEY not in ckpt


def test_export_ema_weights_as_state_dict(tmp_path: Path):
    cb = EMACallback(save_ema_weights_as_state_dict=True, **EMA_KW)
    module = Regressor()
    trainer = make_trainer([cb], limit_val_batches=0)
    trainer.fit(module, train_loader())
    trainer.save_checkpoint(tmp_path / "export.ckpt")

    ckpt = torch.load(tmp_path / "export.ckpt", weights_only=True)
    assert_same(ckpt["state_dict"], raw_state(cb.ema.ema_model))
    assert_same(ckpt[ONLINE_STATE_DICT_KEY], raw_state(module))
    exported = Regressor.load_from_checkpoint(tmp_path / "export.ckpt", weights_only=True)
    assert_same(raw_state(exported), raw_state(cb.ema.ema_model))


def test_checkpoint_saved_during_validation_keeps_the_raw_weights(tmp_path: Path):
    cb = EMACallback(**EMA_KW)
    module = Regressor()
    trainer = make_trainer([cb], max_epochs=1, limit_val_batches=0)
    trainer.fit(module, train_loader())
    raw = raw_state(module)
    cb.on_validation_start(trainer, module)  # as if saving from inside validation
    assert_same(raw_state(module), raw_state(cb.ema.ema_model))
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    assert_same(raw_state(module), raw_state(cb.ema.ema_model))  # still swapped in
    cb.on_validation_end(trainer, module)
    assert_same(raw_state(module), raw)
    assert_same(torch.load(tmp_path / "mid.ckpt", weights_only=True)["state_dict"], raw)


RESUME_KW: dict[str, Any] = {"beta": 0.8, "update_after_step": 2, "update_every": 2}
RESUME_TRAINER: dict[str, Any] = {"accumulate_grad_batches": 2, "limit_val_batches": 0}


@pytest.fixture(scope="module")
def straight_run() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """EMA state and raw weights after 3 uninterrupted epochs (9 optimizer steps)."""
    cb, module = EMACallback(**RESUME_KW), Regressor()
    make_trainer([cb], max_epochs=3, **RESUME_TRAINER).fit(module, train_loader())
    assert int(cb.ema.step) == 9
    return cb.ema.state_dict(), raw_state(module)


@pytest.mark.parametrize("export", [False, True], ids=["ema-key", "ema-as-state_dict"])
def test_resumed_fit_ends_with_the_same_ema(tmp_path: Path, straight_run: Any, export: bool):
    # Stop after 3 optimizer steps: mid update_every period, just past update_after_step.
    first_cb, first = EMACallback(save_ema_weights_as_state_dict=export, **RESUME_KW), Regressor()
    trainer = make_trainer([first_cb], max_epochs=1, **RESUME_TRAINER)
    trainer.fit(first, train_loader())
    trainer.save_checkpoint(tmp_path / "part.ckpt")

    resumed_cb, resumed = (
        EMACallback(save_ema_weights_as_state_dict=export, **RESUME_KW),
        Regressor(),
    )
    trainer = make_trainer([resumed_cb], max_epochs=3, **RESUME_TRAINER)
    trainer.fit(resumed, train_loader(), ckpt_path=tmp_path / "part.ckpt", weights_only=True)

    ema_state, raw = straight_run
    assert_same(resumed_cb.ema.state_dict(), ema_state)
    assert_same(raw_state(resumed), raw)


def test_test_from_a_checkpoint_uses_its_ema(tmp_path: Path):
    cb = EMACallback(**EMA_KW)
    trainer = make_trainer([cb], limit_val_batches=0)
    trainer.fit(Regressor(), train_loader())
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    expected = F.mse_loss(cb.ema(X[:32]), Y[:32])

    fresh_cb = EMACallback(**EMA_KW)
    tester = make_trainer([fresh_cb])
    tester.test(Regressor(), val_loader(), ckpt_path=tmp_path / "m.ckpt", weights_only=True)
    torch.testing.assert_close(tester.callback_metrics["test_loss"], expected, rtol=1e-6, atol=0)


def test_bad_keywords_and_sharded_strategies_are_refused():
    with pytest.raises(EMAError, match="betta"):
        EMACallback(betta=0.9)
    with pytest.raises(EMAError, match="model="):
        EMACallback(model=nn.Linear(2, 2))
    with pytest.raises(EMAError, match="validate_with_ema"):
        EMACallback(validate_with_ema="yes")

    class FakeFSDP:
        pass

    FakeFSDP.__name__ = "FSDPStrategy"

    class FakeTrainer:
        strategy = FakeFSDP()
        callbacks = ()

    with pytest.raises(EMAError, match="FSDPStrategy") as info:
        EMACallback().setup(FakeTrainer(), Regressor(), "fit")  # type: ignore[arg-type]
    assert "ModelParallelStrategy" in str(info.value)  # the message names the way that works
    FakeFSDP.__name__ = "ModelParallelStrategy"  # FSDP2 through configure_model: supported
    EMACallback().setup(FakeTrainer(), Regressor(), "fit")  # type: ignore[arg-type]


def test_import_emakit_does_not_import_frameworks():
    import subprocess
    import sys

    code = (
        "import sys, emakit, emakit.integrations; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'transformers') "
        "if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


DDP_SCRIPT = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from emakit.integrations.lightning import EMACallback

class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, i):
        return F.mse_loss(self(batch[0]), batch[1])
    def validation_step(self, batch, i):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

out = sys.argv[1]
g = torch.Generator().manual_seed(0)
x = torch.randn(48, 4, generator=g)
y = x.sum(1, keepdim=True)
cb = EMACallback(beta=0.9, update_after_step=0, update_every=1)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0, callbacks=[cb], accumulate_grad_batches=2)
trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=4),
            DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16))
trainer.save_checkpoint(out + "/ddp.ckpt")
torch.save({"global_step": trainer.global_step, "ema": cb.ema.state_dict(),
            "val_loss": trainer.callback_metrics["val_loss"],
            "ema_val_loss": F.mse_loss(cb.ema(x[:32]), y[:32])}, f"{out}/rank{trainer.global_rank}.pt")
"""


@pytest.mark.dist
@pytest.mark.slow
def test_ddp_two_cpu_processes(tmp_path: Path):
    # ~20 s on 2 quiet CPU cores (two Lightning processes, gloo); part of the normal suite.
    import subprocess
    import sys

    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["global_step"] == 6  # 2 epochs x (12 batches / 2 ranks) / 2
    assert int(r0["ema"]["step"]) == 6
    assert_same(r0["ema"], r1["ema"])  # every rank keeps the same EMA
    # Validation ran on the EMA weights (val_loss synced over the two halves of the set).
    torch.testing.assert_close(r0["val_loss"], r0["ema_val_loss"], rtol=1e-5, atol=0)
    ckpt = torch.load(tmp_path / "ddp.ckpt", weights_only=True)
    assert_same(ckpt[CHECKPOINT_KEY]["ema"], r0["ema"])


MODEL_PARALLEL_SCRIPT = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from emakit.integrations.lightning import EMACallback

class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
    def configure_model(self):  # FSDP2: the body its own unit, the root owns inp and head
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.body, mesh=mesh)
        fully_shard(self, mesh=mesh)
    def forward(self, x):
        return self.head(self.body(self.inp(x)))
    def training_step(self, batch, i):
        return F.mse_loss(self(batch[0]), batch[1])
    def validation_step(self, batch, i):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

out = sys.argv[1]
g = torch.Generator().manual_seed(0)
x = torch.randn(48, 4, generator=g)
y = x.sum(1, keepdim=True)

def fit(epochs, ckpt=None, distributed=True):
    cb = EMACallback(beta=0.9, update_after_step=0, update_every=1)
    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=distributed
    )
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[cb])
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=4),
                DataLoader(TensorDataset(x[:32], y[:32]), batch_size=16), ckpt_path=ckpt)
    return trainer, cb

def gathered(module):
    return {n: p.full_tensor().clone() for n, p in module.named_parameters()}

res = {}
trainer, cb = fit(3)
res["straight"], res["straight_step"] = gathered(cb.ema.ema_model), int(cb.ema.step)
res["online"] = gathered(trainer.lightning_module)
res["sharded"] = all(type(p).__name__ == "DTensor" for p in cb.ema.ema_model.parameters())
res["val_loss"] = trainer.callback_metrics["val_loss"]
res["ema_val_loss"] = F.mse_loss(cb.ema(x[:32]), y[:32])
for distributed in (True, False):  # a DCP folder (the default), one full file
    name = "dcp" if distributed else "file"
    trainer, cb = fit(2, distributed=distributed)
    trainer.save_checkpoint(out + "/" + name + ".ckpt")
    trainer, cb = fit(3, ckpt=out + "/" + name + ".ckpt", distributed=distributed)
    res[name], res[name + "_step"] = gathered(cb.ema.ema_model), int(cb.ema.step)
torch.save(res, out + "/rank" + str(trainer.global_rank) + ".pt")
"""


@pytest.mark.dist
@pytest.mark.slow
@FSDP2_MARK
def test_model_parallel_strategy_fsdp2_two_cpu_processes(tmp_path: Path):
    # ModelParallelStrategy (FSDP2 in configure_model) on 2 CPU processes (gloo): the EMA
    # of each rank's shards, validation on it, and exact resume from both checkpoint
    # kinds. About 10 s on 2 cores: five short fits.
    import subprocess
    import sys

    script = tmp_path / "model_parallel_fit.py"
    script.write_text(MODEL_PARALLEL_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"]
    assert r0["straight_step"] == 18  # 3 epochs x 12 batches / 2 ranks, one update each
    assert_same(r0["straight"], r1["straight"])  # the gathered EMA, seen from both ranks
    assert any((r0["straight"][k] - r0["online"][k]).abs().max() > 1e-3 for k in r0["online"])
    # Validation ran on the EMA weights (val_loss synced over the two halves of the set).
    torch.testing.assert_close(r0["val_loss"], r0["ema_val_loss"], rtol=1e-5, atol=0)
    for kind in ("dcp", "file"):  # resumed from the checkpoint: the same EMA, bit for bit
        assert r0[f"{kind}_step"] == 18, kind
        assert_same(r0[kind], r0["straight"])
    # The distributed checkpoint keeps the EMA's shards next to the model's, with DCP.
    meta = torch.load(tmp_path / "dcp.ckpt" / "meta.pt", weights_only=True)
    assert meta[CHECKPOINT_KEY]["version"] == 2 and int(meta[CHECKPOINT_KEY]["ema"]["step"]) == 12
    full = torch.load(tmp_path / "file.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert full["version"] == 1 and full["ema"]["ema_model.head.weight"].shape == (1, 8)


def _closed_form_decay(step: int, beta: float, after: int = 0, power: float = 2 / 3) -> float:
    """ema-pytorch's decay at update call ``step`` (inv_gamma 1, update_every 1)."""
    epoch = max(step - after - 1, 0)
    return 0.0 if epoch <= 0 else min(beta, max(0.0, 1 - (1 + epoch) ** -power))


def test_csv_logger_gets_decay_step_skips_and_both_validations(tmp_path):
    """Through Lightning's own logger: the decay and step after every optimizer step
    (against the closed form), the skip count per epoch, and validation on the EMA and on
    the raw weights under distinct names, each equal to a recomputation."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    cb = EMACallback(also_validate_online=True, skip_nonfinite=True, **EMA_KW)
    module = Regressor()
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer = make_trainer([cb], logger=logger, log_every_n_steps=1, max_epochs=2)
    trainer.fit(module, train_loader(), val_loader())
    with open(Path(logger.log_dir) / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))

    steps = [r for r in rows if r.get("ema/decay")]
    assert [int(float(r["ema/step"])) for r in steps] == list(range(1, 13))  # 6 batches x 2
    for r in steps:
        expected = _closed_form_decay(int(float(r["ema/step"])), beta=0.9)
        assert float(r["ema/decay"]) == pytest.approx(expected, rel=1e-6, abs=1e-12)
    skips = [
        float(r["ema/num_skipped_nonfinite"]) for r in rows if r.get("ema/num_skipped_nonfinite")
    ]
    assert skips == [0.0, 0.0]  # one per training epoch

    val = [r for r in rows if r.get("val_loss")]
    assert len(val) == 2 and all(r.get("val_loss_online") for r in val)
    last = val[-1]
    module.eval()
    with torch.no_grad():
        raw = F.mse_loss(module(X[:32]), Y[:32])
    ema = F.mse_loss(cb.ema(X[:32]), Y[:32])
    assert float(last["val_loss"]) == pytest.approx(float(ema), rel=1e-6)
    assert float(last["val_loss_online"]) == pytest.approx(float(raw), rel=1e-6)
    assert abs(float(raw) - float(ema)) > 1e-3  # two different models, two names


def test_log_stats_false_logs_nothing_and_keywords_are_typed():
    """``log_stats=False`` leaves the logged metrics alone; the EMA keywords the callbacks
    take are typed as ``EMA``'s own (one TypedDict, checked against the signature)."""
    import inspect
    import typing

    from emakit import EMA
    from emakit.integrations.lightning import EMAKeywords

    cb = EMACallback(log_stats=False, **EMA_KW)
    trainer = make_trainer([cb], limit_val_batches=0, max_epochs=1)
    trainer.fit(Regressor(), train_loader())
    assert not any(k.startswith("ema/") for k in trainer.logged_metrics)

    from emakit import BEMA

    keyword_hints = typing.get_type_hints(EMAKeywords)
    wanted: list[str] = []
    for kind in (EMA, BEMA):
        hints = typing.get_type_hints(kind.__init__)
        names = [
            p for p in inspect.signature(kind.__init__).parameters if p not in ("self", "model")
        ]
        assert set(names) <= set(keyword_hints), (kind, sorted(set(names) - set(keyword_hints)))
        same = [n for n in names if n != "ema_model" and keyword_hints[n] != hints[n]]
        assert not same, (kind, same)
        wanted += [n for n in names if n not in wanted]
    assert sorted(keyword_hints) == sorted(wanted)  # nothing a kind does not take
    with pytest.raises(EMAError, match="log_stats"):
        EMACallback(log_stats="yes")
