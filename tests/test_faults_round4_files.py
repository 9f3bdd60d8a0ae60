"""Hostile files, round 4 (issue 30): side files checked against their SHA-256, outputs that
would overwrite a snapshot's files, deeply nested JSON, the sweep's scores, the side-file
clean-up's arguments and its rule for unreadable snapshots, messages that name the side
file, list options with empty items, stale temporary files, the target step after the last
snapshot; and the suite's missing tests: the least-squares fall-back for an ill-conditioned
snapshot set, fsync of each file and its folder, and the DCP metadata allow-list against
each gadget.

Each test fails on the code before its fix (see the report of issue 30).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import _peers
from emakit import EMA, EMAError, PostHocEMA
from emakit.checkpoint import load_ema_weights, save_checkpoint, save_ema_weights
from emakit.errors import EMAFileNotFoundError, EMAStateError, EMATypeError, EMAValueError
from emakit.posthoc import (
    PostHocWarning,
    collect_frozen_files,
    list_snapshots,
    plan_synthesis,
    sweep,
    synthesize,
)
from emakit.posthoc.commands import inspect_cmd, sweep_cmd
from emakit.posthoc.commands import synthesize as synthesize_cmd
from emakit.posthoc.math import COND_LIMIT, solve_weights
from emakit.posthoc.snapshots.frozen import is_side_file

pytestmark = pytest.mark.filterwarnings("ignore:post-hoc EMA.*only roughly:UserWarning")

SIGMAS = (0.05, 0.28)
#: share_frozen=True: the frozen base is shared, so the snapshots store it once in a side file.
KW: dict[str, Any] = dict(
    sigma_rels=SIGMAS, update_every=1, checkpoint_every_num_steps=4, share_frozen=True
)


class Lora(nn.Module):
    """A frozen base (in the side file) and a trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.adapter = nn.Linear(16, 2)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(torch.tanh(self.base(x)))


def train(net: nn.Module, ema: PostHocEMA, steps: range) -> None:
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.2)
    for i in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
        ema.update()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run's snapshot folder: 16 steps, snapshots every 4, the base in a side file."""
    folder = tmp_path_factory.mktemp("pristine") / "snaps"
    torch.manual_seed(0)
    net = Lora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **KW)
    train(net, ema, range(16))
    ema.release_folder()
    return folder


