"""Numbers read from files and states are validated (issue 14, item 7).

Every counter, version and header field that comes from a file or a state dict raises an
``EMAStateError`` naming the source and the field when it is malformed (negative, huge,
fractional, a vector, NaN, text); a bit-flip in the ``format`` header entry is refused
instead of silently reading the file as a plain state dict without its step; tensor data
of another kind (integers, bools or complex numbers into a floating tensor, floats into an
integer buffer) is refused, naming the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from emakit import EMA, EMAStateError, PostHocEMA
from emakit.checkpoint import WEIGHTS_FORMAT, load_ema_weights, save_ema_weights
from emakit.foreign import load_foreign_state
from emakit.posthoc import list_snapshots, read_snapshot_info


def bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def trained_ema(**kw: object) -> EMA:
    net = bn_net()
    ema = EMA(net, update_after_step=0, update_every=1, **kw)
    for _ in range(3):
        ema.update()
    return ema


# -- state dicts: step, initted, version -----------------------------------------------------

BAD_STEPS = {
    "negative": torch.tensor(-1),
    "huge": torch.tensor(2**60),
    "huge float": torch.tensor(1e30),
    "fractional": torch.tensor(2.5),
    "nan": torch.tensor(math.nan),
    "vector": torch.tensor([1, 2]),
    "bool": torch.tensor(True),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_state_dict_step_is_validated(case: str) -> None:
    ema = trained_ema()
    state = ema.state_dict()
    state["step"] = BAD_STEPS[case]
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with pytest.raises(EMAStateError, match="step") as info:
        ema.load_state_dict(state)
    assert "state_dict" in str(info.value)
    after = ema.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing loaded


def test_state_dict_initted_is_validated() -> None:
    ema = trained_ema()
    state = ema.state_dict()
    state["initted"] = torch.tensor(7)
    with pytest.raises(EMAStateError, match="initted"):
        ema.load_state_dict(state)


@pytest.mark.parametrize("version", ["abc", -1, 2.5, True, [1, 2]])
def test_malformed_version_in_metadata_is_refused(version: object) -> None:
    ema = trained_ema()
    state = ema.state_dict()
    state._metadata[""]["version"] = version  # type: ignore[attr-defined]
    with pytest.raises(EMAStateError, match="version") as info:
        ema.load_state_dict(state)
    assert "metadata" in str(info.value)


@pytest.mark.parametrize("version", [torch.tensor([1, 2]), torch.tensor(1.5), torch.tensor(-3)])
def test_malformed_version_key_is_refused(version: torch.Tensor) -> None:
    ema = trained_ema()
    state = OrderedDict(ema.state_dict())  # a rebuilt dict: no metadata, as layout 1
    state["version"] = version
    with pytest.raises(EMAStateError, match="version"):
        ema.load_state_dict(state)


@pytest.mark.parametrize(
    ("field", "value"), [("t", -5), ("t", 2.5), ("dt", "x"), ("gamma", math.nan)]
)
def test_karras_metadata_fields_are_validated(tmp_path: Path, field: str, value: object) -> None:
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    for _ in range(3):
        ema.update()
    state = ema.state_dict()
    state._metadata["ema_models.0"][field] = value  # type: ignore[attr-defined]
    other = PostHocEMA(bn_net(), checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    with pytest.raises(EMAStateError, match=field):
        other.load_state_dict(state)


# -- tensors of the wrong kind ---------------------------------------------------------------

WRONG_KINDS = {
    "int64 into a float weight": ("ema_model.0.weight", torch.int64),
    "bool into a float weight": ("ema_model.0.weight", torch.bool),
    "complex into a float weight": ("ema_model.0.weight", torch.complex64),
    "float into an integer buffer": ("ema_model.1.num_batches_tracked", torch.float32),
}


@pytest.mark.parametrize("case", sorted(WRONG_KINDS))
def test_tensor_data_of_another_kind_is_refused(case: str) -> None:
    key, dtype = WRONG_KINDS[case]
    ema = trained_ema()
    state = ema.state_dict()
    state[key] = state[key].to(dtype)
    with pytest.raises(EMAStateError, match=key.replace(".", r"\.")):
        ema.load_state_dict(state)


def test_tensor_data_of_another_kind_is_refused_from_a_file(tmp_path: Path) -> None:
    import safetensors.torch

    ema = trained_ema()
    weights = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    weights["0.weight"] = torch.ones_like(weights["0.weight"], dtype=torch.int64)
    safetensors.torch.save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(EMAStateError, match=r"0\.weight.*int64"):
        load_ema_weights(ema, tmp_path / "w.safetensors")


def test_floating_widths_and_float_into_complex_still_load() -> None:
    ema = trained_ema(ema_dtype=torch.float64)
    state = ema.state_dict()
    state["ema_model.0.weight"] = state["ema_model.0.weight"].half()
    ema.load_state_dict(state)
    assert ema.ema_model[0].weight.dtype == torch.float64


# -- safetensors headers of save_ema_weights -------------------------------------------------


def rewrite_header(path: Path, change) -> None:
    """Apply ``change(metadata)`` to the header metadata, keeping the data as it is."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header["__metadata__"])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


