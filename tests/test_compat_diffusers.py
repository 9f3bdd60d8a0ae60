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

import ctypes
import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from _frameworks import need
from emakit import EMA, EMARuntimeError, EMAStateError, EMATypeError, EMAValueError
from emakit._files import atomic
from emakit.compat.diffusers import EMAModel
from emakit.foreign import load_foreign_state

training_utils = need("diffusers.training_utils")
diffusers = need("diffusers")
Theirs = training_utils.EMAModel

#: Per tensor, |ours - theirs| stays within this many float32 epsilons of the tensor's
#: largest |weight| (diffusers' two paths differ from each other by as much).
ROUNDING_EPS = 4
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*deprecated.*:FutureWarning"),
    pytest.mark.usefixtures("one_thread"),
]


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


# -- save_pretrained replaces the folder as a whole -------------------------------------------

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"


def sharded_saves(monkeypatch: pytest.MonkeyPatch, model_cls: type) -> None:
    """Make ``model_cls.save_pretrained`` (which ``EMAModel.save_pretrained`` calls) write
    shards of at most 40 kB with an index, as a big model's save does."""
    save = model_cls.save_pretrained
    monkeypatch.setattr(
        model_cls,
        "save_pretrained",
        lambda model, folder, **kw: save(model, folder, max_shard_size=40_000, **kw),
    )


