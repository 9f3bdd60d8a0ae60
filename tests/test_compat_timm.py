"""`emakit.compat.timm` against the real timm: the same numbers bit for bit after every update,
state dicts both ways, timm's own checkpoint functions, and timm's ``train.py`` EMA lines with
the one documented line. Skipped without timm (``python tools/install_peers.py`` installs it
beside a CPU torch)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from emakit.compat import timm as compat
from emakit.errors import EMAStateError, EMAValueError

model_ema = pytest.importorskip("timm.utils.model_ema")
timm_utils = pytest.importorskip("timm.utils")
timm_models = pytest.importorskip("timm.models")


def make_net(dtype: torch.dtype = torch.float32, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 3))
    return net.to(dtype)


def train_step(net: nn.Module, opt: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    x = torch.randn(16, 6, dtype=dtype)
    net(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def assert_same(a: dict, b: dict, where: str = "") -> None:
    assert list(a) == list(b), where
    for k in a:
        assert a[k].dtype == b[k].dtype, (where, k)
        assert torch.equal(a[k], b[k]), (where, k, (a[k].double() - b[k].double()).abs().max())


CASES = {
    "plain": ({"decay": 0.9}, torch.float32),
    "warmup": ({"decay": 0.99, "use_warmup": True, "update_after_step": 3, "min_decay": 0.1}, None),
    "exclude_buffers": ({"decay": 0.9, "exclude_buffers": True}, None),
    "device_str": ({"decay": 0.9, "device": "cpu"}, None),  # timm: foreach off for a str
    "bf16_stochastic": ({"decay": 0.9}, torch.bfloat16),
    "bf16_stochastic_loop": (
        {"decay": 0.9, "foreach": False, "stochastic_rounding_seed": 3},
        torch.bfloat16,
    ),
    "bf16_nearest": ({"decay": 0.9, "stochastic_rounding": False}, torch.bfloat16),
    "bf16_fp32_shadow": ({"decay": 0.9, "dtype": torch.float32}, torch.bfloat16),
    "bf16_fp32_shadow_loop": (
        {"decay": 0.9, "dtype": torch.float32, "foreach": False},
        torch.bfloat16,
    ),
    "bf16_no_buffers": ({"decay": 0.9, "exclude_buffers": True}, torch.bfloat16),
}


@pytest.mark.parametrize("with_step", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_timm_after_every_update(case, with_step):
    kwargs, dtype = CASES[case]
    dtype = dtype or torch.float32
    nets = [make_net(dtype), make_net(dtype)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs = model_ema.ModelEmaV3(nets[0], **kwargs)
    ours = compat.ModelEmaV3(nets[1], **kwargs)
    assert_same(theirs.state_dict(), ours.state_dict(), "start")
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    for step in range(1, 9):
        for net, opt in zip(nets, opts, strict=True):
            torch.manual_seed(step)
            train_step(net, opt, dtype)
        theirs.update(nets[0], step=step if with_step else None)
        ours.update(nets[1], step=step if with_step else None)
        assert_same(theirs.state_dict(), ours.state_dict(), f"step {step}")
    moved = [k for k, v in ours.state_dict().items() if not torch.equal(v, before[k])]
    assert "module.0.weight" in moved  # the comparison compared something that moved


def test_stochastic_rounding_batches_large_tensors_as_timm_does():
    """Tensors over 2**22 elements in all: timm splits its float32 batches there, and the
    random draws follow the batches."""
    net = make_net(torch.bfloat16, width=2100)
    net.append(nn.Linear(3, 2100).to(torch.bfloat16))
    net.append(nn.Linear(2100, 2000).to(torch.bfloat16))  # 4.2M elements: its own batch
    nets = [net, copy.deepcopy(net)]
    theirs = model_ema.ModelEmaV3(nets[0], decay=0.5)
    ours = compat.ModelEmaV3(nets[1], decay=0.5)
    for step in range(1, 3):
        for net in nets:
            torch.manual_seed(step)
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
        theirs.update(nets[0], step=step)
        ours.update(nets[1], step=step)
    assert_same(theirs.state_dict(), ours.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_ema_v2_bit_identical(dtype):
    nets = [make_net(dtype), make_net(dtype)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs, ours = model_ema.ModelEmaV2(nets[0], decay=0.9), compat.ModelEmaV2(nets[1], decay=0.9)
    for step in range(8):
        for net, opt in zip(nets, opts, strict=True):
            torch.manual_seed(step)
            train_step(net, opt, dtype)
        theirs.update(nets[0])
        ours.update(nets[1])
        assert_same(theirs.state_dict(), ours.state_dict(), f"step {step}")
    theirs.set(nets[0])
    ours.set(nets[1])
    assert_same(theirs.state_dict(), ours.state_dict(), "set")
    assert_same(ours.module.state_dict(), nets[1].state_dict(), "set copies")


def test_surface_matches_timm():
    import inspect

    for name in ("ModelEmaV3", "ModelEmaV2"):
        theirs = inspect.signature(getattr(model_ema, name))
        ours = inspect.signature(getattr(compat, name))
        shared = [p for p in ours.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [(p.name, p.default) for p in shared] == [
            (p.name, p.default) for p in theirs.parameters.values()
        ], name
    for method in ("update", "set", "get_decay", "forward"):
        assert hasattr(compat.ModelEmaV3, method)
    theirs = model_ema.ModelEmaV3(make_net(), use_warmup=True, decay=0.999, update_after_step=2)
    ours = compat.ModelEmaV3(make_net(), use_warmup=True, decay=0.999, update_after_step=2)
    for step in [None, 0, 1, 3, 4, 10, 10**6]:
        assert ours.get_decay(step) == theirs.get_decay(step), step


def test_state_dicts_load_both_ways_and_keep_updating_alike():
    nets = [make_net(), make_net()]
    theirs, ours = model_ema.ModelEmaV3(nets[0], decay=0.8), compat.ModelEmaV3(nets[1], decay=0.8)
    for step in range(1, 4):
        torch.manual_seed(step)
        train_step(nets[0], torch.optim.SGD(nets[0].parameters(), lr=0.1), torch.float32)
        theirs.update(nets[0], step=step)
    nets[1].load_state_dict(nets[0].state_dict())
    ours.load_state_dict(theirs.state_dict())  # timm's -> ours, strict
    assert_same(theirs.state_dict(), ours.state_dict(), "timm -> emakit")
    back = model_ema.ModelEmaV3(make_net(), decay=0.8)
    back.load_state_dict(ours.state_dict())  # ours -> timm's, strict
    assert_same(back.state_dict(), ours.state_dict(), "emakit -> timm")
    for net in nets:  # the loaded EMA keeps averaging where timm's does
        with torch.no_grad():
            net[0].weight.add_(1.0)
    theirs.update(nets[0], step=4)
    ours.update(nets[1], step=4)
    assert_same(theirs.state_dict(), ours.state_dict(), "after the load")


def test_timm_checkpoint_functions_read_and_write_it(tmp_path):
    net = make_net()
    ours = compat.ModelEmaV3(net, decay=0.5)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    ours.update(net)
    assert timm_utils.unwrap_model(ours) is ours.module
    ema_state = timm_utils.get_state_dict(ours)
    assert set(ema_state) == set(net.state_dict())  # the model's names, as timm saves them
    path = tmp_path / "last.pth.tar"
    torch.save({"state_dict": net.state_dict(), "state_dict_ema": ema_state, "epoch": 1}, path)
    fresh = make_net()
    timm_models.load_checkpoint(fresh, str(path), use_ema=True)  # timm's validate.py path
    assert_same(fresh.state_dict(), ours.module.state_dict())
    timm_ema = model_ema.ModelEmaV3(make_net())
    timm_ema.module.load_state_dict(torch.load(path)["state_dict_ema"])
    assert_same(timm_ema.state_dict(), ours.state_dict())


def test_another_structure_raises_instead_of_zipping():
    ours = compat.ModelEmaV3(make_net())
    with pytest.raises(EMAStateError, match="does not match the EMA copy"):
        ours.update(nn.Sequential(nn.Linear(6, 8)))


def test_skip_nonfinite_extra_and_its_refusal():
    net = make_net()
    ours = compat.ModelEmaV3(net, decay=0.5, skip_nonfinite=True)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    ours.update(net)
    assert_same(before, ours.state_dict())
    with pytest.raises(EMAValueError, match="stochastic_rounding=False"):
        compat.ModelEmaV3(make_net(torch.bfloat16), skip_nonfinite=True)


def test_train_py_ema_lines_with_the_one_documented_line(tmp_path, monkeypatch):
    """timm's train.py: ``task.setup_ema(...)`` (after resume), ``task.update_ema(step=
    num_updates)`` after each optimizer step, the CheckpointSaver, ``--resume`` through
    ``load_task_ema_checkpoint``. Run once with timm's class and once after the line the
    migration guide documents; the EMA weights and the saved files must agree bit for bit."""
    task_mod = pytest.importorskip("timm.task")
    import timm.task.task as task_module

    def run(out, resume_from=None):
        out.mkdir()
        net = make_net()
        task = task_mod.ClassificationTask(net, nn.CrossEntropyLoss(), verbose=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        task.setup_ema(decay=0.99, use_warmup=True, device=None)
        if resume_from is not None:
            task_mod.load_task_ema_checkpoint(task, resume_from)
        saver = timm_utils.CheckpointSaver(
            model=net, optimizer=opt, checkpoint_dir=str(out), recovery_dir=str(out), task=task
        )
        num_updates = 0
        torch.manual_seed(0)
        for _ in range(6):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            task(x, y)["loss"].backward()
            opt.step()
            num_updates += 1  # noqa: SIM113 - train.py's own lines
            opt.zero_grad()
            task.update_ema(step=num_updates)
        saver.save_checkpoint(epoch=0, metric=1.0)
        return task.get_trainable_module(ema=True), out / "last.pth.tar"

    theirs, their_file = run(tmp_path / "timm")
    monkeypatch.setattr(task_module, "ModelEmaV3", compat.ModelEmaV3)  # the documented line
    ours, our_file = run(tmp_path / "emakit")
    assert isinstance(ours, compat.ModelEmaV3)
    assert_same(theirs.state_dict(), ours.state_dict(), "after training")
    assert_same(torch.load(their_file)["state_dict_ema"], torch.load(our_file)["state_dict_ema"])
    resumed, _ = run(tmp_path / "resumed", resume_from=their_file)  # --resume of timm's file
    monkeypatch.undo()
    resumed_by_timm, _ = run(tmp_path / "resumed_timm", resume_from=our_file)
    assert_same(resumed.state_dict(), resumed_by_timm.state_dict(), "resume")
    fresh = make_net()
    timm_models.load_checkpoint(fresh, str(our_file), use_ema=True)
    assert_same(fresh.state_dict(), ours.module.state_dict())
