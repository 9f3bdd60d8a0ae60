"""`emakit.load_foreign_state` on the training checkpoints people have, each built as the
library or script that writes it builds it: timm's ``last.pth.tar`` (its ``args`` an
``argparse.Namespace``), torchvision's reference ``checkpoint.pth`` (an ``AveragedModel``
state under ``model_ema``), a Lightning checkpoint with a torch_ema state under ``"ema"``
(as sgmse's ``on_save_checkpoint`` stores it), and an Ultralytics ``last.pt`` (its EMA a
pickled model: refused, saying how to turn it into a state). Each loads with its step, so
the next update uses the peer's next decay."""

from __future__ import annotations

import argparse
import copy
import io
import math
import sys
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from emakit import EMA, EMAStateError, schedules
from emakit.foreign import load_foreign_state, read_training_checkpoint


def make_net(seed: int = 0, bn: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(8)] if bn else []
    return nn.Sequential(nn.Linear(6, 8), *norm, nn.Tanh(), nn.Linear(8, 3))


def sgd_step(net: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    data = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=data), torch.randn(8, 3, generator=data)
    opt.zero_grad()
    F.mse_loss(net(x), y).backward()
    opt.step()


def assert_close(ours: dict[str, Tensor], theirs: dict[str, Tensor], eps: int = 4) -> None:
    """Floating tensors equal to float32 rounding: ``eps`` epsilons of the largest |value|
    (``lerp_`` against the peers' ``d * e + (1 - d) * m``)."""
    for k, t in theirs.items():
        if t.is_floating_point():
            bound = eps * torch.finfo(torch.float32).eps * max(t.abs().max().item(), 1.0)
            assert (ours[k].float() - t.float()).abs().max().item() <= bound, k


def test_timm_last_pth_tar_with_its_argparse_namespace(tmp_path):
    """``CheckpointSaver`` saves ``args`` (an ``argparse.Namespace``): read with it as data,
    the EMA continues with timm's next decay, bit for bit."""
    timm_utils = pytest.importorskip("timm.utils")
    net = make_net()
    theirs = timm_utils.ModelEmaV3(net, decay=0.99, use_warmup=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    num_updates = 0
    for _ in range(5):  # train.py's lines
        sgd_step(net, opt, num_updates)
        num_updates += 1
        theirs.update(net, step=num_updates)
    args = argparse.Namespace(model="mlp", model_ema=True, model_ema_decay=0.99, lr=0.1)
    timm_utils.CheckpointSaver(
        net, opt, args=args, model_ema=theirs, checkpoint_dir=str(tmp_path), recovery_dir="."
    ).save_checkpoint(epoch=0, metric=1.0)
    path = tmp_path / "last.pth.tar"
    assert isinstance(torch.load(path, weights_only=False)["args"], argparse.Namespace)
    assert argparse.Namespace not in torch.serialization.get_safe_globals()

    ours = EMA(
        net,
        schedule=lambda t: min(1 - (1 + t) ** -(2 / 3), 0.99),  # timm's warm-up
        update_after_step=0,
        update_every=1,
    )
    assert load_foreign_state(ours, path, step=num_updates) == "timm"  # train.py's count
    # nothing left process-wide (torch registers its own classes as its modules load)
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    for k, v in theirs.module.state_dict().items():
        assert torch.equal(ours.ema_model.state_dict()[k], v), k
    sgd_step(net, opt, num_updates)
    theirs.update(net, step=num_updates + 1)
    ours.update()
    assert ours.get_current_decay() == theirs.get_decay(num_updates + 1) > 0
    for k, v in theirs.module.state_dict().items():
        assert torch.equal(ours.ema_model.state_dict()[k], v), k


class NotData:
    """A class no checkpoint reader should build."""


@pytest.mark.skipif(
    not hasattr(torch.serialization, "safe_globals"), reason="torch 2.4 has no safe_globals"
)
def test_only_the_namespace_is_accepted_and_only_for_that_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(lr=0.1, layers=[2, 3], name="x")}, path)
    assert read_training_checkpoint(path)["args"] == argparse.Namespace(
        lr=0.1, layers=[2, 3], name="x"
    )
    buffer = io.BytesIO(path.read_bytes())
    assert read_training_checkpoint(buffer)["args"].layers == [2, 3]
    with pytest.raises(Exception, match="Namespace"):  # still refused by a plain load
        torch.load(path, weights_only=True)
    torch.save({"args": argparse.Namespace(obj=NotData())}, path)
    with pytest.raises(EMAStateError, match=r"NotData.*weights_only=False"):
        read_training_checkpoint(path)
    with pytest.raises(EMAStateError, match=r"file object.*NotData"):
        read_training_checkpoint(io.BytesIO(path.read_bytes()))
    # a Namespace the caller allowed process-wide stays allowed after a read
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        torch.save({"args": argparse.Namespace(lr=1)}, path)
        read_training_checkpoint(path)
        assert argparse.Namespace in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


