"""``emakit synthesize --out`` (issue 14, item 4): never one of its own inputs (through
symlinks and hard links too), an existing file only with ``--force``, and the format the
suffix names (or a refusal); one file per value, named after it; what the written file
records; and a write that fails, said in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import emakit
from _models import bn_mlp
from emakit.posthoc import PostHocEMA, plan_synthesis
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


def refusal(out: Path, target: Path, folder: Path) -> str:
    """The line that refuses to write ``out``, which is the snapshot ``target``."""
    return (
        f"Error: --out {out} is {target}, a file of the input snapshots in {str(folder)!r}: "
        f"emakit never overwrites the snapshots or their side files; name the output "
        f"differently\n"
    )


def test_an_input_snapshot_is_never_overwritten(folder: Path) -> None:
    before = snapshot_files(folder)
    target = next(iter(before))
    for extra in ((), ("--force",)):
        result = run(folder, target, *extra)
        assert result.exit_code == 1, result.output
        assert result.output == refusal(target, target, folder)
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
        assert result.exit_code == 1, result.output
        assert result.output == refusal(out, target, folder)
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


@pytest.mark.parametrize(
    ("name", "suffix"),
    [("ema.txt", "'.txt'"), ("ema", "'(none)'"), ("ema.safetensor", "'.safetensor'")],
)
def test_an_unknown_suffix_is_refused(folder: Path, tmp_path: Path, name: str, suffix: str) -> None:
    out = tmp_path / name
    result = run(folder, out)
    assert result.exit_code == 2, result.output
    assert result.output.endswith(
        f"\nError: Invalid value for --out: {out} has the suffix {suffix}; synthesize writes "
        f".safetensors (safetensors) or .pt/.pth/.bin (torch.save of the state dict): name the "
        f"output with one of those suffixes\n"
    )
    assert not out.exists()


def test_a_non_utf8_output_name_is_refused(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / os.fsdecode(b"ema-\xff.safetensors")
    result = run(folder, out)
    assert result.exit_code == 2, result.output
    name = f"--out={str(out)!r}"
    expected = f"Error: Invalid value for --out: --out must be a UTF-8 file name, got {name}, "
    assert f"\n{expected}" in result.output
    assert not out.exists()


def test_a_dangling_symlink_as_out_needs_force(folder: Path, tmp_path: Path) -> None:
    """``os.path.exists`` is False for a dangling link; the check must see the link."""
    elsewhere = tmp_path / "elsewhere" / "target.safetensors"
    out = tmp_path / "ema.safetensors"
    out.symlink_to(elsewhere)
    result = run(folder, out)
    assert result.exit_code == 1 and "--force" in result.output, result.output
    assert out.is_symlink() and not elsewhere.exists()  # nothing written through the link


@pytest.mark.parametrize(
    ("option", "values", "shown"),
    [
        ("--sigma-rel", "0.1,0.1", "[0.1, 0.1]"),
        ("--sigma-rel", "0.1,0.2,0.1000001", "[0.1, 0.2, 0.1000001]"),  # the same name
        ("--gamma", "7,7.0", "[7.0, 7.0]"),
    ],
)
def test_values_that_would_name_the_same_file_are_refused(
    folder: Path, tmp_path: Path, option: str, values: str, shown: str
) -> None:
    """With several values, each file is named after its value (6 significant digits):
    values that would share a name are refused, naming the option, before anything is
    written."""
    out = tmp_path / "ema.safetensors"
    args = [str(folder), option, values, "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(synthesize, args)
    assert result.exit_code == 2, result.output
    assert result.output.endswith(
        f"\nError: Invalid value for {option}: the values {shown} repeat\n"
    )
    assert sorted(tmp_path.iterdir()) == [folder]


def test_the_written_file_records_how_it_was_synthesized(folder: Path, tmp_path: Path) -> None:
    """The safetensors file's header: its format and version, emakit's version, the
    length, the step, how many snapshots, how far the profile is from the target's, and
    the snapshot the buffers come from."""
    out = tmp_path / "ema.safetensors"
    result = run(folder, out, "--step", "10")
    assert result.exit_code == 0, result.output
    plan = plan_synthesis(folder, sigma_rel=0.1, step=10)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta == {
        "format": "emakit.posthoc.synthesized",
        "format_version": "1",
        "emakit_version": emakit.__version__,
        "sigma_rel": "0.1",
        "gamma": repr(plan.gamma),
        "step": "10",
        "num_snapshots": "4",  # 2 profiles, at steps 5 and 10
        "profile_error": repr(plan.solution.residual),
        "buffers_from": plan.buffers_from.path.name,
    }
    assert plan.buffers_from.path.name.startswith("step-000000010_")


def test_a_write_that_fails_is_said_in_one_line(folder: Path, tmp_path: Path) -> None:
    """An output file that cannot be written (here its folder is a file): exit code 1, one
    line naming the file, nothing left behind."""
    (tmp_path / "a-file").write_text("mine")
    out = tmp_path / "a-file" / "ema.safetensors"
    result = run(folder, out)
    assert result.exit_code == 1, result.output
    (line,) = result.output.splitlines()
    assert line.startswith("Error: ") and f" could not write the output file {out} (" in line
    assert line.endswith(
        "; it was left as before the write: free space or fix the folder's permissions, then "
        "save again"
    )
    assert (tmp_path / "a-file").read_text() == "mine"
