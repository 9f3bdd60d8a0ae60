"""Safetensors export/import of EMA weights and loading other libraries' EMA checkpoints.

Every foreign checkpoint is produced by the real package (ema-pytorch, timm, torch_ema,
torch's AveragedModel, diffusers), and the loaded emakit weights must equal the source's
EMA weights exactly.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import emakit
from _frameworks import need
from _models import float16_overflow_linear, train
from emakit import EMA, EMAPytree, EMAStateError, EMAValueError
from emakit._files import atomic as io_mod
from emakit.checkpoint import (
    WEIGHTS_FORMAT,
    load_ema_weights,
    save_ema_weights,
)
from emakit.foreign import FOREIGN_FORMATS, detect_format, load_foreign_state


class Net(nn.Module):
    """Conv + BatchNorm (an integer buffer) + a linear head tied to an embedding."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(5, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.bn = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 5, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).transpose(1, 2)
        h = self.bn(self.conv(h)).transpose(1, 2)
        return self.head(h)


def token_loss(net: nn.Module, g: torch.Generator) -> torch.Tensor:
    """`Net`'s loss on a batch of 4 x 7 token ids (vocabulary 5) drawn from ``g``."""
    return net(torch.randint(0, 5, (4, 7), generator=g)).pow(2).mean()


#: `train()`'s keywords for `Net` (plain SGD at lr 0.1 on `token_loss`).
TOKENS: dict[str, Any] = dict(loss=token_loss, seed=1)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_foreign_state(*args, **kwargs)


# -- safetensors export ---------------------------------------------------------------------


def test_export_loads_straight_into_the_model_class(tmp_path):
    net = Net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train(net, [ema], 5, **TOKENS)
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    assert path == tmp_path / "ema.safetensors"
    fresh = Net(seed=7)
    fresh.load_state_dict(safetensors.torch.load_file(path))  # strict, tied + int buffer
    assert_same(fresh.state_dict(), ema.ema_model.state_dict())
    assert fresh.head.weight is fresh.emb.weight
    assert fresh.bn.num_batches_tracked.dtype == torch.long
    assert int(fresh.bn.num_batches_tracked) == 5


def test_export_header_metadata(tmp_path):
    net = Net()
    ema = EMA(net, beta=0.99, update_after_step=2, update_every=3, power=0.75, min_value=0.1)
    train(net, [ema], 11, **TOKENS)
    path = save_ema_weights(ema, tmp_path / "ema.safetensors", metadata={"run": "abc"})
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == WEIGHTS_FORMAT and meta["format_version"] == "1"
    assert meta["emakit_version"] == emakit.__version__
    assert meta["step"] == "11" and meta["initted"] == "true"
    assert float(meta["beta"]) == 0.99 and float(meta["power"]) == 0.75
    assert meta["update_after_step"] == "2" and meta["update_every"] == "3"
    assert float(meta["min_value"]) == 0.1
    assert float(meta["decay"]) == ema.get_current_decay()
    # the decay rule with its values, not a signature (the default is inverse_gamma)
    assert meta["schedule"] == "inverse_gamma(beta=0.99, inv_gamma=1.0, power=0.75, min_value=0.1)"
    assert meta["kind"] == "module"
    assert meta["model_class"] == "Net" and meta["run"] == "abc"


def test_export_streams_shared_storage_and_keeps_alignment(tmp_path):
    # The shadow lives in one flat buffer (views), which safetensors' save_file refuses.
    net = Net()
    ema = EMA(net)
    with pytest.raises(RuntimeError):
        safetensors.torch.save_file(ema.ema_model.state_dict(), str(tmp_path / "x.safetensors"))
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "U8": 1, "BOOL": 1}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % sizes[info["dtype"]] == 0, name


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
    ],
)
def test_writer_matches_safetensors_for_every_dtype(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4, 5, generator=gen) * 10
    tree = {
        "x": base.to(dtype),
        "scalar": torch.tensor(3).to(dtype),
        "empty": torch.zeros(0, 2).to(dtype),
        "strided": base.transpose(0, 2).to(dtype),  # not contiguous
        "wide": torch.arange(7, dtype=torch.float64),
    }
    ema = EMAPytree(tree)
    path = save_ema_weights(ema, tmp_path / "t.safetensors")
    loaded = safetensors.torch.load_file(path)
    for k, v in ema.ema_pytree.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        a, b = loaded[k].reshape(-1), v.contiguous().reshape(-1)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k