# -- torchvision's references/classification/train.py ------------------------------------


class TorchvisionEMA(AveragedModel):
    """torchvision's ``references/classification/utils.ExponentialMovingAverage``."""

    def __init__(self, model: nn.Module, decay: float, device: Any = "cpu") -> None:
        def ema_avg(avg_model_param: Tensor, model_param: Tensor, num_averaged: Tensor) -> Tensor:
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def torchvision_decay(args: argparse.Namespace) -> float:
    """train.py's decay, adjusted to the batch size and the number of EMA steps."""
    adjust = args.world_size * args.batch_size * args.model_ema_steps / args.epochs
    alpha = min(1.0, (1.0 - args.model_ema_decay) * adjust)
    return 1.0 - alpha


def torchvision_setup(args: argparse.Namespace) -> tuple[nn.Module, Any, TorchvisionEMA]:
    model = make_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer, TorchvisionEMA(model, device="cpu", decay=torchvision_decay(args))


def test_torchvision_checkpoint_pth_loads_the_averaged_model_with_its_count(tmp_path):
    """train.py's ``checkpoint.pth``: ``model_ema`` is an ``AveragedModel`` state
    (``n_averaged``, ``module.*``) beside ``args``, a Namespace: loaded as that state, found
    by its keys, with ``n_averaged`` as the step; the next update averages with the decay."""
    args = argparse.Namespace(
        model="mlp", epochs=3, batch_size=8, world_size=1, lr_warmup_epochs=1,
        model_ema=True, model_ema_steps=2, model_ema_decay=0.99, output_dir=str(tmp_path),
    )  # fmt: skip
    model, optimizer, model_ema = torchvision_setup(args)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    for epoch in range(args.epochs):
        for i in range(4):  # train_one_epoch
            sgd_step(model, optimizer, 10 * epoch + i)
            if model_ema and i % args.model_ema_steps == 0:
                model_ema.update_parameters(model)
                if epoch < args.lr_warmup_epochs:
                    model_ema.n_averaged.fill_(0)
        lr_scheduler.step()
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "epoch": epoch,
            "args": args,
        }
        if model_ema:
            checkpoint["model_ema"] = model_ema.state_dict()
        torch.save(checkpoint, tmp_path / "checkpoint.pth")
    n_averaged = int(model_ema.n_averaged)
    assert n_averaged == 4

    # train.py's --resume, and emakit reading the same file
    checkpoint = torch.load(tmp_path / "checkpoint.pth", map_location="cpu", weights_only=False)
    model, optimizer, model_ema = torchvision_setup(args)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    model_ema.load_state_dict(checkpoint["model_ema"])
    decay = torchvision_decay(args)
    ours = EMA(model, schedule=schedules.constant(decay), update_after_step=0, update_every=1)
    source: Any = tmp_path / "checkpoint.pth"
    if not hasattr(torch.serialization, "safe_globals"):  # torch 2.4: the Namespace is refused
        with pytest.raises(EMAStateError, match=r"argparse.Namespace.*weights_only=False"):
            load_foreign_state(ours, source)
        source = checkpoint  # what the message says to do
    with pytest.warns(UserWarning, match=r"averaged_model EMA state at \['model_ema'\]"):
        assert load_foreign_state(ours, source) == "averaged_model"
    assert int(ours.step) == n_averaged
    for k, v in model_ema.module.state_dict().items():
        assert torch.equal(ours.ema_model.state_dict()[k], v), k
    sgd_step(model, optimizer, 99)
    model_ema.update_parameters(model)  # n_averaged > 0: it averages with the decay
    ours.update()
    assert ours.get_current_decay() == decay
    assert_close(ours.ema_model.state_dict(), model_ema.module.state_dict())
    moved = model_ema.module.state_dict()["0.weight"]
    assert not torch.equal(moved, model.state_dict()["0.weight"])  # averaged, not copied


