"""A catalog of bad inputs across the public API, and of bad files.

Each case asserts the exception type (an ``emakit.EMAError`` that is also the fitting
builtin) and that the message names the argument (or the file) and what is wrong. The
``EMA`` constructor's own table lives in ``test_ema.py``; this covers everything else.
"""

from __future__ import annotations

import pickle
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import emakit
from _headers import rewrite_metadata
from _models import bn_mlp
from emakit import (
    EMA,
    EMAError,
    EMAPytree,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
    PostHocEMA,
    schedules,
)
from emakit.checkpoint import (
    EMAFileNotFoundError,
    load_ema_weights,
    save_ema_weights,
)
from emakit.foreign import load_foreign_state

make_net = partial(bn_mlp, 3, 4, 2)


@pytest.fixture
def ctx(tmp_path: Path) -> SimpleNamespace:
    net = make_net()
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()
    saved = save_ema_weights(ema, tmp_path / "ema.safetensors")
    other = EMA(nn.Sequential(nn.Linear(3, 5)))
    other_file = save_ema_weights(other, tmp_path / "other.safetensors")
    wide = EMA(nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)))
    wide_file = save_ema_weights(wide, tmp_path / "wide.safetensors")
    return SimpleNamespace(
        tmp=tmp_path,
        net=net,
        ema=ema,
        saved=saved,
        other_file=other_file,
        wide_file=wide_file,
        tree=EMAPytree({"w": torch.zeros(3)}),
    )


def edit_header(src: Path, dst: Path, **changes: str) -> Path:
    """A copy of a safetensors file with header metadata entries replaced."""
    shutil.copyfile(src, dst)
    rewrite_metadata(dst, **changes)
    return dst


@dataclass
class Case:
    id: str
    call: Callable[[SimpleNamespace], Any]
    error: type[EMAError]
    names: tuple[str, ...]  # each must appear in the message; "{tmp}" is the tmp folder


def bad_state(ctx: SimpleNamespace) -> dict:
    sd = ctx.ema.state_dict()
    sd["ema_model.0.weight"] = torch.zeros(9, 9)
    return sd


