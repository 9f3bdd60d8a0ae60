"""The README's migration rows for torch_ema, timm and diffusers, replayed against the
real packages.

Each row gives an emakit configuration and says how close it comes to the peer: the
same decay at every update, and weights either bit-identical (timm: both use ``lerp_``)
or equal to float32 rounding (torch_ema and diffusers compute ``s - (1 - d) * (s - p)``,
which rounds differently from ``lerp_``). The tests build the EMA from the very snippet
the row shows, train a small model with noisy SGD for a few hundred steps and check
exactly that claim after every step. The rest covers loading the folder diffusers'
``EMAModel.save_pretrained`` writes with :func:`emakit.load_foreign_state`.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from _frameworks import need
from emakit import EMA, EMAStateError, EMAValueError, schedules
from emakit.foreign import load_foreign_state

MIGRATION = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
STEPS = 300
EPS32 = torch.finfo(torch.float32).eps
#: The README's bound for torch_ema and diffusers: per tensor, |ours - theirs| stays within
#: this many epsilons of the tensor's largest |weight|.
ROUNDING_EPS = 4


def readme_row(start: str) -> str:
    """The migration page's section for the library ``start`` names (``"| timm "`` ->
    "## From timm ..."): the text from its heading to the next one."""
    name = start.strip("| ").strip()
    text = MIGRATION.read_text(encoding="utf-8")
    heads = [i for i, line in enumerate(text.splitlines()) if line.startswith(f"## From {name}")]
    assert len(heads) == 1, f"docs/migration.md has {len(heads)} sections for {name!r}"
    lines = text.splitlines()[heads[0] + 1 :]
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    return " ".join(lines[:end])


def build(row: str, snippet: str, model: nn.Module, swap: tuple[str, str] | None = None) -> EMA:
    """``snippet`` as the README row shows it, evaluated with ``model`` bound; ``swap``
    replaces one part by a variant the row names (the caller checks that it does)."""
    assert f"`{snippet}`" in row, f"the README row no longer shows `{snippet}`"
    if swap is not None:
        assert swap[0] in snippet
        snippet = snippet.replace(*swap)
    ema = eval(snippet, {"EMA": EMA, "schedules": schedules, "model": model})
    assert isinstance(ema, EMA)
    return ema


def mlp(*, bn: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(16, 32), *([nn.BatchNorm1d(32)] if bn else []), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4)).to(dtype)


def noisy_sgd(net: nn.Module, steps: int, after_step: Callable[[int], None], seed: int = 1) -> None:
    """``steps`` SGD steps on a random regression with gradient noise; ``after_step(k)``
    after the ``k``-th (1-based)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = next(net.parameters()).dtype
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for k in range(1, steps + 1):
        x = torch.randn(8, 16, generator=gen, dtype=dtype)
        net(x).pow(2).mean().backward()
        for p in net.parameters():
            assert p.grad is not None
            p.grad.add_(torch.randn(p.shape, generator=gen, dtype=dtype), alpha=0.01)
        opt.step()
        opt.zero_grad()
        after_step(k)


def rounding_gap(theirs: list[Tensor], ours: list[Tensor]) -> tuple[float, float]:
    """The largest |difference| over all tensors, and the largest per-tensor ratio of the
    |difference| to ``eps * max |weight|`` of that tensor."""
    gap = ratio = 0.0
    for a, b in zip(theirs, ours, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        diff = (a - b).abs().max().item()
        scale = torch.finfo(a.dtype).eps * max(a.abs().max().item(), b.abs().max().item())
        gap, ratio = max(gap, diff), max(ratio, diff / scale if diff else 0.0)
    return gap, ratio


# -- torch_ema --------------------------------------------------------------------------------

TORCH_EMA_ROW = "| torch_ema "
TORCH_EMA_WARMUP = (
    "EMA(model, schedule=schedules.torch_ema_warmup(0.999), update_after_step=0, update_every=1)"
)
TORCH_EMA_CONSTANT = "schedules.constant(0.999)"


def record_torch_ema_weights(monkeypatch: pytest.MonkeyPatch, theirs) -> list[float]:
    """Run ``theirs.update()`` and return the ``1 - decay`` it multiplied by (read off its
    ``tmp.mul_(one_minus_decay)`` calls, so no formula is re-derived here)."""
    seen: list[float] = []
    mul_ = torch.Tensor.mul_

    def spy(self: Tensor, other: object) -> Tensor:
        assert isinstance(other, float)
        seen.append(other)
        return mul_(self, other)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "mul_", spy)
        theirs.update()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use_num_updates", [True, False])