# -- a Lightning checkpoint with a torch_ema state (sgmse's ScoreModel) ---------------------


def test_lightning_checkpoint_with_a_torch_ema_state_under_ema(tmp_path):
    """sgmse's ``ScoreModel``: torch_ema updated in ``optimizer_step``, its state saved by
    ``on_save_checkpoint`` as ``checkpoint["ema"]``. Found by its keys, loaded with step
    ``num_updates + 1``: the next update uses torch_ema's next decay."""
    pl = pytest.importorskip("lightning.pytorch")
    torch_ema = pytest.importorskip("torch_ema")
    from torch.utils.data import DataLoader, TensorDataset

    class ScoreModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.dnn = make_net(bn=False)
            self.ema = torch_ema.ExponentialMovingAverage(self.parameters(), decay=0.999)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            x, y = batch
            return F.mse_loss(self.dnn(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*args, **kwargs)
            self.ema.update(self.parameters())

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["ema"] = self.ema.state_dict()

    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 6, generator=data), torch.randn(48, 3, generator=data)
    module = ScoreModel()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    num_updates = module.ema.num_updates
    assert num_updates == 6

    ours = EMA(
        module.dnn,
        schedule=schedules.torch_ema_warmup(0.999),
        update_after_step=0,
        update_every=1,
    )
    with pytest.warns(UserWarning, match=r"torch_ema EMA state at \['ema'\] of .*last\.ckpt"):
        assert load_foreign_state(ours, path) == "torch_ema"
    assert int(ours.step) == num_updates + 1
    for p, shadow in zip(ours.ema_model.parameters(), module.ema.shadow_params, strict=True):
        assert torch.equal(p, shadow)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    sgd_step(module.dnn, optimizer, 99)
    module.ema.update(module.parameters())
    ours.update()
    assert ours.get_current_decay() == min(0.999, (1 + num_updates + 1) / (10 + num_updates + 1))
    theirs = dict(zip(dict(module.dnn.named_parameters()), module.ema.shadow_params, strict=True))
    assert_close(dict(ours.ema_model.named_parameters()), theirs)


def test_several_nested_states_are_refused_naming_each():
    torch_ema = pytest.importorskip("torch_ema")
    net = make_net(bn=False)
    state = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9).state_dict()
    checkpoint = {"model": net.state_dict(), "ema": state, "train": {"ema_slow": state}}
    with pytest.raises(
        EMAStateError, match=r"2 EMA states, at \['ema'\], \['train'\]\['ema_slow'\]"
    ):
        load_foreign_state(EMA(net), checkpoint)
    with pytest.warns(UserWarning, match=r"at \['ema'\]"):  # the format named: looked for
        load_foreign_state(EMA(net, update_after_step=0), {"ema": state}, format="torch_ema")


# -- Ultralytics (YOLO) ---------------------------------------------------------------------


class DetectionModel(nn.Module):
    """Stands for ``ultralytics.nn.tasks.DetectionModel`` (a pickled class, never loaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make_net()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class UltralyticsModelEMA:
    """``ultralytics.utils.torch_utils.ModelEMA``, from what it does."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: int = 2000) -> None:
        self.ema = copy.deepcopy(model).eval()
        self.updates = 0
        self.decay = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay(self.updates)
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v *= d
                v += (1 - d) * msd[k].detach()


