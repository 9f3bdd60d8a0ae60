"""Deeply nested JSON in a file emakit reads (a snapshot's header entry, a sharded
checkpoint's pointer, a diffusers ``config.json``, a safetensors header, a shard layout) is
an ``EMAError`` naming the file, never a ``RecursionError`` (issue 30, item 6)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from torch import nn

from _headers import rewrite_metadata
from _models import TinyLora
from emakit import EMA, EMAError
from emakit.checkpoint import load_ema_weights
from emakit.errors import EMAStateError
from emakit.inspection import inspect_cmd
from emakit.posthoc import list_snapshots

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("key", ["copied", "frozen_names"])
def test_a_deeply_nested_header_entry_is_an_ema_error_naming_the_file(
    tiny_lora_folder: Path, key: str
):
    snap = list_snapshots(tiny_lora_folder)[-1].path
    rewrite_metadata(snap, **{key: DEEP})
    with pytest.raises(EMAStateError, match=f"{snap.name}.*malformed header") as e:
        list_snapshots(tiny_lora_folder)
    assert len(str(e.value)) < 1000  # the value is cut, not repeated 200,000 characters long
    if key == "frozen_names":
        with pytest.raises(EMAStateError, match=snap.name):
            load_ema_weights(EMA(TinyLora()), snap)
    for target in (snap, tiny_lora_folder):
        out = CliRunner().invoke(inspect_cmd, [str(target)])
        assert out.exit_code == 1 and "malformed header" in out.output, out.output
        assert "RecursionError" not in out.output and "Traceback" not in out.output


def test_a_deeply_nested_pointer_or_config_file_is_an_ema_error(tmp_path: Path):
    from emakit.foreign import load_foreign_state

    pytest.importorskip("torch.distributed.checkpoint")
    from emakit.distributed import load_sharded_ema

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "emakit-sharded.json").write_text(DEEP)
    with pytest.raises(EMAStateError, match=r"emakit-sharded\.json"):
        load_sharded_ema(EMA(nn.Linear(2, 2)), ckpt)
    diffusers = tmp_path / "ema_unet"
    diffusers.mkdir()
    (diffusers / "config.json").write_text(DEEP)
    (diffusers / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(EMAError, match=r"config\.json"):
        load_foreign_state(EMA(nn.Linear(2, 2)), diffusers)


def test_a_deeply_nested_safetensors_header_is_an_ema_error(tmp_path: Path):
    path = tmp_path / "deep.safetensors"
    blob = ('{"a":' + DEEP + "}").encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(EMAStateError, match=r"deep\.safetensors is not a readable"):
        load_ema_weights(EMA(nn.Linear(2, 2)), path)
    out = CliRunner().invoke(inspect_cmd, [str(path)])
    assert out.exit_code == 1 and "not a readable safetensors file" in out.output


def test_a_deeply_nested_shard_layout_is_a_malformed_header(tmp_path: Path):
    from emakit.posthoc.snapshots.shards import parse_layout

    with pytest.raises(EMAStateError, match="shard_layout is not JSON"):
        parse_layout(tmp_path / "x.safetensors", {"shard_layout": DEEP}, {})