def test_torch_ema_row_same_decays_and_weights_to_rounding(monkeypatch, use_num_updates, dtype):
    torch_ema = pytest.importorskip("torch_ema")
    row = readme_row(TORCH_EMA_ROW)
    assert "one `ema.update()` right after building it" in row
    swap = None
    if not use_num_updates:
        assert f"`use_num_updates=False`: `{TORCH_EMA_CONSTANT}`" in row
        swap = ("schedules.torch_ema_warmup(0.999)", TORCH_EMA_CONSTANT)
    net = mlp(dtype=dtype)
    theirs = torch_ema.ExponentialMovingAverage(
        net.parameters(), decay=0.999, use_num_updates=use_num_updates
    )
    ours = build(row, TORCH_EMA_WARMUP, net, swap)
    ours.update()  # the row's first call: copies the weights torch_ema was built with
    gaps: list[tuple[float, float]] = []

    def both(k: int) -> None:
        one_minus_decay = record_torch_ema_weights(monkeypatch, theirs)
        ours.update()
        # the same decay, as the same float, at every update
        assert set(one_minus_decay) == {1.0 - ours.get_current_decay()}, k
        gap, ratio = rounding_gap(theirs.shadow_params, list(ours.ema_model.parameters()))
        assert ratio <= ROUNDING_EPS, (k, gap, ratio)
        gaps.append((gap, ratio))

    noisy_sgd(net, STEPS, both)
    assert len(gaps) == STEPS
    if use_num_updates:
        assert theirs.num_updates == STEPS == int(ours.step) - 1
        assert ours.get_current_decay() == min(0.999, (1 + STEPS) / (10 + STEPS))


def test_torch_ema_without_the_first_call_is_one_update_behind():
    """Why the row asks for the extra first ``update()``: without it, emakit's call ``n``
    uses torch_ema's decay of update ``n - 1`` (and its first call copies)."""
    torch_ema = pytest.importorskip("torch_ema")
    net = mlp()
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.999)
    ours = EMA(net, schedule=schedules.torch_ema_warmup(0.999), update_after_step=0, update_every=1)
    decays = []

    def both(k: int) -> None:
        theirs.update()
        ours.update()
        decays.append((min(0.999, (1 + theirs.num_updates) / (10 + theirs.num_updates)), k))
        if k > 1:
            assert ours.get_current_decay() == decays[-2][0]

    noisy_sgd(net, 20, both)


# -- timm -------------------------------------------------------------------------------------

TIMM_ROW = "| timm "
TIMM_CONSTANT = (
    "EMA(model, schedule=schedules.constant(0.9998), update_after_step=0, update_every=1)"
)
TIMM_WARMUP = (
    "EMA(model, schedule=lambda t: min(1 - (1 + t) ** -(2 / 3), 0.9998), "
    "update_after_step=0, update_every=1)"
)


