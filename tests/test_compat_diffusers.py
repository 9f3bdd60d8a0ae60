"""``emakit.compat.diffusers.EMAModel`` against the real diffusers ``EMAModel``.

The same training run drives both; after every step the decays must be equal (the same
Python float) and the weights equal to float32 rounding: diffusers computes
``s - (1 - d) * (s - p)``, emakit ``lerp_``, and the two round the last bit differently
now and then, as diffusers' own ``foreach=True`` and ``foreach=False`` paths do (shown
below). States and ``save_pretrained`` folders go both ways through diffusers' own
``load_state_dict`` and ``EMAModel.from_pretrained`` with a tiny ``UNet2DModel``, and the
EMA lines of diffusers' ``examples/unconditional_image_generation/train_unconditional.py``
run with only the import changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from _frameworks import need
from emakit import EMA, EMARuntimeError, EMAStateError, EMATypeError, EMAValueError
from emakit.compat.diffusers import EMAModel
from emakit.foreign import load_foreign_state

training_utils = need("diffusers.training_utils")
diffusers = need("diffusers")
Theirs = training_utils.EMAModel

#: Per tensor, |ours - theirs| stays within this many float32 epsilons of the tensor's
#: largest |weight| (diffusers' two paths differ from each other by as much).
ROUNDING_EPS = 4
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated.*:FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))


def tiny_unet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )


def noisy_sgd(net: nn.Module, steps: int, after_step: Callable[[int], None], seed: int = 1) -> None:
    """``steps`` SGD steps with gradient noise; ``after_step(k)`` after the ``k``-th."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for k in range(1, steps + 1):
        loss = sum(p.pow(2).sum() for p in net.parameters()) * 1e-2
        loss.backward()
        for p in net.parameters():
            p.grad.add_(torch.randn(p.shape, generator=gen), alpha=0.05)
        opt.step()
        opt.zero_grad()
        after_step(k)


def rounding_ratio(theirs: list[Tensor], ours: list[Tensor]) -> float:
    """The largest per-tensor |difference| over ``eps * max |weight|``."""
    ratio = 0.0
    for a, b in zip(theirs, ours, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        diff = (a - b).abs().max().item()
        scale = torch.finfo(a.dtype).eps * max(a.abs().max().item(), b.abs().max().item())
        ratio = max(ratio, diff / scale if diff else 0.0)
    return ratio


def same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


SETTINGS = [
    {},
    {"decay": 0.999, "use_ema_warmup": True, "power": 3 / 4},
    {"decay": 0.99, "update_after_step": 5, "min_decay": 0.5},
    {"decay": 0.9, "use_ema_warmup": True, "inv_gamma": 2, "power": 1, "update_after_step": 3},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s.items())))
def test_training_run_same_decays_and_weights_to_rounding(settings):
    net = mlp()
    theirs = Theirs(net.parameters(), **settings)
    theirs_foreach = Theirs(net.parameters(), foreach=True, **settings)
    ours = EMAModel(net.parameters(), **settings)
    paths = 0.0

    def both(k: int) -> None:
        nonlocal paths
        for ema in (theirs, theirs_foreach, ours):
            ema.step(net.parameters())
        assert ours.cur_decay_value == theirs.cur_decay_value, k
        assert ours.optimization_step == theirs.optimization_step == k
        assert rounding_ratio(theirs.shadow_params, ours.shadow_params) <= ROUNDING_EPS, k
        paths = max(paths, rounding_ratio(theirs.shadow_params, theirs_foreach.shadow_params))

    noisy_sgd(net, 200, both)
    assert ours.get_decay(10**6) == theirs.get_decay(10**6)
    assert paths > 0  # diffusers' own two paths differ in the last bit too