@pytest.mark.parametrize("step", ["-1", "99999999999999999999999", "2.5", "[1, 2]", "nan", ""])
def test_header_step_is_validated(tmp_path: Path, step: str) -> None:
    path = save_ema_weights(trained_ema(), tmp_path / "w.safetensors")
    rewrite_header(path, lambda m: m.update(step=step))
    with pytest.raises(EMAStateError, match="step") as info:
        load_ema_weights(trained_ema(), path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(("field", "value"), [("format_version", "one"), ("initted", "maybe")])
def test_other_header_fields_are_validated(tmp_path: Path, field: str, value: str) -> None:
    path = save_ema_weights(trained_ema(), tmp_path / "w.safetensors")
    rewrite_header(path, lambda m: m.update({field: value}))
    with pytest.raises(EMAStateError, match=field):
        load_ema_weights(trained_ema(), path)


def flip_bit(path: Path, text: bytes, bit: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    at = raw.index(text)
    raw[at + len(text) - 1] ^= 1 << bit
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", [WEIGHTS_FORMAT.encode(), b'"format"'])
def test_bit_flip_in_format_does_not_drop_the_step(tmp_path: Path, where: bytes) -> None:
    ema = trained_ema()
    path = save_ema_weights(ema, tmp_path / "w.safetensors")
    target = where if where != b'"format"' else b'"format'
    flip_bit(path, target, bit=1)
    fresh = EMA(bn_net())
    with pytest.raises(EMAStateError, match="damaged"):
        load_ema_weights(fresh, path)
    with pytest.raises(EMAStateError, match="damaged"):
        load_foreign_state(fresh, path)
    assert int(fresh.step) == 0


# -- foreign counters ------------------------------------------------------------------------


def torch_ema_state(ema: EMA, **counters: object) -> dict:
    shadow = [p.detach().clone() for p in ema.ema_model.parameters()]
    return {"decay": 0.99, "shadow_params": shadow, "collected_params": None, **counters}


BAD_COUNTS = [math.nan, -1, 10**30, "12", 2.5, torch.tensor(math.nan), torch.tensor([1, 2])]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_torch_ema_num_updates_is_validated(value: object) -> None:
    ema = trained_ema()
    with pytest.raises(EMAStateError, match="num_updates"):
        load_foreign_state(ema, torch_ema_state(ema, num_updates=value), format="torch_ema")


@pytest.mark.parametrize("value", BAD_COUNTS, ids=repr)
def test_diffusers_optimization_step_is_validated(value: object) -> None:
    ema = trained_ema()
    state = torch_ema_state(ema, optimization_step=value)
    with pytest.raises(EMAStateError, match="optimization_step"):
        load_foreign_state(ema, state, format="diffusers")


@pytest.mark.parametrize(
    "value", [torch.tensor(math.nan), torch.tensor(-1), torch.tensor(2**60), torch.tensor(1.5)]
)
def test_averaged_model_n_averaged_is_validated(value: torch.Tensor) -> None:
    ema = trained_ema()
    state = {f"module.{k}": v for k, v in ema.ema_model.state_dict().items()}
    state["n_averaged"] = value
    with pytest.raises(EMAStateError, match="n_averaged"):
        load_foreign_state(ema, state, format="averaged_model")


def test_good_foreign_counters_still_load() -> None:
    ema = trained_ema()
    # torch_ema's update n is emakit's call n + 1 (its first call copies; issue 29)
    load_foreign_state(ema, torch_ema_state(ema, num_updates=7), format="torch_ema")
    assert int(ema.step) == 8
    load_foreign_state(ema, torch_ema_state(ema, num_updates=torch.tensor(9)), format="torch_ema")
    assert int(ema.step) == 10


# -- snapshot headers ------------------------------------------------------------------------

BAD_SNAPSHOT_FIELDS = [
    ("profile", "x"),
    ("profile", "-1"),
    ("update_every", "1.5"),
    ("update_every", "0"),
    ("copied", "{}"),
    ("copied", "[1, 2]"),
    ("copied", "not json"),
    ("gamma", "abc"),
    ("step", "-3"),
    ("step", "1e400"),
    ("t", "2.5"),
    ("sigma_rel", "nan"),
    ("format_version", "v1"),
]


@pytest.mark.parametrize(("field", "value"), BAD_SNAPSHOT_FIELDS)
def test_snapshot_header_fields_are_validated(tmp_path: Path, field: str, value: str) -> None:
    net = bn_net()
    ema = PostHocEMA(net, checkpoint_every_num_steps="manual", checkpoint_folder=tmp_path)
    for _ in range(3):
        ema.update()
    path = ema.checkpoint()[0]
    rewrite_header(path, lambda m: m.update({field: value}))
    for read in (read_snapshot_info, lambda p: list_snapshots(p.parent)):
        with pytest.raises(EMAStateError, match=field) as info:
            read(path)
        assert path.name in str(info.value)