@pytest.mark.parametrize(
    ("case", "timm_kwargs", "snippet", "update_after_step"),
    [
        # no step: no warm-up, whatever use_warmup / update_after_step say
        ("no step", {}, TIMM_CONSTANT, 0),
        ("no step", {"use_warmup": True, "update_after_step": 5}, TIMM_CONSTANT, 0),
        ("step", {}, TIMM_CONSTANT, 0),
        ("step", {"update_after_step": 5}, TIMM_CONSTANT, 5),
        ("step", {"use_warmup": True, "warmup_gamma": 1, "warmup_power": 2 / 3}, TIMM_WARMUP, 0),
        ("step", {"use_warmup": True, "update_after_step": 5}, TIMM_WARMUP, 5),
    ],
)
def test_timm_row_is_bit_identical(case, timm_kwargs, snippet, update_after_step):
    model_ema = pytest.importorskip("timm.utils.model_ema")
    row = readme_row(TIMM_ROW)
    assert "one `ema.update()` right after building it" in row
    net = mlp(bn=True)
    theirs = model_ema.ModelEmaV3(net, decay=0.9998, **timm_kwargs)
    swap = None
    if update_after_step:
        assert "timm's `update_after_step=N`: `update_after_step=N`" in row
        swap = ("update_after_step=0", f"update_after_step={update_after_step}")
    ours = build(row, snippet, net, swap)
    if case == "no step":
        ours.update()  # the row's first call: copies the weights timm was built with

    def both(k: int) -> None:
        if case == "no step":
            theirs.update(net)
            decay = theirs.get_decay(None)
            assert decay == 0.9998  # no warm-up
        else:
            theirs.update(net, step=k)
            decay = theirs.get_decay(k)
        ours.update()
        assert ours.get_current_decay() == decay, k
        for (name, a), b in zip(
            theirs.module.state_dict().items(), ours.ema_model.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), (k, name)  # parameters and buffers, bit for bit

    noisy_sgd(net, STEPS, both)


def test_timm_warmup_with_beta_inv_gamma_power_differs_by_float32_rounding():
    """The row's caveat: ``EMA(beta=, inv_gamma=, power=)`` evaluates the warm-up in float32
    (ema-pytorch's bits), timm in float64, so the decays differ by float32 rounding."""
    model_ema = pytest.importorskip("timm.utils.model_ema")
    assert "differ by up to 4e-8" in readme_row(TIMM_ROW)
    net = mlp()
    theirs = model_ema.ModelEmaV3(net, decay=0.9998, use_warmup=True)
    ours = EMA(net, beta=0.9998, update_after_step=0, update_every=1, inv_gamma=1, power=2 / 3)
    worst = 0.0

    def both(k: int) -> None:
        nonlocal worst
        theirs.update(net, step=k)
        ours.update()
        worst = max(worst, abs(ours.get_current_decay() - theirs.get_decay(k)))

    noisy_sgd(net, STEPS, both)
    assert 0 < worst <= 4e-8


# -- diffusers: the row ---------------------------------------------------------------------

DIFFUSERS_ROW = "| diffusers "
DIFFUSERS_WARMUP = (
    "EMA(model, schedule=lambda t: min(1 - (1 + t) ** -(2 / 3), 0.9999), "
    "update_after_step=0, update_every=1)"
)
DIFFUSERS_NO_WARMUP = "schedule=schedules.torch_ema_warmup(0.9999)"


@pytest.mark.parametrize("use_ema_warmup", [True, False])
def test_diffusers_row_same_decays_and_weights_to_rounding(use_ema_warmup):
    training_utils = need("diffusers.training_utils")
    row = readme_row(DIFFUSERS_ROW)
    swap = None
    if not use_ema_warmup:
        assert f"without `use_ema_warmup`: `{DIFFUSERS_NO_WARMUP}`" in row
        swap = ("schedule=lambda t: min(1 - (1 + t) ** -(2 / 3), 0.9999)", DIFFUSERS_NO_WARMUP)
    net = mlp()
    ours = build(row, DIFFUSERS_WARMUP, net, swap)
    theirs = training_utils.EMAModel(
        net.parameters(), decay=0.9999, use_ema_warmup=use_ema_warmup, inv_gamma=1, power=2 / 3
    )

    def both(k: int) -> None:
        theirs.step(net.parameters())
        ours.update()
        assert ours.get_current_decay() == theirs.cur_decay_value, k
        gap, ratio = rounding_gap(theirs.shadow_params, list(ours.ema_model.parameters()))
        assert ratio <= ROUNDING_EPS, (k, gap, ratio)

    noisy_sgd(net, STEPS, both)
    assert theirs.optimization_step == int(ours.step) == STEPS