CASES = [
    # -- EMAPytree ------------------------------------------------------------------------
    Case("pytree-not-tensors", lambda c: EMAPytree([1, "a"]), EMATypeError, ("pytree",)),
    Case("pytree-beta", lambda c: EMAPytree(torch.zeros(2), beta=2.0), EMAValueError, ("beta",)),
    Case(
        "pytree-update_every",
        lambda c: EMAPytree(torch.zeros(2), update_every=0),
        EMAValueError,
        ("update_every",),
    ),
    Case(
        "pytree-use_foreach",
        lambda c: EMAPytree(torch.zeros(2), use_foreach="x"),
        EMATypeError,
        ("use_foreach",),
    ),
    Case(
        "pytree-ema_dtype",
        lambda c: EMAPytree(torch.zeros(2), ema_dtype=torch.int32),
        EMATypeError,
        ("ema_dtype",),
    ),
    Case(
        "pytree-schedule",
        lambda c: EMAPytree(torch.zeros(2), schedule=0.99),
        EMATypeError,
        ("schedule",),
    ),
    Case(
        "pytree-shape",
        lambda c: EMAPytree(torch.zeros(2), ema_pytree=torch.zeros(3)),
        EMAStateError,
        ("leaf", "shape"),
    ),
    Case(
        "pytree-structure",
        lambda c: EMAPytree({"a": torch.zeros(2)}, ema_pytree={"b": torch.zeros(2)}),
        EMAStateError,
        ("ema_pytree", "'a'", "'b'"),
    ),
    Case(
        "pytree-dtype",
        lambda c: EMAPytree(torch.zeros(2), ema_pytree=torch.zeros(2).double()),
        EMAStateError,
        ("coerce_dtype",),
    ),
    # -- EMA methods ----------------------------------------------------------------------
    Case(
        "update_model_with_ema-decay-type",
        lambda c: c.ema.update_model_with_ema(decay="0.5"),
        EMATypeError,
        ("decay",),
    ),
    Case(
        "update_model_with_ema-decay-range",
        lambda c: c.ema.update_model_with_ema(decay=-0.1),
        EMAValueError,
        ("decay",),
    ),
    Case(
        "optimizer-hook",
        lambda c: c.ema.add_to_optimizer_post_step_hook(None),
        EMATypeError,
        ("optimizer",),
    ),
    Case("update-in-swap", lambda c: _update_in_swap(c.ema), EMARuntimeError, ("swap",)),
    # update(model), timm's habit: the EMA follows the model given at construction
    Case(
        "update-model",
        lambda c: c.ema.update(c.net),
        EMATypeError,
        ("EMA.update() takes no model", "update(Sequential)", "ema.update()", "ModelEmaV3"),
    ),
    Case(
        "update-model-step",
        lambda c: c.ema.update(c.net, 3),
        EMATypeError,
        ("takes no model", "update(Sequential, int)", "ema.update()"),
    ),
    Case(
        "pytree-update-model",
        lambda c: c.tree.update(c.net),
        EMATypeError,
        ("EMAPytree.update() takes no model", "pytree given at construction"),
    ),
    Case(
        "karras-update-model",
        lambda c: emakit.KarrasEMA(c.net, sigma_rel=0.1).update(c.net),
        EMATypeError,
        ("KarrasEMA.update() takes no model", "ema.update()"),
    ),
    Case(
        "posthoc-update-model",
        lambda c: emakit.PostHocEMA(c.net, checkpoint_folder=c.tmp / "ph").update(c.net),
        EMATypeError,
        ("PostHocEMA.update() takes no model", "update(Sequential)", "posthoc.update()"),
    ),
    # -- load_state_dict ------------------------------------------------------------------
    Case(
        "load_state_dict-type", lambda c: c.ema.load_state_dict(42), EMATypeError, ("state_dict",)
    ),
    Case(
        "load_state_dict-assign",
        lambda c: c.ema.load_state_dict(c.ema.state_dict(), assign=True),
        EMAValueError,
        ("assign",),
    ),
    Case(
        "load_state_dict-shape",
        lambda c: c.ema.load_state_dict(bad_state(c)),
        EMAStateError,
        ("ema_model.0.weight",),
    ),
    Case(
        "pytree-load_state_dict-shape",
        lambda c: c.tree.load_state_dict({**c.tree.state_dict(), "ema.w": torch.zeros(5)}),
        EMAStateError,
        ("ema.w",),
    ),
    Case(
        "pytree-load_state_dict-version",
        lambda c: c.tree.load_state_dict({**c.tree.state_dict(), "version": torch.tensor(99)}),
        EMAStateError,
        ("version",),
    ),
    # -- save_ema_weights -----------------------------------------------------------------
    Case(
        "save-not-ema",
        lambda c: save_ema_weights(c.net, c.tmp / "x.safetensors"),
        EMATypeError,
        ("ema", "Sequential"),
    ),
    Case("save-path-type", lambda c: save_ema_weights(c.ema, 123), EMATypeError, ("path",)),
    Case(
        "save-dtype",
        lambda c: save_ema_weights(c.ema, c.tmp / "x", dtype=torch.int8),
        EMATypeError,
        ("dtype",),
    ),
    Case(
        "save-metadata-clash",
        lambda c: save_ema_weights(c.ema, c.tmp / "x", metadata={"step": "1"}),
        EMAValueError,
        ("metadata", "step"),
    ),
    Case(
        "save-metadata-type",
        lambda c: save_ema_weights(c.ema, c.tmp / "x", metadata={"a": 1}),
        EMATypeError,
        ("metadata",),
    ),
    Case(
        "save-lazy",
        lambda c: save_ema_weights(EMA(make_net(), lazy_init_ema=True), c.tmp / "x"),
        EMARuntimeError,
        ("update()",),
    ),
    # -- load_ema_weights -----------------------------------------------------------------
    Case(
        "load-missing-file",
        lambda c: load_ema_weights(c.ema, c.tmp / "nope.safetensors"),
        EMAFileNotFoundError,
        ("nope.safetensors", "does not exist"),
    ),
    Case(
        "load-folder", lambda c: load_ema_weights(c.ema, c.tmp), EMAValueError, ("path", "folder")
    ),
    Case("load-path-type", lambda c: load_ema_weights(c.ema, None), EMATypeError, ("path",)),
    Case("load-not-ema", lambda c: load_ema_weights({}, c.saved), EMATypeError, ("ema",)),
    Case(
        "load-strict-type",
        lambda c: load_ema_weights(c.ema, c.saved, strict="yes"),
        EMATypeError,
        ("strict",),
    ),
    Case(
        "load-restore_step-type",
        lambda c: load_ema_weights(c.ema, c.saved, restore_step=1),
        EMATypeError,
        ("restore_step",),
    ),
    Case(
        "load-other-model",
        lambda c: load_ema_weights(c.ema, c.other_file),
        EMAStateError,
        ("other.safetensors", "missing", "'1.running_mean'"),
    ),
    Case(
        "load-other-shapes",
        lambda c: load_ema_weights(c.ema, c.wide_file),
        EMAStateError,
        ("wide.safetensors", "0.weight", "(6, 3)", "(4, 3)"),
    ),
    Case(
        "load-newer-format",
        lambda c: load_ema_weights(
            c.ema, edit_header(c.saved, c.tmp / "v9.st", format_version="9")
        ),
        EMAStateError,
        ("v9.st", "format_version=9"),
    ),
    Case(
        "load-bad-step-header",
        lambda c: load_ema_weights(c.ema, edit_header(c.saved, c.tmp / "s.st", step="ten")),
        EMAStateError,
        ("s.st", "step='ten'"),
    ),
    Case(
        "load-into-pytree",
        lambda c: load_ema_weights(c.tree, c.saved),
        EMAStateError,
        ("ema.safetensors", "pytree"),
    ),
    # -- load_foreign_state ---------------------------------------------------------------
    Case(
        "foreign-format-name",
        lambda c: load_foreign_state(c.ema, {}, format="keras"),
        EMAValueError,
        ("format", "keras", "torch_ema"),
    ),
    Case(
        "foreign-format-type",
        lambda c: load_foreign_state(c.ema, {}, format=None),
        EMATypeError,
        ("format",),
    ),
    Case(
        "foreign-step-negative",
        lambda c: load_foreign_state(c.ema, {}, step=-1),
        EMAValueError,
        ("step",),
    ),
    Case(
        "foreign-step-type",
        lambda c: load_foreign_state(c.ema, {}, step=1.5),
        EMATypeError,
        ("step",),
    ),
    Case(
        "foreign-strict-type",
        lambda c: load_foreign_state(c.ema, {}, strict=None),
        EMATypeError,
        ("strict",),
    ),
    Case(
        "foreign-unknown-object",
        lambda c: load_foreign_state(c.ema, 42),
        EMAStateError,
        ("an int", "accepted formats", "ema_pytorch"),
    ),
    Case(
        "foreign-unknown-keys",
        lambda c: load_foreign_state(c.ema, {"weights": [1, 2]}),
        EMAStateError,
        ("'weights'", "accepted formats"),
    ),
    Case(
        "foreign-wrong-explicit-format",
        lambda c: load_foreign_state(c.ema, c.ema.state_dict(), format="diffusers"),
        EMAStateError,
        ("format='diffusers'", "shadow_params"),
    ),
    Case(
        "foreign-shadow-not-tensors",
        lambda c: load_foreign_state(c.ema, {"shadow_params": [1, 2], "num_updates": 1}),
        EMAStateError,
        ("shadow_params",),
    ),
    Case(
        "foreign-into-pytree",
        lambda c: load_foreign_state(c.tree, {"shadow_params": [], "num_updates": 1}),
        EMATypeError,
        ("EMAPytree", "torch_ema"),
    ),
    Case(
        "foreign-missing-file",
        lambda c: load_foreign_state(c.ema, c.tmp / "gone.pt"),
        EMAFileNotFoundError,
        ("gone.pt",),
    ),
    Case(
        "foreign-explicit-format-on-non-mapping",
        lambda c: load_foreign_state(c.ema, 7, format="timm"),
        EMAStateError,
        ("format='timm'", "an int"),
    ),
    Case("foreign-not-ema", lambda c: load_foreign_state(None, {}), EMATypeError, ("ema",)),
    # -- engine ---------------------------------------------------------------------------
    Case(
        "ema_lerp_-impl",
        lambda c: emakit.ema_lerp_([torch.zeros(1)], [torch.ones(1)], 0.5, impl="fast"),
        EMAValueError,
        ("impl", "fast"),
    ),
    Case(
        "ema_lerp_-length",
        lambda c: emakit.ema_lerp_([torch.zeros(1)] * 2, [torch.ones(1)], 0.5),
        EMAValueError,
        ("shadows", "onlines"),
    ),
    Case(
        "ema_copy_-impl",
        lambda c: emakit.ema_copy_([torch.zeros(1)], [torch.ones(1)], impl=""),
        EMAValueError,
        ("impl",),
    ),
    Case(
        "ema_copy_-length",
        lambda c: emakit.ema_copy_([], [torch.ones(1)]),
        EMAValueError,
        ("dsts", "srcs"),
    ),
    Case(
        "flatten_parameters-non-module",
        lambda c: emakit.flatten_parameters(42),
        EMATypeError,
        ("model",),
    ),
    # -- schedules ------------------------------------------------------------------------
    Case(
        "inverse_gamma-beta", lambda c: schedules.inverse_gamma(beta=1.5), EMAValueError, ("beta",)
    ),
    Case(
        "inverse_gamma-power",
        lambda c: schedules.inverse_gamma(power=0.0),
        EMAValueError,
        ("power",),
    ),
    Case(
        "inverse_gamma-min_value",
        lambda c: schedules.inverse_gamma(beta=0.5, min_value=0.9),
        EMAValueError,
        ("min_value",),
    ),
]


