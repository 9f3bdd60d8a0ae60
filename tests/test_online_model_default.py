"""``include_online_model`` defaults to True, as in ema-pytorch 0.8.3; emakit's own
checkpoints (sharded saves, exports, snapshots, MultiEMA, the integrations) still leave
the online model out and do not grow."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import ema_pytorch
import pytest
import torch
import torch.distributed.checkpoint
from torch import nn

from _models import bn_mlp as _bn_mlp
from _models import frozen_base
from emakit import EMA, EMAStateError, MultiEMA, PostHocEMA
from emakit.checkpoint import save_ema_weights
from emakit.distributed import load_sharded_ema, save_sharded_ema


def bn_mlp(seed: int = 0) -> nn.Sequential:
    return _bn_mlp(3, 4, 2, seed=seed)


def trained(ema: EMA, net: nn.Module, steps: int = 4) -> EMA:
    for i in range(steps):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * (i + 1))
        ema.update()
    return ema


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_default_state_round_trips_strictly_with_ema_pytorch_defaults():
    net = bn_mlp()
    ours = trained(EMA(net, update_after_step=1, update_every=1), net)
    assert ours.include_online_model is True
    theirs = ema_pytorch.EMA(copy.deepcopy(net), update_after_step=1, update_every=1)
    theirs.load_state_dict(ours.state_dict())  # strict: online_model.* present both ways
    for (k, a), b in zip(
        ours.ema_model.state_dict().items(), theirs.ema_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), k
    back = EMA(bn_mlp(seed=1), update_after_step=1, update_every=1)
    back.load_state_dict(theirs.state_dict())
    assert int(back.step) == 4


def test_a_state_without_the_online_model_loads_strictly_and_keeps_the_model():
    net = bn_mlp()
    saved = trained(EMA(net, update_after_step=1, update_every=1), net)
    small = saved.state_dict(include_online_model=False)
    assert not any(k.startswith("online_model.") for k in small)
    other = bn_mlp(seed=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    ema = EMA(other, update_after_step=1, update_every=1)
    ema.load_state_dict(small)  # strict
    assert int(ema.step) == 4
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k  # the online model is left as it was
    theirs_small = ema_pytorch.EMA(copy.deepcopy(net), include_online_model=False).state_dict()
    EMA(bn_mlp(seed=4)).load_state_dict(theirs_small)

    class Parent(nn.Module):  # an EMA inside a parent module, loaded through the parent
        def __init__(self) -> None:
            super().__init__()
            self.ema = EMA(bn_mlp(seed=5), update_after_step=1, update_every=1)

    parent = Parent()
    parent.load_state_dict({"ema." + k: v for k, v in small.items()})
    assert int(parent.ema.step) == 4
    with pytest.raises(RuntimeError, match=r"ema\.ema_model\.0\.weight"):  # others still missing
        parent.load_state_dict({"ema." + k: v for k, v in small.items() if "0.weight" not in k})


def test_include_online_model_false_is_the_smaller_checkpoint(tmp_path: Path):
    net = bn_mlp()
    default, small = EMA(net), EMA(net, include_online_model=False)
    torch.save(default.state_dict(), tmp_path / "default.pt")
    torch.save(small.state_dict(), tmp_path / "small.pt")
    assert os.path.getsize(tmp_path / "small.pt") < os.path.getsize(tmp_path / "default.pt")
    assert set(small.state_dict(include_online_model=True)) == set(small.state_dict())


def test_sharded_saves_and_exports_do_not_grow(tmp_path: Path):
    net = bn_mlp()
    default = trained(EMA(net, update_after_step=1, update_every=1), net)
    small = trained(
        EMA(copy.deepcopy(net), update_after_step=1, update_every=1, include_online_model=False),
        copy.deepcopy(net),
    )
    save_sharded_ema(default, tmp_path / "default")
    save_sharded_ema(small, tmp_path / "small")
    keys = {}
    for name in ("default", "small"):
        (meta,) = (tmp_path / name).rglob(".metadata")
        reader = torch.distributed.checkpoint.FileSystemReader(meta.parent)
        keys[name] = set(reader.read_metadata().state_dict_metadata)
    assert keys["default"] == keys["small"] == set(small.state_dict())
    # the same bytes, but for a few of the random version name's in the metadata
    assert abs(folder_bytes(tmp_path / "default") - folder_bytes(tmp_path / "small")) < 16
    load_sharded_ema(EMA(bn_mlp(seed=2)), tmp_path / "default")  # and loads back
    save_ema_weights(default, tmp_path / "default.safetensors")
    save_ema_weights(small, tmp_path / "small.safetensors")
    size = os.path.getsize
    assert size(tmp_path / "default.safetensors") == size(tmp_path / "small.safetensors")


def test_multi_ema_and_posthoc_hold_no_online_model(tmp_path: Path):
    net = bn_mlp()
    multi = MultiEMA(net, betas=(0.9, 0.99))
    assert not any("online_model." in k for k in multi.state_dict())
    posthoc = PostHocEMA(net, sigma_rels=(0.05, 0.28), checkpoint_folder=tmp_path / "s")
    theirs = ema_pytorch.PostHocEMA(
        copy.deepcopy(net), sigma_rels=(0.05, 0.28), checkpoint_folder=str(tmp_path / "t")
    )
    assert set(posthoc.state_dict()) == set(theirs.state_dict())
    assert not any("online_model." in k for k in posthoc.state_dict())


@pytest.mark.parametrize("include_online_model", [True, False])
def test_half_converts_the_model_only_when_it_is_held_and_updates_then_need_coerce_dtype(
    include_online_model,
):
    """docs/finetuning.md: ``ema.half()`` converts every module the EMA holds, the online
    model with ``include_online_model=True`` (as ema-pytorch's does); otherwise the model
    keeps its dtype, and ``update()`` needs ``coerce_dtype=True`` (ema-pytorch's too)."""
    net = bn_mlp()
    ema = EMA(net, include_online_model=include_online_model, update_after_step=0, update_every=1)
    ema.update()
    ema.half()
    floating = {p.dtype for p in net.parameters()}
    assert floating == {torch.float16 if include_online_model else torch.float32}
    assert {p.dtype for p in ema.ema_model.parameters()} == {torch.float16}
    peer_net = bn_mlp()
    ema_pytorch.EMA(peer_net, include_online_model=include_online_model).half()
    assert {p.dtype for p in peer_net.parameters()} == floating
    if include_online_model:
        ema.update()  # model and EMA both float16
        return
    with pytest.raises(EMAStateError, match="coerce_dtype=True"):
        ema.update()
    coerced = EMA(net, include_online_model=False, coerce_dtype=True, update_every=1)
    coerced.update()
    coerced.half()
    coerced.update()  # the float32 model averaged into the float16 EMA
    assert {p.dtype for p in net.parameters()} == {torch.float32}


# -- half() converts the online model it holds (issue 30, item 18) ---------------------------


def test_half_converts_the_online_model_with_include_online_model_as_ema_pytorch():
    """docs/finetuning.md said ``ema.half()`` never converts the model. With the default
    ``include_online_model=True`` the model is a child of the EMA and is converted, as
    ema-pytorch's is; with ``include_online_model=False`` the model (and the frozen weight
    it shares with the EMA) is left as it was."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    peer_net = frozen_base()
    ema_pytorch.EMA(peer_net).half()
    assert peer_net[1].weight.dtype == torch.float16  # the peer converts the model

    net = frozen_base()
    EMA(net).half()
    assert {p.dtype for p in net.parameters()} == {torch.float16}

    net = frozen_base()
    base = net[0].weight.detach().clone()
    ema = EMA(net, include_online_model=False, update_after_step=0, update_every=1)
    ema.update()
    ema.half()
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert torch.equal(net[0].weight, base)
    assert {p.dtype for p in ema.ema_model.parameters()} == {torch.float16}


def test_the_finetuning_doc_says_half_converts_the_online_model():
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "finetuning.md").read_text().split())
    assert "never the model" not in text
    assert "include_online_model=False" in text
