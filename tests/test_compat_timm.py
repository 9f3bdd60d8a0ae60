"""`emakit.compat.timm` against the real timm: the same numbers bit for bit after every update,
state dicts both ways, timm's own checkpoint functions, timm's ``train.py`` EMA lines with
the documented lines, and DeiT's ``main.py`` EMA lines on the V1 ``ModelEma``. Skipped
without timm (``python tools/install_peers.py`` installs it beside a CPU torch)."""

from __future__ import annotations

import argparse
import copy
import io
import logging

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
    # a float32 EMA of a bfloat16 model: foreach (timm's mul_/add_) unless device= is a str,
    # which never equals the model's torch.device, so timm turns foreach off (cast, lerp_)
    "bf16_fp32_shadow_device_str": (
        {"decay": 0.9, "dtype": torch.float32, "device": "cpu"},
        torch.bfloat16,
    ),
    "bf16_fp32_shadow_device_obj": (
        {"decay": 0.9, "dtype": torch.float32, "device": torch.device("cpu")},
        torch.bfloat16,
    ),
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


@pytest.mark.parametrize("case", list(CASES))
def test_settings_read_back_as_timms(case):
    """The public attributes timm sets, ours the same (``foreach`` off for a ``device``
    given as a str, which never equals the model's ``torch.device``)."""
    kwargs, dtype = CASES[case]
    theirs = model_ema.ModelEmaV3(make_net(dtype or torch.float32), **kwargs)
    ours = compat.ModelEmaV3(make_net(dtype or torch.float32), **kwargs)
    settings = {k: v for k, v in vars(theirs).items() if not k.startswith("_")}
    assert {k: getattr(ours, k) for k in settings} == settings


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


def bf16_and_fp32_net() -> nn.Module:
    """`make_net()` in bfloat16 but its last layer, in float32."""
    net = make_net(torch.bfloat16)
    net[3].float()
    return net


@pytest.mark.parametrize("foreach", [True, False])
def test_a_model_of_bfloat16_and_float32_tensors_bit_identical(foreach):
    """One update with both: stochastic rounding for the bfloat16 tensors, a plain
    ``lerp_`` (one foreach lerp with ``foreach``) for the float32 ones, as timm's."""
    nets = [bf16_and_fp32_net(), bf16_and_fp32_net()]
    theirs = model_ema.ModelEmaV3(nets[0], decay=0.9, foreach=foreach)
    ours = compat.ModelEmaV3(nets[1], decay=0.9, foreach=foreach)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    for step in range(1, 4):
        for net in nets:
            with torch.no_grad():
                for i, p in enumerate(net.parameters()):
                    g = torch.Generator().manual_seed(10 * step + i)
                    p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        theirs.update(nets[0])
        ours.update(nets[1])
        assert_same(theirs.state_dict(), ours.state_dict(), f"step {step}")
    after = ours.state_dict()
    assert after["module.3.weight"].dtype == torch.float32
    assert after["module.0.weight"].dtype == torch.bfloat16
    for k in ("module.0.weight", "module.3.weight"):
        assert not torch.equal(after[k], before[k]), k


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"warmup_gamma": 2.0},
        {"warmup_gamma": 0.5, "warmup_power": 0.75, "min_decay": 0.1},
        {"warmup_gamma": 4.0, "warmup_power": 1.0, "update_after_step": 3},
    ],
)
def test_get_decay_is_timms_with_other_warmup_settings(kwargs):
    """The warm-up's ``gamma`` divides the step, its power is the exponent: timm's decay,
    as the same float, at every step."""
    theirs = model_ema.ModelEmaV3(make_net(), decay=0.9999, use_warmup=True, **kwargs)
    ours = compat.ModelEmaV3(make_net(), decay=0.9999, use_warmup=True, **kwargs)
    decays = [ours.get_decay(step) for step in range(40)]
    assert decays == [theirs.get_decay(step) for step in range(40)]
    assert len(set(decays)) > 30  # a ramp, not a constant


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
    ours = compat.ModelEmaV3(nn.Sequential(nn.Linear(2, 2), nn.Identity()))
    renamed = nn.Sequential()
    renamed.add_module("0", nn.Identity())
    renamed.add_module("x", nn.Linear(2, 2))
    with pytest.raises(EMAStateError) as info:
        ours.update(renamed)
    assert str(info.value) == (
        "the model does not match the EMA copy: names missing from the model ['0.weight', "
        "'0.bias'] (2), names the EMA copy lacks ['x.weight', 'x.bias'] (2) (or the order "
        "differs); update() and set() take the model the EMA was built from"
    )