def test_state_dicts_both_ways_then_train_on():
    net = mlp()
    theirs = Theirs(net.parameters(), decay=0.999, use_ema_warmup=True)
    noisy_sgd(net, 20, lambda k: theirs.step(net.parameters()))
    # theirs -> ours: the same state, and the next steps agree
    ours = EMAModel(net.parameters())
    ours.load_state_dict(theirs.state_dict())
    assert ours.optimization_step == 20 and ours.use_ema_warmup and ours.decay == 0.999
    assert same(ours.shadow_params, theirs.shadow_params)
    # ours -> theirs: diffusers' own load_state_dict takes our state as it is
    back = Theirs(net.parameters())
    back.load_state_dict(ours.state_dict())
    assert back.optimization_step == 20 and back.use_ema_warmup
    assert same(back.shadow_params, ours.shadow_params)
    assert ours.state_dict().keys() == theirs.state_dict().keys()

    def all_three(k: int) -> None:
        for ema in (theirs, ours, back):
            ema.step(net.parameters())
        assert ours.cur_decay_value == theirs.cur_decay_value == back.cur_decay_value
        assert rounding_ratio(theirs.shadow_params, ours.shadow_params) <= ROUNDING_EPS
        assert rounding_ratio(back.shadow_params, ours.shadow_params) <= ROUNDING_EPS

    noisy_sgd(net, 20, all_three, seed=3)
    assert ours.optimization_step == back.optimization_step == 40


def test_folders_both_ways_through_from_pretrained(tmp_path):
    """An emakit folder loads in diffusers' ``EMAModel.from_pretrained`` with its
    ``optimization_step`` and settings, and diffusers' folder loads in ours."""
    unet = tiny_unet()
    kw = {"decay": 0.995, "use_ema_warmup": True, "power": 3 / 4, "update_after_step": 2}
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config, **kw)
    theirs = Theirs(unet.parameters(), model_cls=type(unet), model_config=unet.config, **kw)
    noisy_sgd(unet, 7, lambda k: (ours.step(unet.parameters()), theirs.step(unet.parameters())))

    ours.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["optimization_step"] == 7 and config["power"] == 0.75
    read_by_diffusers = Theirs.from_pretrained(tmp_path / "ours", type(unet))
    assert read_by_diffusers.optimization_step == 7
    assert read_by_diffusers.update_after_step == 2 and read_by_diffusers.use_ema_warmup
    assert read_by_diffusers.get_decay(50) == ours.get_decay(50)
    assert same(read_by_diffusers.shadow_params, ours.shadow_params)
    plain = EMA(tiny_unet(seed=3), update_after_step=0, update_every=1)  # and emakit's reader
    assert load_foreign_state(plain, tmp_path / "ours") == "diffusers"
    assert int(plain.step) == 7
    assert same(list(plain.ema_model.parameters()), ours.shadow_params)

    theirs.save_pretrained(tmp_path / "theirs")
    read_by_us = EMAModel.from_pretrained(tmp_path / "theirs", type(unet))
    assert isinstance(read_by_us, EMAModel)
    assert read_by_us.optimization_step == 7 and read_by_us.update_after_step == 2
    assert read_by_us.model_cls is type(unet)
    assert same(read_by_us.shadow_params, theirs.shadow_params)
    # the loaded EMA steps on with the training model's parameters (other objects)
    read_by_us.step(unet.parameters())
    theirs.step(unet.parameters())
    assert read_by_us.optimization_step == 8
    assert rounding_ratio(theirs.shadow_params, read_by_us.shadow_params) <= ROUNDING_EPS
    # a plain model folder has no optimization_step: said, and the EMA starts at 0
    unet.save_pretrained(tmp_path / "plain")
    with pytest.warns(UserWarning, match="no optimization_step"):
        assert EMAModel.from_pretrained(tmp_path / "plain", type(unet)).optimization_step == 0