def test_export_dtype_casts_floats_only(tmp_path):
    net = Net()
    ema = EMA(net)
    path = save_ema_weights(ema, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    loaded = safetensors.torch.load_file(path)
    assert loaded["conv.weight"].dtype == torch.bfloat16
    assert loaded["bn.num_batches_tracked"].dtype == torch.long
    assert torch.equal(loaded["conv.weight"], ema.ema_model.conv.weight.bfloat16())
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["dtypes"] == "bfloat16,int64"


def test_load_round_trip_keeps_shadow_dtype_and_step(tmp_path):
    net = Net().to(torch.bfloat16)
    ema = EMA(net, ema_dtype=torch.float32, beta=0.9, update_after_step=1, update_every=2)
    train(net, [ema], 9, **TOKENS)
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    fresh_net = Net(seed=3).to(torch.bfloat16)
    fresh = EMA(fresh_net, ema_dtype=torch.float32, beta=0.9, update_after_step=1, update_every=2)
    meta = load_ema_weights(fresh, path)
    assert meta["step"] == "9"
    assert int(fresh.step) == 9 and bool(fresh.initted)
    assert fresh.ema_model.conv.weight.dtype == torch.float32
    assert_same(fresh.ema_model.state_dict(), ema.ema_model.state_dict())
    # a bf16 export loads into the fp32 shadow, which stays fp32
    bf16 = save_ema_weights(ema, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    load_ema_weights(fresh, bf16)
    assert fresh.ema_model.conv.weight.dtype == torch.float32
    assert torch.equal(fresh.ema_model.conv.weight, ema.ema_model.conv.weight.bfloat16().float())


def test_weights_and_step_resume_exactly(tmp_path):
    kw = dict(beta=0.95, update_after_step=2, update_every=2)
    net_a = Net()
    ema_a = EMA(net_a, **kw)
    train(net_a, [ema_a], 8, **TOKENS)
    path = save_ema_weights(ema_a, tmp_path / "ema.safetensors")
    net_b = Net(seed=5)
    net_b.load_state_dict(net_a.state_dict())
    ema_b = EMA(net_b, **kw)
    load_ema_weights(ema_b, path)
    train(net_a, [ema_a], 7, loss=token_loss, seed=9)
    train(net_b, [ema_b], 7, loss=token_loss, seed=9)
    assert_same(ema_b.ema_model.state_dict(), ema_a.ema_model.state_dict())


def test_load_without_restoring_step_marks_initted(tmp_path):
    net = Net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train(net, [ema], 3, **TOKENS)
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    fresh = EMA(Net(seed=2))
    load_ema_weights(fresh, path, restore_step=False)
    assert int(fresh.step) == 0 and bool(fresh.initted)
    # a plain safetensors of the model (no emakit header, tied weight stored once) loads too
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_model(Net(seed=4), str(plain))
    meta = load_ema_weights(fresh, plain)
    assert "format" not in meta
    assert torch.equal(fresh.ema_model.conv.weight, Net(seed=4).conv.weight)


def test_pytree_export_round_trip(tmp_path):
    tree = {"w": torch.randn(3, 3), "layers": [torch.randn(4), torch.tensor([1, 2])]}
    ema = EMAPytree(tree, update_after_step=0, update_every=1, beta=0.5)
    ema.update()
    tree["w"].add_(1.0)
    ema.update()
    path = save_ema_weights(ema, tmp_path / "tree.safetensors")
    assert set(safetensors.torch.load_file(path)) == {"w", "layers.0", "layers.1"}
    fresh = EMAPytree({"w": torch.zeros(3, 3), "layers": [torch.zeros(4), torch.tensor([0, 0])]})
    load_ema_weights(fresh, path)
    assert torch.equal(fresh.ema_pytree["w"], ema.ema_pytree["w"])
    assert torch.equal(fresh.ema_pytree["layers"][1], torch.tensor([1, 2]))
    assert int(fresh.step) == 2
    with pytest.raises(EMAStateError, match="pytree"):
        load_ema_weights(EMA(Net()), path)


def test_a_partitioned_ema_saves_and_loads_whole_tensors(tmp_path):
    """One verb for every EMA: save_ema_weights of EMA(partition=True) writes the model's
    own shapes (not the flat partitions), and load_ema_weights reads them back into a
    partitioned EMA; the `_full_` names do the same."""
    from emakit.distributed import load_full_ema_weights, save_full_ema_weights

    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema = EMA(net, partition=True, update_after_step=0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        net(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        ema.update()
    path = save_ema_weights(ema, tmp_path / "parted.safetensors")
    loaded = safetensors.torch.load_file(path)
    assert {k: tuple(v.shape) for k, v in loaded.items() if k.endswith("weight")} == {
        "0.weight": (3, 4),
        "1.weight": (3,),
    }
    plain = EMA(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    load_ema_weights(plain, path)
    for name, t in plain.ema_model.state_dict().items():
        assert torch.equal(t, loaded[name]), name
    again = EMA(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), partition=True)
    assert load_full_ema_weights(again, path)["step"] == "3" and int(again.step) == 3
    resaved = safetensors.torch.load_file(save_full_ema_weights(again, tmp_path / "b.st"))
    assert_same(resaved, loaded)


def test_swap_in_place_is_swap_in_place():
    from emakit.distributed import swap_in_place

    net = nn.Linear(2, 2)
    ema = EMA(net, beta=0.5, update_after_step=0)
    with torch.no_grad():
        net.weight.add_(1.0)
    ema.update()
    before = net.weight.detach().clone()
    with swap_in_place(ema) as swap:
        assert torch.equal(net.weight, ema.ema_model.weight) and swap is not None
    assert torch.equal(net.weight, before)
    with pytest.raises(TypeError, match="ema must be an emakit EMA"):
        swap_in_place(net)


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    net = Net()
    ema = EMA(net)
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    before = path.read_bytes()
    from emakit._files import export

    real, written = export.write_tensor, []

    def broken(f, t, dtype=None):  # the disk fills up after two tensors
        if len(written) == 2:
            raise OSError("disk full")
        written.append(t)
        real(f, t, dtype)

    monkeypatch.setattr(export, "write_tensor", broken)
    with torch.no_grad():
        ema.ema_model.conv.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_ema_weights(ema, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ema.safetensors"]
    assert not any(io_mod.TEMP_PREFIX in p.name for p in tmp_path.iterdir())


# -- foreign checkpoints --------------------------------------------------------------------


def emakit_ema(seed: int = 11, **kw) -> EMA:
    kw.setdefault("update_after_step", 0)
    return EMA(Net(seed=seed), **kw)


@pytest.mark.parametrize("include_online_model", [True, False])
def test_ema_pytorch(tmp_path, include_online_model):
    ema_pytorch = pytest.importorskip("ema_pytorch")
    net = Net()
    theirs = ema_pytorch.EMA(
        net,
        beta=0.9,
        update_after_step=2,
        update_every=2,
        include_online_model=include_online_model,
    )
    train(net, [theirs], 9, **TOKENS)
    sd = theirs.state_dict()
    assert any(k.startswith("online_model.") for k in sd) == include_online_model
    assert detect_format(sd) == "ema_pytorch"
    ours = emakit_ema(beta=0.9, update_after_step=2, update_every=2)
    assert load_foreign_state(ours, sd) == "ema_pytorch"
    assert_same(ours.ema_model.state_dict(), theirs.ema_model.state_dict())
    assert int(ours.step) == int(theirs.step) == 9
    # from a file, and continuing gives ema-pytorch's numbers
    torch.save(sd, tmp_path / "ema.pt")
    again = emakit_ema(beta=0.9, update_after_step=2, update_every=2, use_foreach=False)
    again.model.load_state_dict(net.state_dict())
    load_foreign_state(again, tmp_path / "ema.pt")
    train(net, [theirs], 4, loss=token_loss, seed=3)
    train(again.model, [again], 4, loss=token_loss, seed=3)
    for k, v in theirs.ema_model.state_dict().items():
        if v.is_floating_point():  # ema-pytorch never updates integer buffers; emakit copies them
            assert torch.allclose(again.ema_model.state_dict()[k], v, atol=1e-6), k


def test_timm_training_checkpoint_file(tmp_path):
    timm_utils = pytest.importorskip("timm.utils")
    net = Net()
    model_ema = timm_utils.ModelEmaV3(net, decay=0.9)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train(net, (), 6, then=lambda i: model_ema.update(net), **TOKENS)
    saver = timm_utils.CheckpointSaver(
        net, opt, model_ema=model_ema, checkpoint_dir=str(tmp_path), recovery_dir=str(tmp_path)
    )
    saver.save_checkpoint(epoch=0, metric=1.0)
    files = sorted(tmp_path.glob("*.pth.tar"))
    assert files, list(tmp_path.iterdir())
    ckpt = torch.load(files[0], weights_only=True)
    assert "state_dict_ema" in ckpt and "optimizer" in ckpt
    ours = emakit_ema()
    assert load_foreign_state(ours, files[0], step=6) == "timm"
    assert_same(ours.ema_model.state_dict(), model_ema.module.state_dict())
    assert int(ours.step) == 6


@pytest.mark.parametrize("version", ["ModelEmaV2", "ModelEmaV3"])
def test_timm_model_ema_state_dict(version):
    timm_utils = pytest.importorskip("timm.utils")
    net = Net()
    model_ema = getattr(timm_utils, version)(net, decay=0.8)
    train(net, (), 4, then=lambda i: model_ema.update(net), **TOKENS)
    sd = model_ema.state_dict()
    assert all(k.startswith("module.") for k in sd)
    ours = emakit_ema()
    with pytest.warns(UserWarning, match="step="):
        assert load_foreign_state(ours, sd) == "timm"
    assert_same(ours.ema_model.state_dict(), model_ema.module.state_dict())
    # the live object works too (its state_dict() is taken)
    ours2 = emakit_ema()
    quiet_load(ours2, model_ema, step=4)
    assert_same(ours2.ema_model.state_dict(), model_ema.module.state_dict())


def test_torch_ema():
    torch_ema = pytest.importorskip("torch_ema")
    net = Net()
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9)
    train(net, [theirs], 5, **TOKENS)
    sd = theirs.state_dict()
    assert detect_format(sd) == "torch_ema"
    ours = emakit_ema()
    buffers_before = {k: v.clone() for k, v in ours.ema_model.named_buffers()}
    with pytest.warns(UserWarning, match=r"torch_ema averages parameters only.*bn.running_mean"):
        assert load_foreign_state(ours, sd) == "torch_ema"
    params = dict(ours.ema_model.named_parameters())
    assert len(params) == len(theirs.shadow_params)
    for (name, p), shadow in zip(params.items(), theirs.shadow_params, strict=True):
        assert torch.equal(p, shadow), name
    assert ours.ema_model.head.weight is ours.ema_model.emb.weight
    for k, v in ours.ema_model.named_buffers():
        assert torch.equal(v, buffers_before[k]), k  # torch_ema does not track buffers
    assert int(ours.step) == 5 + 1  # torch_ema's update n is emakit's call n + 1


def test_torch_ema_count_and_shape_mismatch_are_errors():
    torch_ema = pytest.importorskip("torch_ema")
    net = Net()
    partial = torch_ema.ExponentialMovingAverage(list(net.parameters())[1:], decay=0.9)
    with pytest.raises(EMAStateError, match=r"holds 4 shadow_params but the model has 5"):
        load_foreign_state(emakit_ema(), partial.state_dict())

    class Other(Net):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(6, 6, 5, padding=2)

    other = torch_ema.ExponentialMovingAverage(Other().parameters(), decay=0.9)
    with pytest.raises(EMAStateError, match=r"shadow_params\[1\].*'conv.weight'"):
        load_foreign_state(emakit_ema(), other.state_dict())


@pytest.mark.parametrize("use_buffers", [True, False])
def test_averaged_model(tmp_path, use_buffers):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    net = Net()
    theirs = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=use_buffers)
    train(net, (), 6, then=lambda i: theirs.update_parameters(net), **TOKENS)
    sd = theirs.state_dict()
    assert detect_format(sd) == "averaged_model"
    torch.save(sd, tmp_path / "swa.pt")
    ours = emakit_ema()
    assert load_foreign_state(ours, tmp_path / "swa.pt") == "averaged_model"
    assert_same(ours.ema_model.state_dict(), theirs.module.state_dict())
    assert int(ours.step) == 6


def test_diffusers_ema_model(tmp_path):
    EMAModel = need("diffusers.training_utils").EMAModel
    net = Net()
    theirs = EMAModel(net.parameters(), decay=0.9, use_ema_warmup=True, power=0.75)
    train(net, (), 7, then=lambda i: theirs.step(net.parameters()), **TOKENS)
    sd = theirs.state_dict()
    assert detect_format(sd) == "diffusers"
    torch.save(sd, tmp_path / "ema.pt")
    ours = emakit_ema()
    assert load_foreign_state(ours, tmp_path / "ema.pt") == "diffusers"
    for (name, p), shadow in zip(
        ours.ema_model.named_parameters(), theirs.shadow_params, strict=True
    ):
        assert torch.equal(p, shadow), name
    assert int(ours.step) == theirs.optimization_step == 7


def test_emakit_and_plain_state_dicts(tmp_path):
    src = EMA(Net(), beta=0.9, update_after_step=0, update_every=1)
    train(src.model, [src], 3, **TOKENS)
    ours = emakit_ema()
    assert load_foreign_state(ours, src.state_dict()) == "emakit"
    assert_same(ours.ema_model.state_dict(), src.ema_model.state_dict())
    # a plain model state_dict, a DDP-prefixed one, and the emakit safetensors export
    plain = emakit_ema()
    assert quiet_load(plain, src.ema_model.state_dict(), step=3) == "state_dict"
    assert_same(plain.ema_model.state_dict(), src.ema_model.state_dict())
    ddp = {f"module.{k}": v for k, v in src.ema_model.state_dict().items()}
    assert quiet_load(emakit_ema(), ddp, format="state_dict", step=3) == "state_dict"
    compiled = {f"_orig_mod.{k}": v for k, v in src.ema_model.state_dict().items()}
    assert quiet_load(emakit_ema(), compiled, step=3) == "state_dict"
    path = save_ema_weights(src, tmp_path / "ema.safetensors")
    from_file = emakit_ema()
    assert load_foreign_state(from_file, path) == "state_dict"
    assert int(from_file.step) == 3  # from the emakit header
    assert_same(from_file.ema_model.state_dict(), src.ema_model.state_dict())


def test_module_named_module_is_not_stripped():
    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    src = EMA(Wrap())
    ours = EMA(Wrap(), update_after_step=0)
    quiet_load(ours, src.ema_model.state_dict(), step=1)
    assert torch.equal(ours.ema_model.module.weight, src.ema_model.module.weight)


def test_shadow_dtype_is_kept_on_foreign_load():
    torch_ema = pytest.importorskip("torch_ema")
    net = Net().to(torch.bfloat16)
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9)
    theirs.update()
    ours = EMA(Net(seed=2).to(torch.bfloat16), ema_dtype=torch.float32, update_after_step=0)
    load_foreign_state(ours, theirs.state_dict())
    assert ours.ema_model.conv.weight.dtype == torch.float32
    assert torch.equal(ours.ema_model.conv.weight, theirs.shadow_params[1].float())


def test_warm_up_warning_and_step_override():
    torch_ema = pytest.importorskip("torch_ema")
    net = Net()
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9)
    theirs.update()
    with pytest.warns(UserWarning, match="update_after_step=100"):
        load_foreign_state(EMA(Net()), theirs.state_dict())
    ours = EMA(Net())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*update_after_step")  # no warm-up warning
        load_foreign_state(ours, theirs.state_dict(), step=500)
    assert int(ours.step) == 500


@pytest.mark.parametrize("fmt", [f for f in FOREIGN_FORMATS if f != "emakit"])
def test_mismatched_model_names_the_source(tmp_path, fmt):
    torch_ema = pytest.importorskip("torch_ema")
    from torch.optim.swa_utils import AveragedModel

    other = nn.Sequential(nn.Linear(3, 3))
    builders = {
        "ema_pytorch": lambda: pytest.importorskip("ema_pytorch").EMA(other).state_dict(),
        "timm": lambda: {"state_dict_ema": other.state_dict(), "epoch": 1},
        "torch_ema": lambda: torch_ema.ExponentialMovingAverage(
            other.parameters(), 0.9
        ).state_dict(),
        "averaged_model": lambda: AveragedModel(other).state_dict(),
        "diffusers": lambda: {
            "shadow_params": [p.detach() for p in other.parameters()],
            "optimization_step": 3,
            "decay": 0.9,
        },
        "lightning": lambda: {
            "state_dict": other.state_dict(),
            "averaging_state": {"n_averaged": torch.tensor(4)},
            "current_model_state": other.state_dict(),
        },
        "state_dict": lambda: other.state_dict(),
    }
    path = tmp_path / f"{fmt}.pt"
    torch.save(builders[fmt](), path)
    with pytest.raises(EMAStateError) as info:
        quiet_load(emakit_ema(), path, step=1)  # a plain state dict needs a step
    assert str(path) in str(info.value)
    words = ("missing", "Missing", "shadow_params", "shape")
    assert any(w in str(info.value) for w in words), info.value


def test_unknown_format_lists_accepted_formats():
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(emakit_ema(), {"model": {}, "optimizer": {}})
    msg = str(info.value)
    assert "'model'" in msg and "'optimizer'" in msg
    for fmt in FOREIGN_FORMATS:
        assert fmt in msg
    with pytest.raises(
        EMAStateError, match=r"format='torch_ema' needs the keys \['shadow_params'\]"
    ):
        load_foreign_state(emakit_ema(), {"num_updates": 3}, format="torch_ema")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shadow_export_and_loads_keep_device_and_dtype(tmp_path):
    torch_ema = pytest.importorskip("torch_ema")
    net = Net().cuda().to(torch.bfloat16)
    ema = EMA(net, ema_dtype=torch.float32, beta=0.9, update_after_step=0, update_every=1)
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01)
        ema.update()
    path = save_ema_weights(ema, tmp_path / "ema.safetensors")
    cpu = safetensors.torch.load_file(path)
    assert cpu["conv.weight"].dtype == torch.float32
    assert_same(cpu, {k: v.cpu() for k, v in ema.ema_model.state_dict().items()})
    fresh = EMA(Net(seed=3).cuda().to(torch.bfloat16), ema_dtype=torch.float32)
    load_ema_weights(fresh, path)
    w = fresh.ema_model.conv.weight
    assert w.is_cuda and w.dtype == torch.float32
    assert torch.equal(w, ema.ema_model.conv.weight)
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9)
    theirs.update()
    load_foreign_state(fresh, theirs.state_dict(), step=10)
    assert fresh.ema_model.conv.weight.is_cuda
    assert torch.equal(fresh.ema_model.conv.weight, theirs.shadow_params[1].float())