def test_skip_nonfinite_extra_and_its_refusal():
    net = make_net()
    ours = compat.ModelEmaV3(net, decay=0.5, skip_nonfinite=True)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    ours.update(net)
    assert_same(before, ours.state_dict())
    with pytest.raises(EMAValueError) as info:
        compat.ModelEmaV3(make_net(torch.bfloat16), skip_nonfinite=True)
    assert str(info.value) == (
        "skip_nonfinite=True runs on emakit's engine, which this EMA cannot use: its "
        "bfloat16 tensors take stochastic rounding, or its dtype differs from the "
        "model's with foreach=True; pass stochastic_rounding=False, or dtype= with "
        "foreach=False, or leave skip_nonfinite=False"
    )


#: What the migration guide tells timm's ``train.py`` users to add after the script's imports.
TRAIN_PY_LINES = """\
import timm.task.task
import emakit.compat.timm
timm.task.task.ModelEmaV3 = emakit.compat.timm.ModelEmaV3
"""
#: The names timm's ``train.py`` (main, 2026) imports from timm: it binds no name ``timm``.
TRAIN_PY_IMPORTS = """\
from timm import utils
from timm.models import create_model, safe_model_name
from timm.task import ClassificationTask, resume_task_checkpoint, load_task_ema_checkpoint
"""


def run_documented_lines(monkeypatch) -> dict:
    """``TRAIN_PY_LINES`` executed where train.py's imports are (undone by ``monkeypatch``
    at the end of the test); returns that namespace."""
    import timm.task.task as task_module

    monkeypatch.setattr(task_module, "ModelEmaV3", task_module.ModelEmaV3)  # restored after
    script: dict = {"__name__": "train"}
    exec(TRAIN_PY_IMPORTS, script)
    exec(TRAIN_PY_LINES, script)
    return script


def test_documented_train_py_lines_switch_the_class_train_py_builds(monkeypatch):
    """The lines run as written after train.py's imports (the earlier one-line version
    raised NameError there: train.py binds no ``timm``), and ``task.setup_ema`` then builds
    emakit's class, as train.py calls it."""
    pytest.importorskip("timm.task")
    import timm.task.task as task_module

    monkeypatch.setattr(task_module, "ModelEmaV3", task_module.ModelEmaV3)  # restored after
    script: dict = {"__name__": "train"}
    exec(TRAIN_PY_IMPORTS, script)
    with pytest.raises(NameError, match="'timm'"):  # the line documented before
        exec("import emakit.compat.timm\n" + TRAIN_PY_LINES.splitlines()[-1], script)
    script = run_documented_lines(monkeypatch)
    task = script["ClassificationTask"](make_net(), nn.CrossEntropyLoss(), verbose=False)
    task.setup_ema(decay=0.99, use_warmup=True, device=None)  # train.py's call
    assert type(task.get_trainable_module(ema=True)) is compat.ModelEmaV3
    monkeypatch.undo()
    task.setup_ema(decay=0.99)
    assert type(task.get_trainable_module(ema=True)) is model_ema.ModelEmaV3


def test_train_py_ema_lines_with_the_documented_lines(tmp_path, monkeypatch):
    """timm's train.py: ``task.setup_ema(...)`` (after resume), ``task.update_ema(step=
    num_updates)`` after each optimizer step, the CheckpointSaver, ``--resume`` through
    ``load_task_ema_checkpoint``. Run once with timm's class and once after the lines the
    migration guide documents; the EMA weights and the saved files must agree bit for bit."""
    task_mod = pytest.importorskip("timm.task")

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
    run_documented_lines(monkeypatch)
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