def replay_train_unconditional(
    ema_model_cls: type, output_dir: Path, steps: int = 6, checkpoint_at: int = 3
) -> tuple[list[Tensor], list[float], Tensor]:
    """The EMA lines of diffusers' ``examples/unconditional_image_generation/
    train_unconditional.py`` (main, August 2026), in their order, with ``EMAModel`` the
    class the script imports, on a tiny UNet: construction, ``to(device)``, ``step`` after
    each optimizer step, the logged ``cur_decay_value``, the accelerate save and load
    hooks (``save_pretrained`` / ``from_pretrained`` + ``load_state_dict`` + ``to``), and
    ``store`` / ``copy_to`` / ``restore`` around the evaluation. Returns the final EMA
    weights, the logged decays and the evaluation output."""
    EMAModel = ema_model_cls
    UNet2DModel = diffusers.UNet2DModel
    model = tiny_unet()
    ema_model = EMAModel(
        model.parameters(),
        decay=0.9999,
        use_ema_warmup=True,
        inv_gamma=1.0,
        power=3 / 4,
        model_cls=UNet2DModel,
        model_config=model.config,
    )
    ema_model.to("cpu")  # accelerator.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    logs = []
    for global_step in range(1, steps + 1):
        clean = torch.randn(2, 1, 8, 8, generator=gen)
        noise = torch.randn(2, 1, 8, 8, generator=gen)
        timesteps = torch.randint(0, 1000, (2,), generator=gen)
        loss = (model(clean + noise, timesteps).sample - noise).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ema_model.step(model.parameters())
        logs.append(ema_model.cur_decay_value)
        if global_step == checkpoint_at:  # accelerator.save_state, then a resume
            ema_model.save_pretrained(os.path.join(output_dir, "unet_ema"))
            load_model = EMAModel.from_pretrained(os.path.join(output_dir, "unet_ema"), UNet2DModel)
            ema_model.load_state_dict(load_model.state_dict())
            ema_model.to("cpu")
            del load_model
    unet = model
    ema_model.store(unet.parameters())
    ema_model.copy_to(unet.parameters())
    with torch.no_grad():
        sample = unet(torch.ones(1, 1, 8, 8), torch.tensor([10])).sample
    ema_model.restore(unet.parameters())
    return [t.clone() for t in ema_model.shadow_params], logs, sample


def test_train_unconditional_ema_lines_with_one_import_changed(tmp_path):
    theirs, their_logs, their_sample = replay_train_unconditional(Theirs, tmp_path / "d")
    ours, our_logs, our_sample = replay_train_unconditional(EMAModel, tmp_path / "e")
    assert our_logs == their_logs and our_logs[0] == 0.0 and our_logs[-1] > 0
    assert rounding_ratio(theirs, ours) <= ROUNDING_EPS
    torch.testing.assert_close(our_sample, their_sample, rtol=1e-5, atol=1e-6)
    for folder in ("d", "e"):  # the same config, optimization_step kept at the checkpoint
        config = json.loads((tmp_path / folder / "unet_ema" / "config.json").read_text())
        assert config["optimization_step"] == 3 and config["use_ema_warmup"] is True


def test_store_copy_to_restore_and_to():
    net = mlp()
    ours = EMAModel(net.parameters(), decay=0.9)
    noisy_sgd(net, 5, lambda k: ours.step(net.parameters()))
    raw = [p.detach().clone() for p in net.parameters()]
    ours.store(net.parameters())
    ours.copy_to(net.parameters())
    assert same([p.detach() for p in net.parameters()], ours.shadow_params)
    ours.restore(net.parameters())
    assert same([p.detach() for p in net.parameters()], raw)
    assert ours.temp_stored_params is None
    with pytest.raises(EMARuntimeError, match="store"):
        ours.restore(net.parameters())
    # a float64 shadow: the next step plans for it, as diffusers casts
    theirs = Theirs(net.parameters(), decay=0.9)
    theirs.load_state_dict(ours.state_dict())
    ours.to(dtype=torch.float64)
    theirs.to(dtype=torch.float64)
    assert all(s.dtype == torch.float64 for s in ours.shadow_params)
    noisy_sgd(net, 3, lambda k: (ours.step(net.parameters()), theirs.step(net.parameters())))
    torch.testing.assert_close(ours.shadow_params, theirs.shadow_params, rtol=0, atol=1e-7)


def test_other_parameter_objects_are_tracked_from_the_same_shadow():
    net = mlp()
    ours = EMAModel(net.parameters(), decay=0.9)
    theirs = Theirs(net.parameters(), decay=0.9)
    noisy_sgd(net, 3, lambda k: (ours.step(net.parameters()), theirs.step(net.parameters())))
    rebuilt = mlp(seed=5)
    rebuilt.load_state_dict(net.state_dict())
    noisy_sgd(rebuilt, 3, lambda k: (ours.step(rebuilt.parameters()), theirs.step(rebuilt)))
    assert ours.optimization_step == 6
    assert rounding_ratio(theirs.shadow_params, ours.shadow_params) <= ROUNDING_EPS