@pytest.fixture
def folder(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine folder."""
    dest = tmp_path / "snaps"
    shutil.copytree(pristine, dest, ignore=shutil.ignore_patterns(".emakit-posthoc.lock"))
    return dest


def side_file(folder: Path) -> Path:
    (side,) = [p for p in folder.iterdir() if is_side_file(p.name)]
    return side


def quiet(fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` with post-hoc warnings (few snapshots: a rough fit) ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        return fn(*args, **kw)


def quiet_synthesize(folder: Path, **kw: Any) -> dict[str, torch.Tensor]:
    return quiet(synthesize, folder, **kw)


def data_start(path: Path) -> int:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


# -- item 3: a side file's bytes are checked against its SHA-256 ------------------------------


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_side_file_with_a_changed_byte_is_refused_naming_it(folder: Path, where: str):
    side = side_file(folder)
    start, end = data_start(side), side.stat().st_size
    offset = {"first": start, "middle": (start + end) // 2, "last": end - 1}[where]
    flip(side, offset)
    snaps = list_snapshots(folder)  # the header is intact: the snapshots are still listed
    assert snaps
    with pytest.raises(EMAStateError) as e:
        quiet_synthesize(folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "SHA-256" in text and "damaged" in text
    digest = json.loads(side.read_bytes()[8 : data_start(side)])["__metadata__"]["digest"]
    assert digest in text  # the digest its snapshots record, and the one found
    assert any(s.path.name in text for s in snaps)  # and a snapshot that refers to it
    with pytest.raises(EMAStateError, match="SHA-256"):
        quiet(sweep, folder, lambda state: 0.0, [0.1])
    ema = EMA(Lora())
    with pytest.raises(EMAStateError, match=f"{side.name}.*SHA-256"):
        load_ema_weights(ema, snaps[-1].path)
    for target in (folder, snaps[-1].path, side):
        out = CliRunner().invoke(inspect_cmd, [str(target)])
        assert out.exit_code == 1 and "SHA-256" in out.output, out.output
        assert "Traceback" not in out.output


def test_an_intact_side_file_reads_as_before(folder: Path, pristine: Path):
    """The check costs a read: it must not change what is read."""
    got = quiet_synthesize(folder, sigma_rel=0.1)
    snaps = list_snapshots(folder)
    ema = EMA(Lora())
    load_ema_weights(ema, snaps[-1].path)
    assert torch.equal(ema.ema_model.base.weight, got["base.weight"].to(torch.float16).float())
    out = CliRunner().invoke(inspect_cmd, [str(folder)])
    assert out.exit_code == 0 and "SHA-256 checked" in out.output, out.output


def test_a_damaged_side_file_is_written_again_by_the_next_snapshot(tmp_path: Path):
    """The writer never points new snapshots at a side file whose bytes do not hash to
    their digest: it writes the file again (from the model's intact weights), which heals
    the earlier snapshots too (same digest, same bytes)."""
    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    net = Lora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **KW)
    train(net, ema, range(8))
    side = side_file(folder)
    good = side.read_bytes()
    flip(side, data_start(side) + 5)
    train(net, ema, range(8, 12))
    assert side_file(folder) == side and side.read_bytes() == good
    assert set(quiet_synthesize(folder, sigma_rel=0.1)) == set(Lora().state_dict())


# -- item 4: an output never replaces a file the snapshots are made of --------------------------


def damage_header(path: Path) -> None:
    """One byte of the JSON header changed: the file cannot be read any more."""
    data = bytearray(path.read_bytes())
    data[9] = ord("!")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["path", "hard link", "symlink"])
def test_out_over_a_side_file_is_refused(folder: Path, tmp_path: Path, how: str):
    side = side_file(folder)
    before = side.read_bytes()
    out = side
    if how == "hard link":
        out = tmp_path / "elsewhere.safetensors"
        os.link(side, out)
    elif how == "symlink":
        out = tmp_path / "elsewhere.safetensors"
        out.symlink_to(side)
    got = CliRunner().invoke(
        synthesize_cmd, [str(folder), "--sigma-rel", "0.1", "--out", str(out), "--force"]
    )
    assert got.exit_code == 1 and "input snapshot" in got.output, got.output
    assert side.read_bytes() == before
    with pytest.raises(EMAValueError, match="input snapshots"):
        sweep(folder, lambda state: 0.0, [0.1], plot=out)
    assert side.read_bytes() == before


def test_out_over_any_file_of_a_damaged_snapshot_is_refused(folder: Path):
    """A snapshot that cannot be listed (a damaged header) and its side file are files of
    the snapshots all the same; so is a side file nothing refers to yet."""
    snaps = list_snapshots(folder)
    damaged, side = snaps[0].path, side_file(folder)
    damage_header(damaged)
    orphan = folder / ("frozen-" + "0" * 32 + ".run-other.safetensors")
    shutil.copy(side, orphan)
    for target in (damaged, side, orphan):
        got = CliRunner().invoke(
            synthesize_cmd, [str(folder), "--sigma-rel", "0.1", "--out", str(target), "--force"]
        )
        assert got.exit_code == 1 and "input snapshot" in got.output, (target, got.output)
    plain = folder / "ema.safetensors"  # a previous output may be replaced with --force
    for _ in range(2):
        got = CliRunner().invoke(
            synthesize_cmd, [str(folder), "--sigma-rel", "0.1", "--out", str(plain), "--force"]
        )
        assert got.exit_code == 0, got.output


# -- item 6: nested JSON is a malformed header, not a RecursionError --------------------------------


DEEP = "[" * 100_000 + "]" * 100_000


def rewrite_metadata(path: Path, **changes: str) -> None:
    """Rewrite ``path``'s safetensors header with ``changes`` in its metadata."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"].update(changes)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])


@pytest.mark.parametrize("key", ["copied", "frozen_names"])
def test_a_deeply_nested_header_entry_is_an_ema_error_naming_the_file(folder: Path, key: str):
    snap = list_snapshots(folder)[-1].path
    rewrite_metadata(snap, **{key: DEEP})
    with pytest.raises(EMAStateError, match=f"{snap.name}.*malformed header") as e:
        list_snapshots(folder)
    assert len(str(e.value)) < 1000  # the value is cut, not repeated 200,000 characters long
    if key == "frozen_names":
        with pytest.raises(EMAStateError, match=snap.name):
            load_ema_weights(EMA(Lora()), snap)
    for target in (snap, folder):
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


# -- item 8: the sweep's scores ---------------------------------------------------------------------


def test_a_sweep_whose_scores_are_all_nan_says_so(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        result = sweep(folder, lambda state: float("nan"), [0.1, 0.2])
    with pytest.raises(EMAValueError, match="every score of the sweep is NaN"):
        _ = result.best
    assert "<- best" not in result.table()
    partial = type(result)(((0.1, math.nan), (0.2, 3.0)), 16, (0.05,), "min")
    assert partial.best == (0.2, 3.0)  # a NaN never wins over a number


def write_eval(tmp_path: Path, body: str) -> None:
    (tmp_path / "round4_eval.py").write_text(f"def score(state):\n    return {body}\n")
    sys.modules.pop("round4_eval", None)


def test_the_sweep_command_with_nan_scores_is_a_clear_error(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --eval appends the current folder
    write_eval(tmp_path, "float('nan')")
    got = CliRunner().invoke(
        sweep_cmd, [str(folder), "--sigma-rel", "0.1,0.2", "--eval", "round4_eval:score"]
    )
    assert got.exit_code == 1 and "every score of the sweep is NaN" in got.output, got.output
    assert "best: sigma_rel" not in got.output and "Traceback" not in got.output


@pytest.mark.parametrize(
    ("body", "shown"),
    [("'0.5'", "'0.5'"), ("None", "None"), ("[1.0]", "[1.0]"), ("1j", "1j"), ("True", "True")],
)
def test_an_eval_returning_a_non_number_names_the_function_and_the_value(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, shown: str
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --eval appends the current folder
    write_eval(tmp_path, body)
    got = CliRunner().invoke(
        sweep_cmd, [str(folder), "--sigma-rel", "0.1", "--eval", "round4_eval:score"]
    )
    assert got.exit_code == 1, got.output
    assert "round4_eval.score must return a number" in got.output and shown in got.output
    assert "Traceback" not in got.output


def test_an_eval_may_return_numbers_of_any_kind(folder: Path):
    import numpy as np

    for value, want in ((np.float32(2.5), 2.5), (torch.tensor([1.5]), 1.5), (3, 3.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            result = sweep(folder, lambda state, v=value: v, [0.1])
        assert result.pairs == ((0.1, want),)
    with pytest.raises(EMATypeError, match=r"must return a number.*tensor"):
        quiet(sweep, folder, lambda state: torch.ones(2), [0.1])


# -- item 10: collect_frozen_files ----------------------------------------------------------------


def test_collect_frozen_files_checks_its_arguments(folder: Path, tmp_path: Path):
    with pytest.raises(EMAFileNotFoundError, match="does not exist"):
        collect_frozen_files(tmp_path / "nonexistent")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(EMAValueError, match="is not a folder"):
        collect_frozen_files(a_file)
    for run in ("../x", "a/b", "..", "", "x" * 65):
        with pytest.raises(EMAValueError, match="run must be"):
            collect_frozen_files(folder, run)
    with pytest.raises(EMATypeError, match="run must be a str"):
        collect_frozen_files(folder, 3)  # type: ignore[arg-type]
    for shard in ((2, 2), (-1, 2), (0,), [0, 2], (0.0, 2)):
        with pytest.raises(EMAValueError, match="shard must be"):
            collect_frozen_files(folder, None, shard)  # type: ignore[arg-type]
    assert side_file(folder).exists()


def test_an_unreadable_snapshot_keeps_every_side_file(folder: Path):
    """A snapshot with one damaged header byte may refer to any side file: none is
    removed, whatever else refers to it; once it is gone, collection resumes."""
    side = side_file(folder)
    snaps = list_snapshots(folder)
    run = snaps[0].run
    keep = snaps[0].path
    damage_header(keep)
    for s in snaps[1:]:
        for p in s.files:
            p.unlink()  # every readable snapshot gone: only the damaged one refers to it
    with pytest.warns(PostHocWarning, match=f"kept 1 frozen weights file.*{keep.name}"):
        assert collect_frozen_files(folder, run) == []
    assert side.exists()
    with pytest.warns(PostHocWarning, match="kept"):
        assert collect_frozen_files(folder) == []
    keep.unlink()
    assert collect_frozen_files(folder, run) == [side]


@pytest.mark.parametrize(
    "change",
    [
        {"format": "emakit.posthoc.snapshoT"},  # almost a snapshot
        {"frozen_file": "frozen-0123.run-x.safetensors"},  # a malformed reference
        {"frozen_fi1e": "x"},  # a misspelt key
    ],
)
def test_a_damaged_reference_keeps_every_side_file(folder: Path, change: dict[str, str]):
    side = side_file(folder)
    snaps = list_snapshots(folder)
    rewrite_metadata(snaps[0].path, **change)
    if "frozen_fi1e" in change:
        raw = snaps[0].path.read_bytes()
        snaps[0].path.write_bytes(raw.replace(b'"frozen_file"', b'"frozen_fiLe"', 1))
    for s in snaps[1:]:
        for p in s.files:
            p.unlink()
    with pytest.warns(PostHocWarning, match="kept"):
        assert collect_frozen_files(folder, snaps[0].run) == []
    assert side.exists()


def test_the_clean_up_after_each_checkpoint_keeps_a_damaged_snapshots_side_file(tmp_path: Path):
    """The writer's clean-up is the same function: a new side file (a new base value)
    never makes it remove the old one while a damaged snapshot may refer to it."""
    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    net = Lora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **KW)
    train(net, ema, range(8))
    (old,) = [p for p in folder.iterdir() if is_side_file(p.name)]
    steps4 = sorted(folder.glob("step-000000004_*"))
    damage_header(steps4[0])
    for p in [*steps4[1:], *folder.glob("step-000000008_*")]:
        p.unlink()
    net.base.bias.data.add_(1.0)  # a new value: the next snapshot writes a new side file
    with pytest.warns(PostHocWarning, match="kept 1 frozen weights file"):
        train(net, ema, range(8, 12))
    assert old.exists()
    assert len([p for p in folder.iterdir() if is_side_file(p.name)]) == 2


# -- item 15: the errors name the side file and the snapshot ----------------------------------------


def test_snapshots_copied_without_their_side_file_name_it(folder: Path, tmp_path: Path):
    side = side_file(folder)
    side.unlink()
    with pytest.raises(EMAStateError) as e:
        quiet_synthesize(folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "does not exist" in text and "step-" in text
    assert "call checkpoint() first" not in text
    out = CliRunner().invoke(inspect_cmd, [str(folder)])
    assert out.exit_code == 1 and side.name in out.output, out.output


@pytest.mark.parametrize("damage", ["truncated", "dangling", "another file"])
def test_a_broken_side_file_is_named_with_its_snapshot(folder: Path, tmp_path: Path, damage: str):
    side = side_file(folder)
    if damage == "truncated":
        side.write_bytes(side.read_bytes()[:-7])
    elif damage == "dangling":
        target = tmp_path / "moved.safetensors"
        side.rename(target)
        side.symlink_to(target)
        target.unlink()
    else:
        save_ema_weights(EMA(nn.Linear(2, 2)), side)
    with pytest.raises(EMAStateError) as e:
        quiet_synthesize(folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "step-" in text, text
    out = CliRunner().invoke(
        synthesize_cmd, [str(folder), "--sigma-rel", "0.1", "--out", str(tmp_path / "o.pt")]
    )
    assert out.exit_code == 1 and side.name in out.output and "step-" in out.output


# -- item 16: list options refuse empty items -------------------------------------------------------


@pytest.mark.parametrize("value", ["0.1,,0.2", "0.1,", ",0.1", " , "])
@pytest.mark.parametrize("option", ["--sigma-rel", "--gamma", "--legacy-sigma-rels"])
def test_a_list_option_with_an_empty_item_is_refused(
    folder: Path, tmp_path: Path, value: str, option: str
):
    args = [str(folder), "--out", str(tmp_path / "o.safetensors"), option, value]
    if option == "--legacy-sigma-rels":
        args += ["--sigma-rel", "0.1", "--legacy-update-every", "1"]
    got = CliRunner().invoke(synthesize_cmd, args)
    assert got.exit_code == 2 and "is empty" in got.output, got.output
    assert not (tmp_path / "o.safetensors").exists()


# -- item 17: stale temporary files of a killed save ------------------------------------------------

CHILD = """
import os, signal, sys, time
import torch
from emakit import EMA
from emakit._files import safetensors_file
from emakit.checkpoint import save_ema_weights

real = safetensors_file.write_tensor
def write_and_die(f, t, dtype=None):
    real(f, t, dtype)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
import emakit._files.export as export
export.write_tensor = write_and_die
save_ema_weights(EMA(torch.nn.Linear(64, 64)), sys.argv[1])
"""

HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX only")
def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tmp_path: Path):
    dest = tmp_path / "ema.safetensors"
    save_ema_weights(EMA(nn.Linear(64, 64)), dest)
    before = dest.read_bytes()
    env = {**os.environ, "PYTHONPATH": _peers.child_pythonpath()}
    child = subprocess.run([sys.executable, "-c", CHILD, str(dest)], env=env)
    assert child.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if ".emakit-tmp-" in p.name]
    assert dest.read_bytes() == before  # the previous file is whole
    # a concurrent writer's temporary file (its lock held by a live process) is not stale
    live = tmp_path / ".other.safetensors.emakit-tmp-0000abcd"
    live.write_bytes(b"in flight")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(live)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
        save_ema_weights(EMA(nn.Linear(64, 64)), dest)
        assert not left.exists()  # the killed save's: removed
        assert live.read_bytes() == b"in flight"  # the live one: kept
        other = tmp_path / ".notes.txt"  # not emakit's: never touched
        other.write_text("mine")
        save_ema_weights(EMA(nn.Linear(64, 64)), dest)
        assert other.exists() and live.exists()
    finally:
        holder.kill()
        holder.wait()


# -- item 20: a target step after the last snapshot -----------------------------------------------


@pytest.mark.parametrize("step", [17, 3000, 99999])
def test_a_step_after_the_last_snapshot_is_refused_naming_it(folder: Path, step: int):
    with pytest.raises(EMAValueError, match=rf"step={step} is after the last snapshot \(step 16\)"):
        plan_synthesis(folder, sigma_rel=0.1, step=step)
    got = CliRunner().invoke(
        synthesize_cmd,
        [str(folder), "--sigma-rel", "0.1", "--step", str(step), "--out", str(folder / "o.pt")],
    )
    assert got.exit_code == 1 and "after the last snapshot" in got.output, got.output
    assert "(step 16)" in got.output and "[4, 16]" in got.output and not (folder / "o.pt").exists()
    with pytest.raises(EMAValueError, match="after the last snapshot"):
        sweep(folder, lambda state: 0.0, [0.1], step=step)


def test_a_step_between_snapshots_or_at_the_last_is_used(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        assert plan_synthesis(folder, sigma_rel=0.1, step=16).step == 16
        between = plan_synthesis(folder, sigma_rel=0.1, step=14)
    assert between.step == 14 and max(s.step for s in between.snapshots) == 12


def test_posthoc_ema_synthesis_follows_the_same_rule(tmp_path: Path):
    torch.manual_seed(0)
    net = Lora()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "s", **KW)
    train(net, ema, range(18))  # snapshots at 4..16; the EMA is at step 18
    with pytest.raises(EMAValueError, match=r"after the last snapshot \(step 16\)"):
        ema.synthesize_ema_model(sigma_rel=0.1, step=18)


# -- the suite's missing tests -----------------------------------------------------------------------


def test_an_ill_conditioned_snapshot_set_falls_back_to_least_squares():
    """Near-duplicate snapshots (no exact duplicate) make the normal equations singular to
    working precision: the solve must switch to least squares (with a warning), and the
    near-duplicates together carry the weight the one snapshot would."""
    ts = [500.0, 1000.0, 1000.0 * (1 - 1e-13), 1000.0 * (1 - 2e-13)]
    gammas = [6.94, 16.97, 16.97, 16.97]
    with pytest.warns(PostHocWarning, match="ill-conditioned"):
        sol = solve_weights(ts, gammas, 1000.0, 10.0)
    assert sol.method == "lstsq" and sol.cond > COND_LIMIT
    assert math.isclose(sum(sol.weights), 1.0, abs_tol=1e-12)
    well = solve_weights([500.0, 1000.0], [6.94, 16.97], 1000.0, 10.0)
    assert well.method == "solve"
    assert math.isclose(sum(sol.weights[1:]), well.weights[1], abs_tol=1e-9)
    assert math.isclose(sol.residual, well.residual, rel_tol=1e-6)


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Record each fsync (the inode and kind of what it flushed) and each rename."""
    events: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", (st.st_ino, "dir" if os.path.stat.S_ISDIR(st.st_mode) else "file")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _check_synced(events: list[tuple[str, Any]], files: list[Path]) -> None:
    replaced = [ino for kind, ino in events if kind == "replace"]
    for path in files:
        ino = path.stat().st_ino
        assert ino in replaced, path
        at = next(i for i, (kind, v) in enumerate(events) if kind == "replace" and v == ino)
        assert ("fsync", (ino, "file")) in events[:at], f"{path} renamed before its data was synced"
        folder = os.stat(path.parent).st_ino
        assert ("fsync", (folder, "dir")) in events[at + 1 :], f"{path.parent} not synced after"


def test_every_atomic_write_fsyncs_the_file_then_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    torch.manual_seed(0)
    net = Lora()
    events = _fsyncs(monkeypatch)
    save_checkpoint({"x": torch.zeros(2)}, tmp_path / "c.pt")
    _check_synced(events, [tmp_path / "c.pt"])
    events.clear()
    save_ema_weights(EMA(nn.Linear(3, 3)), tmp_path / "w" / "ema.safetensors")
    _check_synced(events, [tmp_path / "w" / "ema.safetensors"])
    events.clear()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "snaps", **KW)
    train(net, ema, range(4))  # one step's set: a side file and two snapshots
    written = sorted((tmp_path / "snaps").glob("*.safetensors"))
    assert len(written) == 3
    _check_synced(events, written)


# -- the DCP metadata allow-list, one gadget at a time ------------------------------------------------


def _global(module: str, name: str) -> bytes:
    """Pickle opcodes pushing ``module.name`` (STACK_GLOBAL: dotted names work)."""
    out = b""
    for text in (module, name):
        raw = text.encode()
        out += b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE
    return out + b"\x93"  # STACK_GLOBAL


def _call(module: str, name: str, *args: Any) -> bytes:
    """A protocol-4 pickle that calls ``module.name(*args)`` when loaded."""
    body = _global(module, name) + pickle.dumps(tuple(args), protocol=4)[2:-1] + b"R"
    return b"\x80\x04" + body + b"."


GADGETS = [
    ("torch", "save"),
    ("torch", "load"),
    ("torch", "from_file"),
    ("torch", "set_default_dtype"),
    ("torch", "Tensor"),
    ("torch", "nn"),
    ("torch.serialization", "load"),
    ("torch.serialization", "_load"),
    ("torch.jit", "load"),
    ("torch._C", "_set_grad_enabled"),
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "Popen"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("builtins", "open"),
    ("pathlib", "Path.write_text"),
    ("pathlib", "Path.unlink"),
    ("pathlib", "PosixPath.write_bytes"),
    ("pathlib", "Path.__new__"),
    ("pathlib._local", "Path.write_text"),
    ("pathlib", "os"),
    ("shutil", "rmtree"),
    ("collections", "OrderedDict.fromkeys"),
    ("torch.distributed.checkpoint.metadata", "field"),
    ("torch.distributed.checkpoint.metadata", "torch"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__setattr__"),
]


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.checkpoint")
    from emakit.distributed import save_sharded_ema

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    save_sharded_ema(EMA(nn.Linear(3, 4)), folder)
    return folder


@pytest.mark.parametrize(("module", "name"), GADGETS, ids=[f"{m}.{n}" for m, n in GADGETS])
def test_a_metadata_file_naming_a_gadget_is_refused_not_run(
    dcp_folder: Path, tmp_path: Path, module: str, name: str
):
    from emakit.distributed import load_sharded_ema

    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_folder, folder)
    canary = tmp_path / "canary"
    (metadata,) = folder.rglob(".metadata")
    metadata.write_bytes(_call(module, name, str(canary)))
    ema = EMA(nn.Linear(3, 4))
    with torch.no_grad():
        ema.ema_model.weight.fill_(7.0)
    with pytest.raises(EMAStateError, match=f"refers to {module}.{name}, which is not part of"):
        load_sharded_ema(ema, folder)
    assert not canary.exists()
    assert bool((ema.ema_model.weight == 7).all())  # nothing loaded
    assert torch.get_default_dtype() == torch.float32


def test_the_gadget_pickles_would_run_if_unpickled(tmp_path: Path):
    """The payloads above are live: plain pickle runs them (so refusing them means
    something)."""
    canary = tmp_path / "canary"
    pickle.loads(_call("torch", "save", {}, str(canary)))
    assert canary.exists()
    made = tmp_path / "made"
    pickle.loads(_call("pathlib", "Path.mkdir", pickle.loads(_call("pathlib", "Path", str(made)))))
    assert made.is_dir()


def test_a_genuine_metadata_file_still_loads(dcp_folder: Path, tmp_path: Path):
    from emakit.distributed import load_sharded_ema

    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_folder, folder)
    ema = EMA(nn.Linear(3, 4))
    with torch.no_grad():
        ema.ema_model.weight.fill_(7.0)
    load_sharded_ema(ema, folder)
    assert not bool((ema.ema_model.weight == 7).all())