def _update_in_swap(ema: EMA) -> None:
    with ema.swap():
        ema.update()


def test_a_refused_update_model_counts_nothing(ctx):
    before = ctx.ema.tracker.step
    with pytest.raises(TypeError, match="takes no model"):
        ctx.ema.update(ctx.net)
    assert ctx.ema.tracker.step == before
    ctx.ema.update()  # the call it meant
    assert ctx.ema.tracker.step == before + 1


BUILTIN = {
    EMAValueError: ValueError,
    EMAStateError: ValueError,
    EMATypeError: TypeError,
    EMARuntimeError: RuntimeError,
    EMAFileNotFoundError: FileNotFoundError,
}


def test_catalog_is_large():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(ctx, case):
    with pytest.raises(EMAError) as info:
        case.call(ctx)
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__}: {err}"
    assert isinstance(err, BUILTIN[case.error])
    for name in case.names:
        assert name in str(err), f"{name!r} not in: {err}"


# -- bad files ----------------------------------------------------------------------------------


def corruptions(good: bytes) -> dict[str, bytes]:
    (n,) = struct.unpack("<Q", good[:8])
    header = good[8 : 8 + n]
    return {
        "empty": b"",
        "four-bytes": good[:4],
        "header-length-only": good[:8],
        "half-header": good[: 8 + n // 2],
        "header-no-data": good[: 8 + n],
        "half-data": good[: 8 + n + (len(good) - 8 - n) // 2],
        "last-byte-missing": good[:-1],
        "extra-bytes": good + b"\0" * 8,
        "garbage": b"this is not a checkpoint at all" * 10,
        "header-length-huge": struct.pack("<Q", 2**40) + good[8:],
        "header-not-json": good[:8] + b"{" + b"\x00" * (n - 1) + good[8 + n :],
        "offsets-out-of-range": good[:8]
        + header.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
        + good[8 + n :],
    }


def safetensors_cases() -> list[str]:
    return list(corruptions(b"\x10" + b"\0" * 7 + b"{" * 16 + b"x" * 32))


@pytest.mark.parametrize("kind", safetensors_cases())
@pytest.mark.parametrize("loader", ["load_ema_weights", "load_foreign_state"])
def test_corrupt_safetensors(ctx, kind, loader):
    good = ctx.saved.read_bytes()
    path = ctx.tmp / f"{kind}.safetensors"
    path.write_bytes(corruptions(good)[kind])
    load = load_ema_weights if loader == "load_ema_weights" else load_foreign_state
    with pytest.raises(EMAStateError) as info:
        load(ctx.ema, path)
    msg = str(info.value)
    assert str(path) in msg
    assert any(w in msg for w in ("truncated", "corrupt")), msg


def torch_file_cases(tmp: Path, ctx: SimpleNamespace) -> dict[str, bytes]:
    good_path = tmp / "good.pt"
    torch.save(ctx.ema.state_dict(), good_path)
    good = good_path.read_bytes()
    pickled = good.index(b"data.pkl") + 40
    return {
        "truncated-half": good[: len(good) // 2],
        "truncated-tail": good[:-30],
        "zip-garbage": b"PK\x03\x04" + b"\x00" * 200,
        "pickle-garbage": b"\x80\x02garbage",
        # zeroes inside the pickled structure (torch does not checksum the zip members,
        # so zeroes inside tensor data would load as other numbers)
        "flipped-middle": good[:pickled] + bytes(64) + good[pickled + 64 :],
    }


@pytest.mark.parametrize(
    "kind", ["truncated-half", "truncated-tail", "zip-garbage", "pickle-garbage", "flipped-middle"]
)
def test_corrupt_torch_file(ctx, kind):
    path = ctx.tmp / f"{kind}.pt"
    path.write_bytes(torch_file_cases(ctx.tmp, ctx)[kind])
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(ctx.ema, path)
    msg = str(info.value)
    assert str(path) in msg
    assert any(w in msg for w in ("truncated", "corrupt", "does not match", "Missing")), msg


class Custom:
    pass


def test_torch_file_with_arbitrary_objects_is_not_unpickled(ctx):
    path = ctx.tmp / "custom.pt"
    torch.save({"obj": Custom(), **ctx.ema.state_dict()}, path)
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(ctx.ema, path)
    assert str(path) in str(info.value) and "weights_only=False" in str(info.value)
    # the documented way out: load it yourself and pass the mapping
    obj = torch.load(path, weights_only=False)
    del obj["obj"]
    # a rebuilt dict has no emakit metadata: its keys are ema-pytorch's, and it loads as such
    assert load_foreign_state(ctx.ema, obj) in ("emakit", "ema_pytorch")
    assert int(ctx.ema.step) == int(obj["step"])


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_torch_file_of_the_wrong_kind(ctx):
    path = ctx.tmp / "list.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(EMAStateError, match="accepted formats") as info:
        load_foreign_state(ctx.ema, path)
    assert str(path) in str(info.value) and "list" in str(info.value)
    pickled = ctx.tmp / "plain.pkl"
    pickled.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(EMAStateError) as info:
        load_foreign_state(ctx.ema, pickled)
    assert str(pickled) in str(info.value)


def test_a_checkpoint_folder_that_is_a_regular_file_is_refused(tmp_path: Path):
    from emakit.distributed import save_sharded_ema

    file = tmp_path / "taken"
    file.write_text("not a folder")
    with pytest.raises(EMAValueError, match=r"checkpoint_folder must be a folder.*regular file"):
        PostHocEMA(nn.Linear(2, 2), checkpoint_folder=file)
    with pytest.raises(EMAValueError, match="checkpoint_id must be a folder"):
        save_sharded_ema(EMA(nn.Linear(2, 2)), file)
    assert file.read_text() == "not a folder"