# -- the V1 ModelEma (DeiT, older timm scripts) --------------------------------------------


def sgd_steps(nets, opts, dtype, steps):
    for step in steps:
        for net, opt in zip(nets, opts, strict=True):
            torch.manual_seed(step)
            train_step(net, opt, dtype)
        yield step


@pytest.mark.parametrize("device", ["", "cpu", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_ema_v1_bit_identical(dtype, device):
    nets = [make_net(dtype), make_net(dtype)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    kwargs = {} if device is None else {"device": device}
    theirs, ours = (
        model_ema.ModelEma(nets[0], 0.9, **kwargs),
        compat.ModelEma(nets[1], 0.9, **kwargs),
    )
    for attr in ("decay", "device", "ema_has_module"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert not any(p.requires_grad for p in ours.ema.parameters())
    assert not ours.ema.training
    for step in sgd_steps(nets, opts, dtype, range(8)):
        theirs.update(nets[0])
        ours.update(nets[1])
        assert_same(theirs.ema.state_dict(), ours.ema.state_dict(), f"step {step}")
    assert not torch.equal(ours.ema[0].weight, nets[1][0].weight)  # averaged, not copied


def test_model_ema_v1_update_takes_the_wrapped_model():
    """Built before the DDP wrap (DeiT, timm's advice), updated with the wrapped model:
    timm prefixes ``module.`` to each name, ours takes ``.module``; the same numbers."""
    nets = [make_net(), make_net()]
    theirs, ours = model_ema.ModelEma(nets[0], 0.9), compat.ModelEma(nets[1], 0.9)
    for net in nets:
        with torch.no_grad():
            net[0].weight.add_(1.0)
    theirs.update(nn.DataParallel(nets[0]))  # DDP's .module, on the CPU
    ours.update(nn.DataParallel(nets[1]))
    assert not ours.ema_has_module
    assert_same(theirs.ema.state_dict(), ours.ema.state_dict())
    assert not torch.equal(ours.ema[0].weight, nets[1][0].weight)


def test_model_ema_v1_surface_and_state_dicts_both_ways():
    import inspect

    theirs = inspect.signature(model_ema.ModelEma)
    ours = inspect.signature(compat.ModelEma)
    assert [(p.name, p.default) for p in ours.parameters.values()] == [
        (p.name, p.default) for p in theirs.parameters.values()
    ]
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs, ours = model_ema.ModelEma(nets[0], 0.8), compat.ModelEma(nets[1], 0.8)
    for _ in sgd_steps(nets, opts, torch.float32, range(3)):
        theirs.update(nets[0])
    assert_same(timm_utils.get_state_dict(ours), ours.ema.state_dict())  # timm's function
    ours.load_state_dict(timm_utils.get_state_dict(theirs))  # timm's -> ours
    assert_same(ours.ema.state_dict(), theirs.ema.state_dict(), "timm -> emakit")
    back = model_ema.ModelEma(make_net(), 0.8)
    back.ema.load_state_dict(timm_utils.get_state_dict(ours))  # ours -> timm's
    assert_same(back.ema.state_dict(), ours.ema.state_dict(), "emakit -> timm")
    nets[1].load_state_dict(nets[0].state_dict())
    for _ in sgd_steps(nets, opts, torch.float32, range(3, 5)):
        for ema, net in ((theirs, nets[0]), (ours, nets[1]), (back, nets[1])):
            ema.update(net)
    assert_same(theirs.ema.state_dict(), ours.ema.state_dict(), "after the load")
    assert_same(back.ema.state_dict(), ours.ema.state_dict(), "after the load, back")


def test_model_ema_v2_accepts_an_empty_device_as_v1_does():
    """timm's V1 takes ``device=''`` for "the model's device"; its V2 raises on it, ours
    takes it as V1 does (and as ``None``)."""
    with pytest.raises(RuntimeError, match="empty"):
        model_ema.ModelEmaV2(make_net(), device="")
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs, ours = model_ema.ModelEmaV2(nets[0], 0.9), compat.ModelEmaV2(nets[1], 0.9, device="")
    assert ours.device == ""
    for _ in sgd_steps(nets, opts, torch.float32, range(4)):
        theirs.update(nets[0])
        ours.update(nets[1])
    assert_same(theirs.state_dict(), ours.state_dict())
    ours.set(nets[1])
    assert_same(ours.module.state_dict(), nets[1].state_dict())


def timm_last_checkpoint(out, net, ema) -> str:
    """``last.pth.tar`` as timm's train.py writes it: ``CheckpointSaver`` with its
    ``argparse.Namespace`` of arguments and ``model_ema`` (timm's class or ours)."""
    args = argparse.Namespace(model="mlp", model_ema=True, model_ema_decay=0.8, lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    saver = timm_utils.CheckpointSaver(
        net, opt, args=args, model_ema=ema, checkpoint_dir=str(out), recovery_dir=str(out)
    )
    saver.save_checkpoint(epoch=0, metric=1.0)
    return str(out / "last.pth.tar")


@pytest.mark.parametrize("wrap", [False, True])
def test_model_ema_v1_resume_from_a_timm_checkpoint_both_ways(tmp_path, wrap):
    """``ModelEma(model, resume=path)`` on ``CheckpointSaver``'s ``last.pth.tar`` (with its
    ``argparse.Namespace``): a file written with timm's class read by ours and the other
    way round; with a ``DataParallel``-wrapped model, ``module.`` is added as timm does."""
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs, ours = model_ema.ModelEma(nets[0], 0.8), compat.ModelEma(nets[1], 0.8)
    for _ in sgd_steps(nets, opts, torch.float32, range(4)):
        theirs.update(nets[0])
        ours.update(nets[1])
    (tmp_path / "timm").mkdir()
    (tmp_path / "emakit").mkdir()
    their_file = timm_last_checkpoint(tmp_path / "timm", nets[0], theirs)
    our_file = timm_last_checkpoint(tmp_path / "emakit", nets[1], ours)
    assert isinstance(torch.load(our_file, weights_only=False)["args"], argparse.Namespace)

    def fresh():
        return nn.DataParallel(make_net()) if wrap else make_net()

    resumed = {
        "timm <- timm": model_ema.ModelEma(fresh(), 0.8, resume=their_file),
        "timm <- emakit": model_ema.ModelEma(fresh(), 0.8, resume=our_file),
        "emakit <- timm": compat.ModelEma(fresh(), 0.8, resume=their_file),
        "emakit <- emakit": compat.ModelEma(fresh(), 0.8, resume=our_file),
    }
    assert resumed["emakit <- timm"].ema_has_module is wrap
    expected = resumed["timm <- timm"].ema.state_dict()
    assert next(iter(expected)).startswith("module.") is wrap
    for name, ema in resumed.items():
        assert_same(ema.ema.state_dict(), expected, name)
        assert not any(p.requires_grad for p in ema.ema.parameters()), name
    assert_same(timm_utils.get_state_dict(resumed["emakit <- timm"]), theirs.ema.state_dict())


def test_model_ema_v1_checkpoint_without_an_ema_keeps_the_weights(tmp_path, caplog):
    """A checkpoint with no ``state_dict_ema`` (and not a state dict itself): timm logs a
    warning and goes on with the weights the EMA was built from; so does ours, warning."""
    path = tmp_path / "model_only.pth"
    torch.save({"state_dict": make_net().state_dict(), "epoch": 3}, path)
    with caplog.at_level(logging.WARNING):
        theirs = model_ema.ModelEma(make_net(), resume=str(path))
    assert "Failed to find state_dict_ema" in caplog.text
    with pytest.warns(UserWarning, match="no 'state_dict_ema' entry.*keeps the weights"):
        ours = compat.ModelEma(make_net(), resume=str(path))
    assert_same(ours.ema.state_dict(), theirs.ema.state_dict())
    other = tmp_path / "other.pth"
    torch.save({"state_dict_ema": nn.Linear(2, 2).state_dict()}, other)
    with pytest.raises(EMAStateError, match="does not hold this model's EMA"):
        compat.ModelEma(make_net(), resume=str(other))


# DeiT's main.py and utils.py, their EMA lines (facebookresearch/deit), written from what
# they do: main.py builds ModelEma(model, decay=args.model_ema_decay, device='cpu' if
# args.model_ema_force_cpu else '', resume='') before DDP, train_one_epoch calls
# model_ema.update(model) after every optimizer step, each epoch saves
# {'model', 'optimizer', 'lr_scheduler', 'epoch', 'model_ema': get_state_dict(model_ema),
# 'args'}, and --resume loads 'model' then utils._load_checkpoint_for_ema(model_ema,
# checkpoint['model_ema']), which torch.saves that state dict into an io.BytesIO, seeks to 0
# and passes it to model_ema._load_checkpoint.

DEIT_EPOCHS, DEIT_BATCHES = 3, 4


def load_checkpoint_for_ema(model_ema, checkpoint):
    """DeiT's ``utils._load_checkpoint_for_ema``."""
    mem_file = io.BytesIO()
    torch.save(checkpoint, mem_file)
    mem_file.seek(0)
    model_ema._load_checkpoint(mem_file)


def deit_main(cls, out, resume=None, force_cpu=False):
    """DeiT's EMA lines with ``cls`` as ``ModelEma``: train to ``DEIT_EPOCHS`` (from the
    checkpoint ``resume`` when given), saving ``out/checkpoint.pth`` every epoch. Returns
    the EMA."""
    args = argparse.Namespace(model_ema_decay=0.9, model_ema_force_cpu=force_cpu, resume=resume)
    model = make_net()
    model_ema = cls(
        model,
        decay=args.model_ema_decay,
        device="cpu" if args.model_ema_force_cpu else "",
        resume="",
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)  # DeiT's
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1
        load_checkpoint_for_ema(model_ema, checkpoint["model_ema"])
    for epoch in range(start_epoch, DEIT_EPOCHS):
        model.train()
        for i in range(DEIT_BATCHES):
            data = torch.Generator().manual_seed(100 * epoch + i)
            x, y = torch.randn(16, 6, generator=data), torch.randint(0, 3, (16,), generator=data)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            model_ema.update(model)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "lr_scheduler": {},
                "epoch": epoch,
                "model_ema": timm_utils.get_state_dict(model_ema),
                "args": args,
            },
            out / f"checkpoint_{epoch}.pth",
        )
    return model_ema


@pytest.mark.parametrize("force_cpu", [False, True])
def test_deit_ema_lines_bit_identical_and_resume_restores_the_ema(tmp_path, caplog, force_cpu):
    """DeiT's run with timm's ``ModelEma`` and with ours: the same EMA and the same files,
    bit for bit. Resumed after epoch 0 from either run's file, ours continues exactly as the
    uninterrupted run; timm's ``_load_checkpoint`` finds no ``state_dict_ema`` in what DeiT
    passes it, logs so, and goes on from the weights it was built with
    (facebookresearch/deit#173): the one difference, on purpose."""
    runs = {}
    for name, cls in (("timm", model_ema.ModelEma), ("emakit", compat.ModelEma)):
        (tmp_path / name).mkdir()
        runs[name] = deit_main(cls, tmp_path / name, force_cpu=force_cpu)
    assert_same(runs["timm"].ema.state_dict(), runs["emakit"].ema.state_dict(), "uninterrupted")
    for epoch in range(DEIT_EPOCHS):
        files = [
            torch.load(tmp_path / n / f"checkpoint_{epoch}.pth", weights_only=False) for n in runs
        ]
        assert_same(files[0]["model_ema"], files[1]["model_ema"], f"epoch {epoch} file")
    expected = runs["timm"].ema.state_dict()
    for written_by in runs:
        out = tmp_path / f"emakit_from_{written_by}"
        out.mkdir()
        resumed = deit_main(
            compat.ModelEma,
            out,
            resume=tmp_path / written_by / "checkpoint_0.pth",
            force_cpu=force_cpu,
        )
        assert_same(resumed.ema.state_dict(), expected, f"ours resumed from {written_by}'s file")
    (tmp_path / "timm_resumed").mkdir()
    with caplog.at_level(logging.WARNING):
        theirs = deit_main(
            model_ema.ModelEma,
            tmp_path / "timm_resumed",
            resume=tmp_path / "emakit" / "checkpoint_0.pth",
            force_cpu=force_cpu,
        )
    assert "Failed to find state_dict_ema" in caplog.text
    assert not torch.equal(theirs.ema[0].weight, expected["0.weight"])  # its EMA restarted


class Tensors(nn.Module):
    """Bare bfloat16 parameters of the given sizes, in order (no forward: the EMA only
    reads the state dict)."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(n, generator=g).to(torch.bfloat16)) for n in sizes
        )


#: Sizes around timm's batch limit of 2**22 elements: the first alone (over the limit),
#: the next two exactly at it (one batch), the last two together just over it.
SR_SIZES = [2**22 + 1, 3, 2**22 - 3, 1, 2]
SR_BATCHES = {True: [2**22 + 1, 2**22, 3], False: SR_SIZES}  # foreach: batched; else per tensor


@pytest.mark.parametrize(
    ("kwargs", "foreach"),
    [
        ({}, True),
        ({"foreach": False}, False),
        ({"device": "cpu"}, False),  # a str device: timm turns foreach off
        ({"device": torch.device("cpu")}, True),
    ],
    ids=["foreach", "loop", "device_str", "device_obj"],
)
def test_stochastic_rounding_draws_in_timms_batches(monkeypatch, kwargs, foreach):
    """The random bits of stochastic rounding are drawn in the float32 batches timm forms
    (whole tensors, at most 2**22 elements, or one tensor at a time without foreach): on
    a CPU the stream is the same however it is cut, on CUDA each draw starts at a new
    offset, so the numbers follow the batches only when the batches are timm's."""
    nets = [Tensors(SR_SIZES), Tensors(SR_SIZES)]
    theirs = model_ema.ModelEmaV3(nets[0], decay=0.5, **kwargs)
    ours = compat.ModelEmaV3(nets[1], decay=0.5, **kwargs)
    draws: list[list[int]] = [[], []]
    kinds: list[set] = [set(), set()]  # the noise's dtype and device
    real = torch.randint

    def randint(*args, **kw):
        draws[which].append(args[2].numel() if isinstance(args[2], torch.Size) else args[2])
        noise = real(*args, **kw)
        kinds[which].add((noise.dtype, noise.device))
        return noise

    monkeypatch.setattr(torch, "randint", randint)
    for step in range(1, 3):
        for net in nets:
            with torch.no_grad():
                for i, p in enumerate(net.parameters()):
                    p.add_(0.01 * (i + step))
        which = 0
        theirs.update(nets[0], step=step)
        which = 1
        ours.update(nets[1], step=step)
    assert draws[0] == SR_BATCHES[foreach] * 2
    assert draws[1] == draws[0]
    assert kinds[1] == kinds[0] == {(torch.int32, torch.device("cpu"))}
    assert_same(theirs.state_dict(), ours.state_dict())


def test_skip_nonfinite_where_the_refusal_says_it_runs():
    """The refusal names dtype= with foreach=False: that EMA runs on the engine, so it
    takes skip_nonfinite, and its numbers are timm's."""
    kwargs = {"decay": 0.9, "dtype": torch.float32}
    with pytest.raises(EMAValueError, match="foreach=False"):
        compat.ModelEmaV3(make_net(torch.bfloat16), skip_nonfinite=True, **kwargs)
    nets = [make_net(torch.bfloat16), make_net(torch.bfloat16)]
    theirs = model_ema.ModelEmaV3(nets[0], foreach=False, **kwargs)
    ours = compat.ModelEmaV3(nets[1], foreach=False, skip_nonfinite=True, **kwargs)
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    for step in range(1, 4):
        for net, opt in zip(nets, opts, strict=True):
            torch.manual_seed(step)
            train_step(net, opt, torch.bfloat16)
        theirs.update(nets[0], step=step)
        ours.update(nets[1], step=step)
    assert_same(theirs.state_dict(), ours.state_dict())
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        nets[1][0].weight[0, 0] = float("nan")
    ours.update(nets[1], step=4)
    assert_same(before, ours.state_dict())  # skipped