# -- diffusers: EMAModel.save_pretrained folders ----------------------------------------------


def tiny_unet():
    diffusers = need("diffusers")
    torch.manual_seed(0)
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


def trained_ema_model(steps: int = 5):
    """A tiny UNet and a diffusers ``EMAModel`` of it after ``steps`` noisy SGD steps."""
    training_utils = need("diffusers.training_utils")
    net = tiny_unet()
    theirs = training_utils.EMAModel(
        net.parameters(), decay=0.99, model_cls=type(net), model_config=net.config
    )
    gen = torch.Generator().manual_seed(2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        # a cheap loss on the weights themselves (the folder format is what is tested)
        loss = sum(p.pow(2).sum() for p in net.parameters())
        loss.backward()
        for p in net.parameters():
            p.grad.add_(torch.randn(p.shape, generator=gen), alpha=0.01)
        opt.step()
        opt.zero_grad()
        theirs.step(net.parameters())
    return net, theirs


def save_like_ema_model(theirs, path: Path, **save_kwargs) -> None:
    """What ``EMAModel.save_pretrained(path)`` does, with ``save_kwargs`` passed on to the
    model's ``save_pretrained`` (for the ``.bin`` and sharded layouts it never asks for)."""
    model = theirs.model_cls.from_config(theirs.model_config)
    state = theirs.state_dict()
    state.pop("shadow_params", None)
    model.register_to_config(**state)
    theirs.copy_to(model.parameters())
    model.save_pretrained(path, **save_kwargs)


def emakit_ema(net: nn.Module) -> EMA:
    return EMA(net, beta=0.99, update_after_step=0, update_every=1)


def assert_loaded(ours: EMA, theirs, folder: Path, *, reread: bool = True) -> None:
    for (name, p), shadow in zip(
        ours.ema_model.named_parameters(), theirs.shadow_params, strict=True
    ):
        assert p.dtype == shadow.dtype and torch.equal(p, shadow), name
    assert int(ours.step) == theirs.optimization_step
    if not reread:
        return
    # and exactly what diffusers itself reads back from the folder, buffers included
    model = type(ours.model).from_pretrained(folder)
    assert isinstance(model, nn.Module)
    reread_state = model.state_dict()
    for name, t in ours.ema_model.state_dict().items():
        assert torch.equal(t, reread_state[name]), name


def test_load_foreign_state_reads_ema_model_save_pretrained_folder(tmp_path):
    net, theirs = trained_ema_model()
    theirs.save_pretrained(tmp_path / "ema")
    assert (tmp_path / "ema" / "diffusion_pytorch_model.safetensors").is_file()
    ours = emakit_ema(net)
    assert load_foreign_state(ours, tmp_path / "ema") == "diffusers"
    assert_loaded(ours, theirs, tmp_path / "ema")
    assert int(ours.step) == 5
    # a str path and format="diffusers" too; step= overrides the count
    again = emakit_ema(net)
    assert load_foreign_state(again, str(tmp_path / "ema"), format="diffusers", step=12) == (
        "diffusers"
    )
    assert int(again.step) == 12


@pytest.mark.parametrize(
    "save_kwargs",
    [
        {"safe_serialization": False},
        {"max_shard_size": 40_000},
        {"safe_serialization": False, "max_shard_size": 40_000},
    ],
    ids=["bin", "safetensors-shards", "bin-shards"],
)
def test_ema_model_folder_in_bin_and_sharded_layouts(tmp_path, save_kwargs):
    net, theirs = trained_ema_model(steps=3)
    folder = tmp_path / "ema"
    save_like_ema_model(theirs, folder, **save_kwargs)
    if "max_shard_size" in save_kwargs:
        assert any(p.name.endswith(".index.json") for p in folder.iterdir())
        assert len([p for p in folder.iterdir() if "-of-" in p.name]) > 1
    ours = emakit_ema(net)
    assert load_foreign_state(ours, folder) == "diffusers"
    # diffusers 0.42's own from_pretrained does not find sharded .bin weights (it looks
    # for diffusion_pytorch_model.bin), so that layout is checked against the EMA alone
    sharded_bin = save_kwargs.get("safe_serialization") is False and "max_shard_size" in save_kwargs
    assert_loaded(ours, theirs, folder, reread=not sharded_bin)


def test_folder_errors_name_the_folder_and_what_was_found(tmp_path):
    net, theirs = trained_ema_model(steps=2)
    ours = emakit_ema(net)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EMAStateError, match=r"no config\.json") as e:
        load_foreign_state(ours, empty)
    assert str(empty) in str(e.value) and "found nothing" in str(e.value)
    assert "EMAModel.save_pretrained" in str(e.value)

    plain = tmp_path / "plain"  # a model folder, not an EMA folder
    net.save_pretrained(plain)
    with pytest.raises(EMAStateError, match="no 'optimization_step'") as e:
        load_foreign_state(ours, plain)
    assert str(plain) in str(e.value) and "block_out_channels" in str(e.value)
    assert "format='state_dict'" in str(e.value)

    no_weights = tmp_path / "no_weights"
    theirs.save_pretrained(no_weights)
    (no_weights / "diffusion_pytorch_model.safetensors").rename(no_weights / "other.safetensors")
    with pytest.raises(EMAStateError, match="no weights file") as e:
        load_foreign_state(ours, no_weights)
    assert str(no_weights) in str(e.value) and "other.safetensors" in str(e.value)

    with pytest.raises(EMAValueError, match="format='timm'") as e:
        load_foreign_state(ours, plain, format="timm")
    assert str(plain) in str(e.value)