@pytest.mark.parametrize("step", [0, 40])
def test_step_overrides_the_count_of_emakit_and_ema_pytorch_states(tmp_path, step):
    """``step=`` sets the step for every format (documented: it overrides the checkpoint's
    count), the two that carry their own ``step`` entry included; the caller's state is
    left as it was."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    src = EMA(Net(), beta=0.9, update_after_step=0, update_every=1)
    train(src.model, [src], 3, **TOKENS)
    net = Net()
    theirs = ema_pytorch.EMA(net, beta=0.9, update_after_step=0, update_every=1)
    train(net, [theirs], 5, **TOKENS)
    path = save_ema_weights(src, tmp_path / "ema.safetensors")  # its header: step 3
    for state, fmt, count, weights in [
        (src.state_dict(), "emakit", 3, src.ema_model.state_dict()),
        (theirs.state_dict(), "ema_pytorch", 5, theirs.ema_model.state_dict()),
        (path, "state_dict", 3, src.ema_model.state_dict()),
    ]:
        counted = emakit_ema()
        assert quiet_load(counted, state) == fmt
        assert int(counted.step) == count  # without step=: the checkpoint's own count
        ours = emakit_ema()
        assert quiet_load(ours, state, step=step) == fmt
        assert int(ours.step) == step, fmt
        assert_same(ours.ema_model.state_dict(), weights)
        if not isinstance(state, type(path)):
            assert int(state["step"]) == count  # not written into the caller's dict
        ours.update()  # the next update goes on from the step given
        assert int(ours.step) == step + 1


# -- export and load checks (from the fault reproducers) ---------------------------------------


def test_a_lossy_float16_export_raises_naming_the_tensor_and_magnitude(tmp_path: Path):
    ema = EMA(float16_overflow_linear())
    dest = tmp_path / "ema.safetensors"
    with pytest.raises(EMAValueError, match=r"'weight'.*100000.*65504"):
        save_ema_weights(ema, dest, dtype=torch.float16)
    assert not dest.exists()
    save_ema_weights(ema, dest, dtype=torch.bfloat16)  # float32's range: fine
    save_ema_weights(EMA(nn.Linear(4, 2)), tmp_path / "small.safetensors", dtype=torch.float16)


def test_load_ema_weights_strict_false_names_the_extra_and_missing_tensors(tmp_path: Path):
    import safetensors.torch

    from emakit.checkpoint import load_ema_weights

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"weight": torch.ones(2, 3), "stray.bias": torch.ones(2)}, path)
    ema = EMA(nn.Linear(3, 2))
    with pytest.warns(UserWarning, match=r"1 name\(s\).*stray\.bias.*1 tensor\(s\).*bias"):
        load_ema_weights(ema, path, strict=False)
    assert torch.equal(ema.ema_model.weight, torch.ones(2, 3))
