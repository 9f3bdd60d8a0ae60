"""``emakit synthesize --out`` (issue 14, item 4): never one of its own inputs (through
symlinks and hard links too), an existing file only with ``--force``, and the format the
suffix names (or a refusal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from _models import bn_mlp
from emakit.posthoc import PostHocEMA
from emakit.posthoc.commands import synthesize


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    net = bn_mlp(4, 8, 2)
    ema = PostHocEMA(
        net,
        update_every=1,
        checkpoint_every_num_steps=5,
        checkpoint_folder=tmp_path / "snaps",
        checkpoint_dtype=torch.float32,
    )
    for _ in range(10):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01)
        ema.update()
    return tmp_path / "snaps"


def run(folder: Path, out: Path, *extra: str):
    args = [str(folder), "--sigma-rel", "0.1", "--out", str(out), "--no-progress", *extra]
    return CliRunner().invoke(synthesize, args)


def snapshot_files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.glob("step-*.safetensors"))}


def test_an_input_snapshot_is_never_overwritten(folder: Path) -> None:
    before = snapshot_files(folder)
    target = next(iter(before))
    for extra in ((), ("--force",)):
        result = run(folder, target, *extra)
        assert result.exit_code == 1, result.output
        assert "input snapshot" in result.output and "Traceback" not in result.output
    assert snapshot_files(folder) == before


def test_a_symlink_or_hard_link_to_an_input_is_refused(folder: Path, tmp_path: Path) -> None:
    before = snapshot_files(folder)
    target = next(iter(before))
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    hard = tmp_path / "hard.safetensors"
    os.link(target, hard)
    for out in (link, hard):
        result = run(folder, out, "--force")
        assert result.exit_code == 1 and "input snapshot" in result.output, result.output
    assert snapshot_files(folder) == before
    # A symlinked folder path to the snapshots is seen through too.
    alias = tmp_path / "alias"
    alias.symlink_to(folder)
    result = run(folder, alias / target.name, "--force")
    assert result.exit_code == 1 and "input snapshot" in result.output
    assert snapshot_files(folder) == before


def test_an_existing_file_needs_force(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "ema.safetensors"
    out.write_bytes(b"someone else's file")
    result = run(folder, out)
    assert result.exit_code == 1 and "--force" in result.output, result.output
    assert out.read_bytes() == b"someone else's file"
    result = run(folder, out, "--force")
    assert result.exit_code == 0, result.output
    assert "0.weight" in load_file(out)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_a_torch_suffix_writes_a_torch_file(folder: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"ema{suffix}"
    result = run(folder, out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[8:9] != b"{"  # not safetensors
    state = torch.load(out, weights_only=True)
    net = bn_mlp(4, 8, 2)
    net.load_state_dict(state)


def test_safetensors_suffix_and_several_values(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "ema.pt"
    args = [str(folder), "--sigma-rel", "0.1,0.2", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(synthesize, args)
    assert result.exit_code == 0, result.output
    for s in ("0.1", "0.2"):
        torch.load(tmp_path / f"ema.sigma_rel-{s}.pt", weights_only=True)


@pytest.mark.parametrize("name", ["ema.txt", "ema", "ema.safetensor"])
def test_an_unknown_suffix_is_refused(folder: Path, tmp_path: Path, name: str) -> None:
    result = run(folder, tmp_path / name)
    assert result.exit_code == 2 and "suffix" in result.output, result.output
    assert not (tmp_path / name).exists()


def test_a_non_utf8_output_name_is_refused(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / os.fsdecode(b"ema-\xff.safetensors")
    result = run(folder, out)
    assert result.exit_code == 2 and "UTF-8" in result.output, result.output
    assert not out.exists()


def test_a_dangling_symlink_as_out_needs_force(folder: Path, tmp_path: Path) -> None:
    """``os.path.exists`` is False for a dangling link; the check must see the link."""
    elsewhere = tmp_path / "elsewhere" / "target.safetensors"
    out = tmp_path / "ema.safetensors"
    out.symlink_to(elsewhere)
    result = run(folder, out)
    assert result.exit_code == 1 and "--force" in result.output, result.output
    assert out.is_symlink() and not elsewhere.exists()  # nothing written through the link