def test_folder_with_bad_config_bad_shards_or_another_model(tmp_path):
    net, theirs = trained_ema_model(steps=2)
    ours = emakit_ema(net)
    folder = tmp_path / "ema"
    theirs.save_pretrained(folder)

    bad_step = tmp_path / "bad_step"
    shutil.copytree(folder, bad_step)
    config = json.loads((bad_step / "config.json").read_text())
    config["optimization_step"] = "7"
    (bad_step / "config.json").write_text(json.dumps(config))
    with pytest.raises(EMAStateError, match="optimization_step must be an int >= 0, got '7'"):
        load_foreign_state(ours, bad_step)

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(EMAStateError, match="not a readable JSON file"):
        load_foreign_state(ours, broken)

    escaping = tmp_path / "escaping"
    shutil.copytree(folder, escaping)
    (escaping / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"conv_in.weight": "../ema/diffusion_pytorch_model.safetensors"}})
    )
    with pytest.raises(EMAStateError, match="not a file name inside"):
        load_foreign_state(ours, escaping)

    pickled = tmp_path / "pickled"  # a .bin is read with weights_only=True
    shutil.copytree(folder, pickled)
    (pickled / "diffusion_pytorch_model.safetensors").unlink()
    weights = {"conv_in.weight": torch.zeros(1), "x": warnings.WarningMessage}  # a class
    torch.save(weights, pickled / "diffusion_pytorch_model.bin")
    with pytest.raises(EMAStateError, match="objects other than tensors"):
        load_foreign_state(ours, pickled)

    other = EMA(nn.Linear(2, 2), update_after_step=0)  # another model: strict by name
    with pytest.raises(EMAStateError, match="does not match the EMA model by name") as e:
        load_foreign_state(other, folder)
    assert str(folder) in str(e.value)


INDEX = "diffusion_pytorch_model.safetensors.index.json"