@pytest.fixture
def ultralytics_module(monkeypatch):
    """A module ``ultralytics.nn.tasks`` holding `DetectionModel`, for pickling by name."""
    tasks = types.ModuleType("ultralytics.nn.tasks")
    tasks.DetectionModel = DetectionModel  # type: ignore[attr-defined]
    monkeypatch.setattr(DetectionModel, "__module__", "ultralytics.nn.tasks")
    for name in ("ultralytics", "ultralytics.nn"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "ultralytics.nn.tasks", tasks)


def test_ultralytics_last_pt_is_refused_with_the_lines_that_read_it(tmp_path, ultralytics_module):
    """``BaseTrainer.save_model``'s dict: the EMA is a pickled half-precision model, which
    ``weights_only=True`` refuses. The message gives the two lines that make a state of it
    and the call that loads that state with the step Ultralytics' next update follows."""
    model = DetectionModel()
    ema = UltralyticsModelEMA(model, decay=0.9999, tau=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(7):
        sgd_step(model, optimizer, i)
        ema.update(model)
    buffer = io.BytesIO()
    torch.save(
        {
            "epoch": 0,
            "best_fitness": None,
            "model": None,
            "ema": copy.deepcopy(ema.ema).half(),
            "updates": ema.updates,
            "optimizer": optimizer.state_dict(),
            "train_args": {"model": "yolo11n.yaml", "epochs": 1},
            "date": "2026-01-01T00:00:00",
            "version": "8.3.0",
        },
        buffer,
    )
    path = tmp_path / "last.pt"
    path.write_bytes(buffer.getvalue())

    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(make_net()), path)
    message = str(info.value)
    lines = [
        "ckpt = torch.load(path, weights_only=False)  # only if you trust it",
        "state = {'ema': ckpt['ema'].float().state_dict(), 'updates': ckpt['updates']}",
    ]
    assert "Ultralytics" in message and "ultralytics.nn.tasks.DetectionModel" in message
    for line in lines:
        assert f"\n    {line}\n" in message
    call = message.rsplit(": ", 1)[1]
    assert call == "load_foreign_state(ema, state['ema'], step=state['updates'] + 1)"

    scope: dict[str, Any] = {"torch": torch, "path": path}
    exec("\n".join(lines), scope)  # what the message says to run
    state = scope["state"]
    with pytest.raises(
        EMAStateError, match=r"(?s)whole DetectionModel model.*\n    state = "
    ) as info:
        load_foreign_state(EMA(make_net()), scope["ckpt"])  # the dict unpickled, passed
    assert str(info.value).startswith(
        "the checkpoint is an Ultralytics (YOLO) checkpoint: its 'ema' entry is a whole "
        "DetectionModel model, not a state"
    )
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(EMA(make_net()), state)  # the state itself, not its 'ema' entry
    assert str(info.value) == (
        "the checkpoint is an Ultralytics EMA state ('ema' and 'updates'): load its 'ema' "
        "entry with the step of Ultralytics' next update (its number updates + 1; emakit's "
        "first call copies): load_foreign_state(ema, state['ema'], step=state['updates'] + 1), "
        "state being this dict"
    )
    with pytest.raises(EMAStateError, match=r"Ultralytics EMA state.*step=state\['updates'\] \+ 1"):
        load_foreign_state(EMA(make_net()), state)  # the state, passed whole

    # Ultralytics' resume, and emakit's from the same state
    theirs = UltralyticsModelEMA(model, decay=0.9999, tau=20)
    theirs.ema.load_state_dict(state["ema"])
    theirs.updates = state["updates"]
    ours = EMA(
        model,
        schedule=lambda t: 0.9999 * (1 - math.exp(-t / 20)),  # Ultralytics' ramp
        update_after_step=0,
        update_every=1,
    )
    exec(call, {"load_foreign_state": load_foreign_state, "ema": ours, "state": state})
    assert int(ours.step) == 7 + 1
    sgd_step(model, optimizer, 99)
    theirs.update(model)
    ours.update()
    assert ours.get_current_decay() == theirs.decay(theirs.updates) == theirs.decay(8)
    assert_close(ours.ema_model.state_dict(), theirs.ema.state_dict())