def test_ema_dtype_keeps_an_fp32_shadow_of_a_bf16_model():
    net = mlp().to(torch.bfloat16)
    ours = EMAModel(net.parameters(), decay=0.999, ema_dtype=torch.float32)
    reference = [p.detach().float().clone() for p in net.parameters()]  # fp32 reference EMA

    def step(k: int) -> None:
        ours.step(net.parameters())
        d = ours.cur_decay_value
        for r, p in zip(reference, net.parameters(), strict=True):
            r.copy_(p.float()) if k == 1 else r.mul_(d).add_(p.float(), alpha=1 - d)

    noisy_sgd(net, 10, step)
    assert all(s.dtype == torch.float32 for s in ours.shadow_params)
    torch.testing.assert_close(ours.shadow_params, reference, rtol=0, atol=1e-6)


def test_bad_inputs_raise_naming_the_argument():
    net = mlp()
    with pytest.raises(EMATypeError, match=r"unknown keywords.*'beta'"):
        EMAModel(net.parameters(), beta=0.9)
    with pytest.raises(EMAValueError, match="decay"):
        EMAModel(net.parameters(), decay=1.5)
    with pytest.raises(EMAValueError, match="inv_gamma"):
        EMAModel(net.parameters(), inv_gamma=0)
    with pytest.raises(EMATypeError, match="parameters"):
        EMAModel(torch.zeros(3))
    ours = EMAModel(net.parameters())
    with pytest.raises(EMAValueError, match=r"step\(\) got 2 parameters"):
        ours.step(list(net.parameters())[:2])
    with pytest.raises(EMAValueError, match="model_cls="):
        ours.save_pretrained("unused")
    before = [t.clone() for t in ours.shadow_params]
    state = ours.state_dict()
    bad = dict(state, shadow_params=state["shadow_params"][:-1], optimization_step=9)
    with pytest.raises(EMAStateError, match="another model"):
        ours.load_state_dict(bad)
    with pytest.raises(EMAValueError, match="min_decay"):
        ours.load_state_dict(dict(state, min_decay=-1.0, optimization_step=9))
    assert ours.optimization_step == 0 and same(ours.shadow_params, before)  # untouched


def test_deprecated_forms_as_in_diffusers():
    net = mlp()
    with pytest.warns(FutureWarning):
        ours = EMAModel(net, max_value=0.99, min_value=0.1)
    assert ours.use_ema_warmup and ours.decay == 0.99 and ours.min_decay == 0.1
    with pytest.warns(FutureWarning):
        ours.step(net)
    assert ours.optimization_step == 1


def test_import_loads_no_peer():
    code = (
        "import sys, emakit.compat, emakit.compat.diffusers; "
        "print([m for m in ('diffusers', 'lightning', 'pytorch_lightning') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_failed_save_pretrained_leaves_the_previous_folder(tmp_path, monkeypatch):
    unet = tiny_unet()
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config)
    ours.save_pretrained(tmp_path / "ema")
    before = {f.name: f.read_bytes() for f in (tmp_path / "ema").iterdir()}
    noisy_sgd(unet, 2, lambda k: ours.step(unet.parameters()))
    save = type(unet).save_pretrained

    def dies_half_way(model, folder, *args, **kwargs):
        save(model, folder, *args, **kwargs)
        for f in Path(folder).iterdir():  # the weights half written, then the process fails
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(unet), "save_pretrained", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        ours.save_pretrained(tmp_path / "ema")
    assert {f.name: f.read_bytes() for f in (tmp_path / "ema").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema"]  # nothing left beside it
    monkeypatch.undo()
    ours.save_pretrained(tmp_path / "ema")  # a later save replaces it, and it reads back
    back = EMAModel.from_pretrained(tmp_path / "ema", type(unet))
    assert back.optimization_step == 2 and same(back.shadow_params, ours.shadow_params)