def sharded_folder(tmp_path: Path) -> tuple[nn.Module, Path, dict[str, str], list[str]]:
    """A diffusers EMA folder in safetensors shards: the net, the folder, the index's
    ``weight_map`` and the shard names in order."""
    net, theirs = trained_ema_model(steps=2)
    folder = tmp_path / "ema"
    save_like_ema_model(theirs, folder, max_shard_size=40_000)
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    return net, folder, weight_map, shards


def rewrite_shard(path: Path, change: Callable[[dict[str, Tensor]], object]) -> None:
    st = need("safetensors.torch")
    tensors = st.load_file(path)
    change(tensors)
    st.save_file(tensors, path, metadata={"format": "pt"})


def test_a_tensor_in_two_shards_is_refused_naming_the_index_entry(tmp_path):
    # The copy in the later shard used to win silently over the one the index names.
    net, folder, weight_map, shards = sharded_folder(tmp_path)
    name = next(t for t, shard in sorted(weight_map.items()) if shard == shards[0])
    named = need("safetensors.torch").load_file(folder / shards[0])[name]
    rewrite_shard(folder / shards[1], lambda t: t.update({name: named + 1}))
    ours = emakit_ema(net)
    with pytest.raises(EMAStateError) as e:
        load_foreign_state(ours, folder)
    assert f"{folder / shards[1]} holds the tensor {name!r}" in str(e.value)
    assert f"{INDEX} maps it to {shards[0]!r}" in str(e.value)


def test_a_tensor_missing_from_the_shard_the_index_names_is_refused(tmp_path):
    net, folder, weight_map, shards = sharded_folder(tmp_path)
    name = next(t for t, shard in sorted(weight_map.items()) if shard == shards[0])
    rewrite_shard(folder / shards[0], lambda t: t.pop(name))
    with pytest.raises(EMAStateError) as e:
        load_foreign_state(emakit_ema(net), folder)
    assert f"{folder / shards[0]} has no tensor {name!r}" in str(e.value)
    assert f"which {INDEX} maps to {shards[0]!r}" in str(e.value)


def test_a_shard_tensor_the_index_maps_elsewhere_or_nowhere_is_refused(tmp_path):
    net, folder, weight_map, shards = sharded_folder(tmp_path)
    # moved from the shard the index names into another one: every tensor is still there
    name = next(t for t, shard in sorted(weight_map.items()) if shard == shards[1])
    moved = need("safetensors.torch").load_file(folder / shards[1])[name]
    rewrite_shard(folder / shards[1], lambda t: t.pop(name))
    rewrite_shard(folder / shards[0], lambda t: t.update({name: moved}))
    with pytest.raises(EMAStateError) as e:
        load_foreign_state(emakit_ema(net), folder)
    assert f"{folder / shards[0]} holds the tensor {name!r}" in str(e.value)
    assert f"{INDEX} maps it to {shards[1]!r}" in str(e.value)

    _, folder, _, shards = sharded_folder(tmp_path / "extra")
    rewrite_shard(folder / shards[0], lambda t: t.update({"stale.weight": torch.zeros(2)}))
    with pytest.raises(EMAStateError) as e:
        load_foreign_state(emakit_ema(net), folder)
    assert f"holds the tensor 'stale.weight', but {INDEX} does not list it" in str(e.value)


@pytest.mark.filterwarnings("ignore:It is deprecated to pass a pretrained model:FutureWarning")
def test_ema_model_folder_round_trips_through_from_pretrained(tmp_path):
    """diffusers reads the folder back with the same weights emakit loaded."""
    training_utils = need("diffusers.training_utils")
    net, theirs = trained_ema_model(steps=4)
    theirs.save_pretrained(tmp_path / "ema")
    back = training_utils.EMAModel.from_pretrained(tmp_path / "ema", type(net))
    ours = emakit_ema(net)
    load_foreign_state(ours, tmp_path / "ema")
    assert back.optimization_step == int(ours.step) == 4
    for a, b in zip(back.shadow_params, ours.ema_model.parameters(), strict=True):
        assert torch.equal(a, b)