def folder_tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` by relative path: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def emakit_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".emakit-" in p.name)


def assert_reads_back(path: Path, ours: EMAModel, step: int) -> None:
    """diffusers' ``EMAModel.from_pretrained``, emakit's, and ``load_foreign_state`` all
    read ``ours`` (its weights and ``step``) from ``path``."""
    model_cls = ours.model_cls
    for reader in (Theirs, EMAModel):
        back = reader.from_pretrained(path, model_cls)
        assert back.optimization_step == step, reader
        assert same(back.shadow_params, ours.shadow_params), reader
    plain = EMA(tiny_unet(seed=3), update_after_step=0, update_every=1)
    assert load_foreign_state(plain, path) == "diffusers"
    assert int(plain.step) == step
    assert same(list(plain.ema_model.parameters()), ours.shadow_params)


def test_a_single_file_save_over_a_sharded_one_reads_the_new_weights(tmp_path, monkeypatch):
    unet = tiny_unet()
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config)
    path = tmp_path / "ema"
    noisy_sgd(unet, 2, lambda k: ours.step(unet.parameters()))
    with monkeypatch.context() as m:
        sharded_saves(m, type(unet))
        ours.save_pretrained(path)
    names = sorted(p.name for p in path.iterdir())
    assert INDEX in names and len([n for n in names if "-of-" in n]) > 1
    assert_reads_back(path, ours, 2)

    noisy_sgd(unet, 3, lambda k: ours.step(unet.parameters()))
    ours.save_pretrained(path)  # a single file now: the new weights read back
    assert_reads_back(path, ours, 5)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", WEIGHTS]  # nothing stale

    noisy_sgd(unet, 1, lambda k: ours.step(unet.parameters()))
    with monkeypatch.context() as m:  # and sharded again: no stale single file
        sharded_saves(m, type(unet))
        ours.save_pretrained(path)
    assert WEIGHTS not in {p.name for p in path.iterdir()}
    assert_reads_back(path, ours, 6)
    assert emakit_leftovers(tmp_path) == []


def test_your_files_in_the_folder_survive_a_save(tmp_path):
    unet = tiny_unet()
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config)
    path = tmp_path / "ema"
    ours.save_pretrained(path)
    (path / "notes.md").write_text("run 12, lr 1e-4")
    (path / "samples").mkdir()
    (path / "samples" / "step2.png").write_bytes(b"png")
    (path / "diffusion_pytorch_model.bin").write_bytes(b"an older .bin")  # the weights'
    path.chmod(0o750)
    inode = (path / "notes.md").stat().st_ino
    noisy_sgd(unet, 2, lambda k: ours.step(unet.parameters()))
    ours.save_pretrained(path)
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*")) == [
        "config.json",
        WEIGHTS,
        "notes.md",
        "samples",
        "samples/step2.png",
    ]
    assert (path / "notes.md").stat().st_ino == inode  # the same file, not a copy
    assert (path / "samples" / "step2.png").read_bytes() == b"png"
    assert (path.stat().st_mode & 0o777) == 0o750
    assert_reads_back(path, ours, 2)


def test_a_symlinked_folder_is_saved_behind_its_link(tmp_path):
    unet = tiny_unet()
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config)
    ours.save_pretrained(tmp_path / "run" / "ema")
    (tmp_path / "latest").symlink_to(Path("run") / "ema")
    noisy_sgd(unet, 1, lambda k: ours.step(unet.parameters()))
    ours.save_pretrained(tmp_path / "latest")
    assert (tmp_path / "latest").is_symlink()
    assert_reads_back(tmp_path / "run" / "ema", ours, 1)


# -- save_pretrained killed (SIGKILL) at every rename -----------------------------------------


def _refuses_exchange(a: bytes, b: bytes) -> int:
    ctypes.set_errno(errno.EINVAL)  # as a file system without RENAME_EXCHANGE answers
    return -1


def _save_killed_at(ema: EMAModel, path: Path, k: int, after: bool, exchange: bool) -> None:
    """In a forked child: ``ema.save_pretrained(path)``, SIGKILLed right before (or after)
    its ``k``-th rename or exchange; exits 0 when the save has fewer."""
    torch.set_num_threads(1)  # no OpenMP pool after fork
    calls = 0

    def killing(real: Callable) -> Callable:
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == k and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            out = real(*args, **kwargs)
            if calls == k and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return call

    os.rename = killing(os.rename)
    os.replace = killing(os.replace)
    if exchange and hasattr(atomic, "_exchange"):  # absent where saves renamed file by file
        atomic._exchange = killing(atomic._exchange)
    else:
        atomic._swap_function = lambda: _refuses_exchange
    ema.save_pretrained(path)
    os._exit(0)


def _save_killed_while_writing(ema: EMAModel, path: Path) -> None:
    """In a forked child: ``ema.save_pretrained(path)``, SIGKILLed with its weights file
    half written."""
    torch.set_num_threads(1)
    save = ema.model_cls.save_pretrained

    def half_then_killed(model, folder, **kwargs):
        save(model, folder, **kwargs)
        weights = Path(folder) / WEIGHTS
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    ema.model_cls.save_pretrained = half_then_killed
    ema.save_pretrained(path)
    os._exit(3)  # not reached


def forked(target: Callable, *args) -> int:
    """Run ``target(*args)`` in a forked child; its exit code (``-SIGKILL`` when killed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        proc = mp.get_context("fork").Process(target=target, args=args)
        proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the child did not finish")
    return proc.exitcode


@pytest.fixture
def two_saves(tmp_path, monkeypatch):
    """An EMA at step 5, the folder it saved sharded at step 2 with your files in it
    (``prev``), and what a save at step 5 makes of that folder (``new``): single-file
    weights, your files carried."""
    unet = tiny_unet()
    ours = EMAModel(unet.parameters(), model_cls=type(unet), model_config=unet.config)
    noisy_sgd(unet, 2, lambda k: ours.step(unet.parameters()))
    prev = tmp_path / "prev" / "ema"
    with monkeypatch.context() as m:
        sharded_saves(m, type(unet))
        ours.save_pretrained(prev)
    (prev / "notes.md").write_text("mine")
    (prev / "samples").mkdir()
    (prev / "samples" / "a.png").write_bytes(b"png")
    noisy_sgd(unet, 3, lambda k: ours.step(unet.parameters()))
    ref = tmp_path / "ref" / "ema"
    shutil.copytree(prev, ref)
    ours.save_pretrained(ref)
    return ours, prev, folder_tree(prev), folder_tree(ref)


def assert_previous_or_new(path: Path, prev: dict, new: dict, *, fallback: bool) -> str:
    """The folder at ``path`` is exactly the previous save or exactly the new one (its
    config's step with its weights); with ``fallback``, it may also be missing with the
    previous one whole under its ``-old-`` name. Returns which."""
    if not path.exists():
        assert fallback, "the folder is gone"
        (old,) = [p for p in path.parent.iterdir() if atomic.OLD_PREFIX in p.name]
        assert folder_tree(old) == prev
        return "missing"
    tree = folder_tree(path)
    assert tree in (prev, new), sorted(tree)
    which = "prev" if tree == prev else "new"
    assert json.loads(tree["config.json"])["optimization_step"] == {"prev": 2, "new": 5}[which]
    return which


def assert_next_save_cleans_up(ours: EMAModel, path: Path, new: dict) -> None:
    ours.save_pretrained(path)
    assert folder_tree(path) == new  # your files once, the new weights, nothing stale
    assert emakit_leftovers(path.parent) == []


def kill_at_each_rename(ours, start: Path, root: Path, exchange: bool) -> dict:
    """Kill a save of ``ours`` into ``ema`` in a copy of the folder ``start`` (the folder
    and what is beside it) before and after each of its renames in turn; returns
    ``(k, after) -> the path saved to``, each in its own copy."""
    left = {}
    for k in range(1, 10):
        finished = 0
        for after in (False, True):
            parent = root / f"k{k}-{'after' if after else 'before'}"
            shutil.copytree(start, parent, symlinks=True)
            code = forked(_save_killed_at, ours, parent / "ema", k, after, exchange)
            assert code in (0, -signal.SIGKILL), code
            finished += code == 0
            left[k, after] = parent / "ema"
        if finished == 2:
            return left
    raise AssertionError("the save never finished")  # pragma: no cover


fork_only = pytest.mark.skipif(
    "fork" not in mp.get_all_start_methods(), reason="needs fork() and SIGKILL"
)


@fork_only
def test_a_save_killed_at_any_rename_leaves_the_previous_or_the_new_folder(tmp_path, two_saves):
    ours, prev_folder, prev, new = two_saves
    left = kill_at_each_rename(ours, prev_folder.parent, tmp_path / "cases", exchange=True)
    seen = {
        key: assert_previous_or_new(path, prev, new, fallback=False) for key, path in left.items()
    }
    assert seen[1, False] == "prev" and seen[1, True] == "new"  # one exchange decides
    assert emakit_leftovers(left[1, False].parent) and emakit_leftovers(left[1, True].parent)
    for path in left.values():
        assert_next_save_cleans_up(ours, path, new)
    assert_reads_back(left[1, True], ours, 5)


@fork_only
def test_a_save_killed_at_any_rename_without_an_exchange(tmp_path, two_saves):
    ours, prev_folder, prev, new = two_saves
    left = kill_at_each_rename(ours, prev_folder.parent, tmp_path / "cases", exchange=False)
    seen = {
        key: assert_previous_or_new(path, prev, new, fallback=True) for key, path in left.items()
    }
    # the two renames: the old folder out of the way, then the new one in
    assert [seen[1, False], seen[1, True], seen[2, False], seen[2, True]] == [
        "prev",
        "missing",
        "missing",
        "new",
    ]
    # A save that finds the folder missing puts the old one back first: killed at any of
    # its renames too (the restore included), the folder is the previous or the new one.
    gone = left[1, True]
    again = kill_at_each_rename(ours, gone.parent, tmp_path / "again", exchange=False)
    found = {
        key: assert_previous_or_new(path, prev, new, fallback=True) for key, path in again.items()
    }
    assert found[1, False] == "missing" and found[1, True] == "prev"  # the restore's rename
    for path in again.values():
        assert_next_save_cleans_up(ours, path, new)
    for path in left.values():
        assert_next_save_cleans_up(ours, path, new)


@fork_only
def test_a_save_killed_while_the_model_writes_leaves_the_previous_folder(tmp_path, two_saves):
    ours, prev_folder, prev, new = two_saves
    path = tmp_path / "case" / "ema"
    shutil.copytree(prev_folder, path)
    assert forked(_save_killed_while_writing, ours, path) == -signal.SIGKILL
    assert folder_tree(path) == prev
    (staging,) = emakit_leftovers(path.parent)  # the killed save's, half written
    assert atomic.DIR_PREFIX in staging
    assert_next_save_cleans_up(ours, path, new)
