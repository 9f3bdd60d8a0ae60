"""Post-hoc snapshots store frozen weights once (issue 21, point 1): a LoRA-like model
(a frozen base, a small trainable head) whose snapshots refer to a side file holding the
base, compared with snapshots that store every tensor (``store_frozen_once=False``) and
with an EMA that copies frozen weights (``share_frozen=False``, the default) of the same
run; the EMAs under test share them (``share_frozen=True``).

What is checked: the frozen bytes appear once on disk; synthesis, the sweep and ``emakit
synthesize`` give what the reference gives; a frozen value changed in place (through
``.data``, which bumps no version counter) gets a new side file and synthesis follows it;
unfreezing mid-run (seen at a read before the next step); removal keeps every side file still referred to; a full disk and a
SIGKILL during the side-file write leave the previous snapshots usable; resume and a second
run in the folder; damaged, missing and replaced side files. A side file's bytes are checked
against the SHA-256 its snapshots record (a damaged one is written again by the next
snapshot); an output never replaces a file the snapshots are made of; ``collect_frozen_files``
checks its arguments and keeps every side file an unreadable snapshot may refer to; the
errors name the side file and the snapshot (issue 30, items 3, 4, 10 and 15).
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import shutil
import signal
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from _headers import rewrite_metadata
from _models import TINY_LORA_SGD, TinyLora, train
from emakit import EMA, EMAError, PostHocEMA
from emakit._files.safetensors_file import SafetensorsFile
from emakit.checkpoint import load_ema_weights, save_ema_weights
from emakit.errors import EMAFileNotFoundError, EMAStateError, EMATypeError, EMAValueError
from emakit.inspection import inspect_cmd
from emakit.posthoc import PostHocWarning, list_snapshots, sweep, synthesize, synthesize_state_dict
from emakit.posthoc.commands import synthesize as synthesize_cmd
from emakit.posthoc.snapshots import format as snapshots_module
from emakit.posthoc.snapshots import frozen as frozen_module
from emakit.posthoc.snapshots.folder import collect_frozen_files
from emakit.posthoc.snapshots.frozen import is_side_file

SIGMAS = (0.05, 0.28)
#: ``share_frozen=True``: the frozen base is shared with the model (copied by default), which
#: is what lets the snapshots store it once.
KW: dict[str, Any] = dict(
    sigma_rels=SIGMAS, update_every=1, checkpoint_every_num_steps=4, share_frozen=True
)


class Lora(nn.Module):
    """A frozen base (1056 values) and a trainable adapter; ``count`` is a copied buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(32, 32)
        self.adapter = nn.Linear(32, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.adapter(torch.tanh(self.base(x)))


FROZEN = {"base.weight", "base.bias"}
FROZEN_VALUES = 32 * 32 + 32


def lora() -> Lora:
    torch.manual_seed(0)
    return Lora()


#: `train()`'s keywords for `Lora`: 8 x 32 batches, lr 0.2, step ``i``'s batch drawn from a
#: generator seeded with ``i``.
LORA_SGD: dict[str, Any] = dict(batch=(8, 32), lr=0.2, seed=lambda i: i)


def side_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_side_file(p.name))


def stored_values(folder: Path, names: set[str]) -> int:
    """How many values of ``names`` the folder's safetensors files hold, all files together."""
    total = 0
    for p in folder.glob("*.safetensors"):
        with SafetensorsFile(p) as f:
            total += sum(f.get(n).numel() for n in f.keys() if n in names)  # noqa: SIM118
    return total


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)


def synth(folder: Path, sigma_rel: float, step: int | None = None, run: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # few snapshots: a rough fit
        return synthesize_state_dict(folder, sigma_rel=sigma_rel, step=step, run=run)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One run, snapshotted with side files (``once``) and by an EMA that copies frozen
    weights (``copied``), 16 steps, snapshots every 4."""
    root = tmp_path_factory.mktemp("pair")
    net = lora()
    once = PostHocEMA(net, checkpoint_folder=root / "once", **KW)
    copied = PostHocEMA(net, checkpoint_folder=root / "copied", **{**KW, "share_frozen": False})
    train(net, [once, copied], range(16), **LORA_SGD)
    return root / "once", root / "copied"


def test_the_frozen_bytes_are_stored_once(pair: tuple[Path, Path]) -> None:
    once, copied = pair
    snaps = list_snapshots(once)
    assert len(snaps) == 8 and len(side_files(once)) == 1
    assert all(s.frozen == (side_files(once)[0],) and s.frozen_names == FROZEN for s in snaps)
    assert all(s.format_version == 2 for s in snaps)
    assert stored_values(once, FROZEN) == FROZEN_VALUES  # once, for 8 snapshots
    assert stored_values(copied, FROZEN) == 8 * FROZEN_VALUES
    assert all(s.format_version == 1 and not s.frozen for s in list_snapshots(copied))
    size = sum(p.stat().st_size for p in once.glob("*.safetensors"))
    full = sum(p.stat().st_size for p in copied.glob("*.safetensors"))
    assert full - size > 6 * FROZEN_VALUES * 2  # 7 float16 copies saved, less the headers


@pytest.mark.parametrize(("sigma_rel", "step"), [(0.1, None), (0.2, 12), (0.05, 8)])
def test_synthesis_equals_the_copying_ema(
    pair: tuple[Path, Path], sigma_rel: float, step: int | None
) -> None:
    once, copied = pair
    assert_same(synth(once, sigma_rel, step), synth(copied, sigma_rel, step))


def test_the_side_file_is_read_once_with_the_summed_weights(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from emakit.posthoc import plan_synthesis

    once, _ = pair
    reads: list[str] = []
    real = frozen_module.FrozenJoin.get

    def counted(self: Any, name: str) -> torch.Tensor:
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(frozen_module.FrozenJoin, "get", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        plan = plan_synthesis(once, sigma_rel=0.12)
    state = plan.run()
    assert reads.count("base.weight") == 1 and reads.count("adapter.weight") == 8
    with SafetensorsFile(side_files(once)[0]) as f:
        stored = f.get("base.weight").float()
    total = sum(plan.weights)  # the fitted weights: the sum need not be exactly 1
    torch.testing.assert_close(state["base.weight"], stored * total, rtol=1e-6, atol=1e-7)


def test_the_sweep_and_the_cli_equal_the_copying_ema(pair: tuple[Path, Path], tmp_path: Path):
    from emakit.posthoc import sweep

    once, copied = pair
    probe = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))

    def score(state: dict[str, torch.Tensor]) -> float:
        model = lora()
        model.load_state_dict(state)
        with torch.no_grad():
            return float(model(probe).square().sum())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        got = sweep(once, score, (0.1, 0.2)).pairs
        want = sweep(copied, score, (0.1, 0.2)).pairs
    assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6)
    outs = []
    for folder in pair:
        out = tmp_path / f"{folder.name}.safetensors"
        result = CliRunner().invoke(
            synthesize_cmd, [str(folder), "--sigma-rel", "0.15", "--out", str(out), "--no-progress"]
        )
        assert result.exit_code == 0, result.output
        with SafetensorsFile(out) as f:
            outs.append({n: f.get(n) for n in f.keys()})  # noqa: SIM118
    assert_same(*outs)
    assert set(outs[0]) >= FROZEN  # the output file is a whole model


def test_a_snapshot_loads_back_with_its_frozen_weights(pair: tuple[Path, Path]) -> None:
    from emakit import EMA
    from emakit.checkpoint import load_ema_weights

    loaded = []
    for folder in pair:
        ema = EMA(lora(), share_frozen=False, include_online_model=False)
        load_ema_weights(ema, next(folder.glob("step-000000008_sigma_rel-0.05_*")))
        loaded.append({k: v.clone() for k, v in ema.ema_model.state_dict().items()})
    assert_same(*loaded)
    assert torch.equal(loaded[0]["base.weight"], lora().base.weight.detach().half().float())


def test_inspect_counts_the_side_file_once(pair: tuple[Path, Path]) -> None:
    once, _ = pair
    result = CliRunner().invoke(inspect_cmd, [str(once)])
    assert result.exit_code == 0, result.output
    assert "frozen weights stored once: 1 side file(s)" in result.output
    assert "used by 8 snapshot(s)" in result.output and "other file" not in result.output
    assert "each snapshot: 5 tensors (4 averaged, 1 copied)" in result.output
    side = side_files(once)[0]
    result = CliRunner().invoke(inspect_cmd, [str(side)])
    assert result.exit_code == 0 and "frozen weights side file" in result.output, result.output


def test_a_frozen_value_changed_in_place_gets_a_new_side_file(tmp_path: Path) -> None:
    net = lora()
    once = PostHocEMA(net, checkpoint_folder=tmp_path / "once", **KW)
    every = PostHocEMA(net, checkpoint_folder=tmp_path / "every", store_frozen_once=False, **KW)
    new_base = torch.randn(32, 32, generator=torch.Generator().manual_seed(3))

    def load_new_base(i: int) -> None:
        if i == 6:  # through .data: no version counter sees it, the digest does
            net.base.weight.data.copy_(new_base)

    train(net, [once, every], range(16), at=load_new_base, **LORA_SGD)
    sides = side_files(tmp_path / "once")
    assert len(sides) == 2
    snaps = list_snapshots(tmp_path / "once")
    assert {s.frozen[0] for s in snaps if s.step <= 4} != {s.frozen[0] for s in snaps if s.step > 4}
    latest = max(snaps, key=lambda s: s.step)
    with SafetensorsFile(latest.frozen[0]) as f:
        assert torch.equal(f.get("base.weight"), new_base.half())  # never the old value
    for sigma_rel, step in [(0.1, None), (0.2, 8), (0.05, 4)]:
        assert_same(
            synth(tmp_path / "once", sigma_rel, step), synth(tmp_path / "every", sigma_rel, step)
        )
    assert stored_values(tmp_path / "once", FROZEN) == 2 * FROZEN_VALUES


def test_unfreezing_mid_run_stores_the_weight_in_the_snapshots(tmp_path: Path) -> None:
    net = lora()
    once = PostHocEMA(net, checkpoint_folder=tmp_path / "once", **KW)
    copied = PostHocEMA(net, checkpoint_folder=tmp_path / "copied", **{**KW, "share_frozen": False})

    def unfreeze(i: int) -> None:
        if i == 6:
            net.base.weight.requires_grad_(True)
            once(torch.zeros(1, 32))  # a read before the next step sees the unfreezing

    train(net, [once, copied], range(16), at=unfreeze, **LORA_SGD)
    late = [s for s in list_snapshots(tmp_path / "once") if s.step > 6]
    assert late and all(s.frozen_names == {"base.bias"} for s in late)
    assert len(side_files(tmp_path / "once")) == 2  # the base, then the bias alone
    for step in (None, 8, 4):
        assert_same(synth(tmp_path / "once", 0.1, step), synth(tmp_path / "copied", 0.1, step))


def test_a_replaced_frozen_storage_is_averaged_and_stored_in_the_snapshots(tmp_path: Path):
    # Two profiles: both shared the old storage; each averages its own copy of it.
    net = lora()
    kw = {**KW, "sigma_rels": (0.1, 0.25)}
    once = PostHocEMA(net, checkpoint_folder=tmp_path / "once", **kw)
    copied = PostHocEMA(net, checkpoint_folder=tmp_path / "copied", **{**kw, "share_frozen": False})

    def replace(i: int) -> None:
        if i == 6:  # new storage: no longer the EMA's, which averages it as ema-pytorch
            net.base.weight.data = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))

    train(net, [once, copied], range(16), at=replace, **LORA_SGD)
    late = [s for s in list_snapshots(tmp_path / "once") if s.step > 6]
    assert late and all(s.frozen_names == {"base.bias"} for s in late)
    for step in (None, 8, 4):
        assert_same(synth(tmp_path / "once", 0.1, step), synth(tmp_path / "copied", 0.1, step))


def test_removal_keeps_every_side_file_still_referred_to(tmp_path: Path) -> None:
    net = lora()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path, **KW)

    def change(i: int) -> None:
        if i == 10:
            net.base.bias.data.add_(1.0)

    train(net, [ema], range(16), at=change, **LORA_SGD)  # the old base: steps 4, 8; the new: 12, 16
    old, new = side_files(tmp_path)
    by_step = {s.step: s for s in list_snapshots(tmp_path)}
    assert by_step[4].frozen[0] == by_step[8].frozen[0] != by_step[12].frozen[0]
    old, new = by_step[4].frozen[0], by_step[12].frozen[0]
    for p in tmp_path.glob("step-000000004_*"):  # a user's FIFO drops the oldest step
        p.unlink()
    assert collect_frozen_files(tmp_path, ema.run_id) == []  # step 8 still refers to it
    assert old.exists()
    for p in tmp_path.glob("step-000000008_*"):
        p.unlink()
    train(net, [ema], range(16, 20), **LORA_SGD)  # the next snapshot collects it
    assert not old.exists() and new.exists()
    assert all(s.frozen == (new,) for s in list_snapshots(tmp_path))
    assert set(synth(tmp_path, 0.1)) == set(lora().state_dict())  # still readable


def test_collection_leaves_other_runs_files_alone(tmp_path: Path) -> None:
    net = lora()
    first = PostHocEMA(net, checkpoint_folder=tmp_path, run_id="first", **KW)
    train(net, [first], range(8), **LORA_SGD)
    first.release_folder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # another run's snapshots there
        second = PostHocEMA(net, checkpoint_folder=tmp_path, run_id="second", **KW)
        train(net, [second], range(8, 16), **LORA_SGD)
    names = sorted(p.name for p in side_files(tmp_path))
    assert len(names) == 2
    assert {n.split(".run-")[1].split(".")[0] for n in names} == {"first", "second"}
    for p in tmp_path.glob("step-*"):
        if "run-second" not in p.name and int(p.name[5:14]) <= 8:
            p.unlink()  # every snapshot of the first run
    train(net, [second], range(16, 20), **LORA_SGD)
    kept = [p.name for p in side_files(tmp_path)]
    assert any(".run-first." in n for n in kept)  # not the second run's to remove
    assert collect_frozen_files(tmp_path, "first")  # its own run may
    assert not any(".run-first." in p.name for p in side_files(tmp_path))
    assert set(synth(tmp_path, 0.1, run="second")) == set(lora().state_dict())


def test_a_resumed_run_refers_to_the_same_side_file(tmp_path: Path) -> None:
    net = lora()
    ref = PostHocEMA(net, checkpoint_folder=tmp_path / "ref", **{**KW, "share_frozen": False})
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "run", **KW)
    train(net, [ema, ref], range(8), **LORA_SGD)
    state, net_state = ema.state_dict(), {k: v.clone() for k, v in net.state_dict().items()}
    ema.release_folder()
    del ema
    net2 = lora()
    net2.load_state_dict(net_state)
    resumed = PostHocEMA(net2, checkpoint_folder=tmp_path / "run", **KW)
    resumed.load_state_dict(state)
    ref_net = ref.model
    ref_net.load_state_dict(net_state)
    train(net2, [resumed], range(8, 16), **LORA_SGD)
    train(ref_net, [ref], range(8, 16), **LORA_SGD)
    assert len(side_files(tmp_path / "run")) == 1
    assert_same(synth(tmp_path / "run", 0.15), synth(tmp_path / "ref", 0.15))


def test_a_full_disk_during_the_side_file_write_keeps_the_previous_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = lora()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path, **KW)
    train(net, [ema], range(4), **LORA_SGD)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")}
    real = snapshots_module.write_safetensors

    def full(f: Any, tensors: Any, header: Any, dtype: Any = None) -> None:
        if header.get("format") == frozen_module.FROZEN_FORMAT:
            f.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(f, tensors, header, dtype)

    monkeypatch.setattr(snapshots_module, "write_safetensors", full)
    net.base.bias.data.add_(1.0)  # a new frozen value: step 8 needs a new side file
    with pytest.raises(EMAError) as info:
        train(net, [ema], range(4, 8), **LORA_SGD)
    assert info.value.errno == errno.ENOSPC  # type: ignore[attr-defined]
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")} == before
    assert not [p for p in tmp_path.iterdir() if "emakit-tmp" in p.name]
    assert {s.step for s in list_snapshots(tmp_path)} == {4}
    monkeypatch.undo()
    ema.checkpoint()
    assert len(side_files(tmp_path)) == 2 and {s.step for s in list_snapshots(tmp_path)} == {4, 8}


def _killed_during_side_file(folder: Path) -> None:  # in a forked child
    torch.set_num_threads(1)  # no OpenMP pool after fork
    net = lora()
    ema = PostHocEMA(net, checkpoint_folder=folder, run_id="killed", **KW)
    train(net, [ema], range(4), **LORA_SGD)
    real = snapshots_module.write_safetensors

    def killed(f: Any, tensors: Any, header: Any, dtype: Any = None) -> None:
        if header.get("format") == frozen_module.FROZEN_FORMAT:
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real(f, tensors, header, dtype)

    snapshots_module.write_safetensors = killed
    net.base.bias.data.add_(1.0)
    train(net, [ema], range(4, 8), **LORA_SGD)
    os._exit(3)  # not reached


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs fork() and SIGKILL")
def test_a_sigkill_during_the_side_file_write_leaves_the_previous_set_usable(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        proc = mp.get_context("fork").Process(target=_killed_during_side_file, args=(tmp_path,))
        proc.start()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the child did not die")
    assert proc.exitcode == -signal.SIGKILL
    assert [p for p in tmp_path.iterdir() if "emakit-tmp" in p.name]  # the killed write's
    snaps = list_snapshots(tmp_path)
    assert {s.step for s in snaps} == {4} and len(side_files(tmp_path)) == 1
    net = lora()
    ref = PostHocEMA(net, checkpoint_folder=tmp_path / "ref", store_frozen_once=False, **KW)
    train(net, [ref], range(4), **LORA_SGD)
    assert_same(synth(tmp_path, 0.15, run="killed"), synth(tmp_path / "ref", 0.15))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        again = PostHocEMA(net, checkpoint_folder=tmp_path, run_id="killed", **KW)
        train(net, [again], range(4, 8), **LORA_SGD)  # the next write removes the leftover
    assert not [p for p in tmp_path.iterdir() if "emakit-tmp" in p.name]


def synthesize_state_dict_of(snaps: list) -> None:
    from emakit.posthoc.snapshots.format import open_snapshot

    with open_snapshot(snaps[0]) as f:
        f.get("base.weight")


def test_a_missing_or_replaced_side_file_is_never_read_as_the_frozen_weights(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    once, _ = pair
    folder = tmp_path / "copy"
    folder.mkdir()
    for p in once.glob("*.safetensors"):
        (folder / p.name).write_bytes(p.read_bytes())
    snaps = list_snapshots(folder)
    side = side_files(folder)[0]
    data = side.read_bytes()
    side.unlink()
    with pytest.warns(PostHocWarning, match="frozen weights file .* is missing or damaged"):
        assert list_snapshots(folder) == []
    with pytest.raises(EMAStateError, match="cannot be read"):  # planned before it went
        synthesize_state_dict_of(snaps)
    (folder / side.name).write_bytes(data.replace(b'"digest":"', b'"digest":"0', 1)[:-1])
    with pytest.warns(PostHocWarning, match="missing or damaged"):
        assert list_snapshots(folder) == []


def test_an_older_emakit_refuses_a_snapshot_with_a_side_file(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    once, copied = pair
    monkeypatch.setattr(snapshots_module, "SNAPSHOT_FORMAT_VERSION", 1)
    with pytest.raises(EMAStateError, match=r"format_version=2.*upgrade emakit"):
        list_snapshots(once)
    assert len(list_snapshots(copied)) == 8


def test_karras_ema_takes_share_frozen() -> None:
    from emakit import KarrasEMA

    net = lora()
    shared = KarrasEMA(net, sigma_rel=0.1, update_every=1, share_frozen=True)
    copied = KarrasEMA(net, sigma_rel=0.1, update_every=1)  # the default copies
    assert shared.shared_names() == FROZEN and copied.shared_names() == frozenset()
    assert copied.ema_model.base.weight.data_ptr() != net.base.weight.data_ptr()


def test_store_frozen_once_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(EMATypeError, match="store_frozen_once"):
        PostHocEMA(lora(), checkpoint_folder=tmp_path / "x", store_frozen_once=1, **KW)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()  # refused before anything was made


# -- the digest: names, dtypes, shapes and bytes of every tensor, one-element ones included --


def _digest_pair(change: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two sets of tensors that a side file could hold and that differ only by ``change``."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    one = {"w": w, "s": torch.tensor(1.0), "v": torch.tensor([1.0])}
    other = dict(one)
    if change == "reshaped":  # the same bytes in another shape
        other["w"] = w.reshape(4, 3)
    elif change == "flattened":
        other["w"] = w.reshape(-1)
    elif change == "zero_dim_value":
        other["s"] = torch.tensor(2.0)
    elif change == "one_element_value":
        other["v"] = torch.tensor([2.0])
    elif change == "one_element_shape":  # () and (1,): one element, the same bytes
        other["s"] = torch.tensor([1.0])
    elif change == "dtype":  # the same bytes read as another dtype
        other["w"] = w.view(torch.int32)
    elif change == "renamed":
        other["x"] = other.pop("w")
    return one, other


@pytest.mark.parametrize(
    "change",
    [
        "reshaped",
        "flattened",
        "zero_dim_value",
        "one_element_value",
        "one_element_shape",
        "dtype",
        "renamed",
    ],
)
def test_the_digest_tells_apart_any_change_of_a_tensor(change: str) -> None:
    one, other = _digest_pair(change)
    assert frozen_module.tensor_digest(one, None) == frozen_module.tensor_digest(dict(one), None)
    assert frozen_module.tensor_digest(one, None) != frozen_module.tensor_digest(other, None)
    # and in the snapshot dtype (floating tensors cast first)
    half = frozen_module.tensor_digest(one, torch.float16)
    assert half != frozen_module.tensor_digest(other, torch.float16)


def _copy_folder(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for p in source.glob("*.safetensors"):
        (folder / p.name).write_bytes(p.read_bytes())
    return folder


def _rewrite_side_file(side: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Write ``side`` again with its tensors changed by ``change`` and its header (the
    digest it records included) kept, as a bad copy or an edit would leave it."""
    import safetensors.torch

    with SafetensorsFile(side) as f:
        tensors = {n: f.get(n).clone() for n in f.keys()}  # noqa: SIM118
        header = dict(f.metadata)
    change(tensors)
    side.unlink()
    safetensors.torch.save_file(tensors, str(side), metadata=header)


def _assert_refused(folder: Path, side: Path) -> None:
    snaps = list_snapshots(folder)  # the header still names the digest: listed
    assert snaps and all(s.frozen == (side,) for s in snaps)
    with pytest.raises(EMAStateError, match="is damaged: the SHA-256 of its tensors"):
        frozen_module.check_side_file(side)
    with pytest.raises(EMAStateError, match="is damaged"):
        synthesize_state_dict_of(snaps)
    with pytest.raises(EMAStateError, match="is damaged"):
        synth(folder, 0.1)


def test_a_side_file_holding_the_same_bytes_in_another_shape_is_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    folder = _copy_folder(pair[0], tmp_path / "copy")
    (side,) = side_files(folder)
    frozen_module.check_side_file(side)  # the copy itself is fine

    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        tensors["base.weight"] = tensors["base.weight"].reshape(16, 64).contiguous()

    _rewrite_side_file(side, reshape)
    with SafetensorsFile(side) as f:
        assert f.shape("base.weight") == (16, 64)
    _assert_refused(folder, side)


class LoraScale(Lora):
    """`Lora` with a frozen one-element scale applied to the base's output."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.adapter(torch.tanh(self.scale * self.base(x)))


def lora_scale() -> LoraScale:
    torch.manual_seed(0)
    return LoraScale()


def test_a_side_file_with_a_changed_one_element_tensor_is_refused(tmp_path: Path) -> None:
    net = lora_scale()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "run", **KW)
    train(net, [ema], range(8), **LORA_SGD)
    ema.release_folder()
    (side,) = side_files(tmp_path / "run")
    with SafetensorsFile(side) as f:
        assert set(f.keys()) == {*FROZEN, "scale"} and f.get("scale").shape == ()
    frozen_module.check_side_file(side)

    def rescale(tensors: dict[str, torch.Tensor]) -> None:
        tensors["scale"] = tensors["scale"] * 2

    _rewrite_side_file(side, rescale)
    _assert_refused(tmp_path / "run", side)


def test_a_one_element_frozen_value_changed_in_place_gets_a_new_side_file(tmp_path: Path):
    net = lora_scale()
    once = PostHocEMA(net, checkpoint_folder=tmp_path / "once", **KW)
    every = PostHocEMA(net, checkpoint_folder=tmp_path / "every", store_frozen_once=False, **KW)

    def rescale(i: int) -> None:
        if i == 6:  # through .data: only the digest sees it
            net.scale.data.fill_(2.0)

    train(net, [once, every], range(16), at=rescale, **LORA_SGD)
    sides = side_files(tmp_path / "once")
    assert len(sides) == 2
    latest = max(list_snapshots(tmp_path / "once"), key=lambda s: s.step)
    with SafetensorsFile(latest.frozen[0]) as f:
        assert float(f.get("scale")) == 2.0  # never the old value
    for sigma_rel, step in [(0.1, None), (0.2, 8), (0.05, 4)]:
        got = synth(tmp_path / "once", sigma_rel, step)
        assert_same(got, synth(tmp_path / "every", sigma_rel, step))


# -- a side file's bytes are checked against its SHA-256 -------------------------------------


def side_file(folder: Path) -> Path:
    """The folder's one side file."""
    (side,) = side_files(folder)
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


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_side_file_with_a_changed_byte_is_refused_naming_it(tiny_lora_folder: Path, where: str):
    side = side_file(tiny_lora_folder)
    start, end = data_start(side), side.stat().st_size
    offset = {"first": start, "middle": (start + end) // 2, "last": end - 1}[where]
    flip(side, offset)
    snaps = list_snapshots(tiny_lora_folder)  # the header is intact: the snapshots are still listed
    assert snaps
    with pytest.raises(EMAStateError) as e:
        quiet_synthesize(tiny_lora_folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "SHA-256" in text and "damaged" in text
    digest = json.loads(side.read_bytes()[8 : data_start(side)])["__metadata__"]["digest"]
    assert digest in text  # the digest its snapshots record, and the one found
    assert any(s.path.name in text for s in snaps)  # and a snapshot that refers to it
    with pytest.raises(EMAStateError, match="SHA-256"):
        quiet(sweep, tiny_lora_folder, lambda state: 0.0, [0.1])
    ema = EMA(TinyLora())
    with pytest.raises(EMAStateError, match=f"{side.name}.*SHA-256"):
        load_ema_weights(ema, snaps[-1].path)
    for target in (tiny_lora_folder, snaps[-1].path, side):
        out = CliRunner().invoke(inspect_cmd, [str(target)])
        assert out.exit_code == 1 and "SHA-256" in out.output, out.output
        assert "Traceback" not in out.output


def test_an_intact_side_file_reads_as_before(tiny_lora_folder: Path, tiny_lora_run: Path):
    """The check costs a read: it must not change what is read."""
    got = quiet_synthesize(tiny_lora_folder, sigma_rel=0.1)
    snaps = list_snapshots(tiny_lora_folder)
    ema = EMA(TinyLora())
    load_ema_weights(ema, snaps[-1].path)
    assert torch.equal(ema.ema_model.base.weight, got["base.weight"].to(torch.float16).float())
    out = CliRunner().invoke(inspect_cmd, [str(tiny_lora_folder)])
    assert out.exit_code == 0 and "SHA-256 checked" in out.output, out.output


def test_a_damaged_side_file_is_written_again_by_the_next_snapshot(tmp_path: Path):
    """The writer never points new snapshots at a side file whose bytes do not hash to
    their digest: it writes the file again (from the model's intact weights), which heals
    the earlier snapshots too (same digest, same bytes)."""
    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    net = TinyLora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **KW)
    train(net, [ema], range(8), **TINY_LORA_SGD)
    side = side_file(folder)
    good = side.read_bytes()
    flip(side, data_start(side) + 5)
    train(net, [ema], range(8, 12), **TINY_LORA_SGD)
    assert side_file(folder) == side and side.read_bytes() == good
    assert set(quiet_synthesize(folder, sigma_rel=0.1)) == set(TinyLora().state_dict())


# -- an output never replaces a file the snapshots are made of ---------------------------------


def damage_header(path: Path) -> None:
    """One byte of the JSON header changed: the file cannot be read any more."""
    data = bytearray(path.read_bytes())
    data[9] = ord("!")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["path", "hard link", "symlink"])
def test_out_over_a_side_file_is_refused(tiny_lora_folder: Path, tmp_path: Path, how: str):
    side = side_file(tiny_lora_folder)
    before = side.read_bytes()
    out = side
    if how == "hard link":
        out = tmp_path / "elsewhere.safetensors"
        os.link(side, out)
    elif how == "symlink":
        out = tmp_path / "elsewhere.safetensors"
        out.symlink_to(side)
    got = CliRunner().invoke(
        synthesize_cmd, [str(tiny_lora_folder), "--sigma-rel", "0.1", "--out", str(out), "--force"]
    )
    assert got.exit_code == 1 and "input snapshot" in got.output, got.output
    assert side.read_bytes() == before
    with pytest.raises(EMAValueError, match="input snapshots"):
        sweep(tiny_lora_folder, lambda state: 0.0, [0.1], plot=out)
    assert side.read_bytes() == before


def test_out_over_any_file_of_a_damaged_snapshot_is_refused(tiny_lora_folder: Path):
    """A snapshot that cannot be listed (a damaged header) and its side file are files of
    the snapshots all the same; so is a side file nothing refers to yet."""
    snaps = list_snapshots(tiny_lora_folder)
    damaged, side = snaps[0].path, side_file(tiny_lora_folder)
    damage_header(damaged)
    orphan = tiny_lora_folder / ("frozen-" + "0" * 32 + ".run-other.safetensors")
    shutil.copy(side, orphan)
    for target in (damaged, side, orphan):
        got = CliRunner().invoke(
            synthesize_cmd,
            [str(tiny_lora_folder), "--sigma-rel", "0.1", "--out", str(target), "--force"],
        )
        assert got.exit_code == 1 and "input snapshot" in got.output, (target, got.output)
    plain = tiny_lora_folder / "ema.safetensors"  # a previous output may be replaced with --force
    for _ in range(2):
        got = CliRunner().invoke(
            synthesize_cmd,
            [str(tiny_lora_folder), "--sigma-rel", "0.1", "--out", str(plain), "--force"],
        )
        assert got.exit_code == 0, got.output


# -- collect_frozen_files: its arguments; an unreadable snapshot keeps every side file ---------


def test_collect_frozen_files_checks_its_arguments(tiny_lora_folder: Path, tmp_path: Path):
    with pytest.raises(EMAFileNotFoundError, match="does not exist"):
        collect_frozen_files(tmp_path / "nonexistent")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(EMAValueError, match="is not a folder"):
        collect_frozen_files(a_file)
    for run in ("../x", "a/b", "..", "", "x" * 65):
        with pytest.raises(EMAValueError, match="run must be"):
            collect_frozen_files(tiny_lora_folder, run)
    with pytest.raises(EMATypeError, match="run must be a str"):
        collect_frozen_files(tiny_lora_folder, 3)  # type: ignore[arg-type]
    for shard in ((2, 2), (-1, 2), (0,), [0, 2], (0.0, 2)):
        with pytest.raises(EMAValueError, match="shard must be"):
            collect_frozen_files(tiny_lora_folder, None, shard)  # type: ignore[arg-type]
    assert side_file(tiny_lora_folder).exists()


def test_an_unreadable_snapshot_keeps_every_side_file(tiny_lora_folder: Path):
    """A snapshot with one damaged header byte may refer to any side file: none is
    removed, whatever else refers to it; once it is gone, collection resumes."""
    side = side_file(tiny_lora_folder)
    snaps = list_snapshots(tiny_lora_folder)
    run = snaps[0].run
    keep = snaps[0].path
    damage_header(keep)
    for s in snaps[1:]:
        for p in s.files:
            p.unlink()  # every readable snapshot gone: only the damaged one refers to it
    with pytest.warns(PostHocWarning, match=f"kept 1 frozen weights file.*{keep.name}"):
        assert collect_frozen_files(tiny_lora_folder, run) == []
    assert side.exists()
    with pytest.warns(PostHocWarning, match="kept"):
        assert collect_frozen_files(tiny_lora_folder) == []
    keep.unlink()
    assert collect_frozen_files(tiny_lora_folder, run) == [side]


@pytest.mark.parametrize(
    "change",
    [
        {"format": "emakit.posthoc.snapshoT"},  # almost a snapshot
        {"frozen_file": "frozen-0123.run-x.safetensors"},  # a malformed reference
        {"frozen_fi1e": "x"},  # a misspelt key
    ],
)
def test_a_damaged_reference_keeps_every_side_file(tiny_lora_folder: Path, change: dict[str, str]):
    side = side_file(tiny_lora_folder)
    snaps = list_snapshots(tiny_lora_folder)
    rewrite_metadata(snaps[0].path, **change)
    if "frozen_fi1e" in change:
        raw = snaps[0].path.read_bytes()
        snaps[0].path.write_bytes(raw.replace(b'"frozen_file"', b'"frozen_fiLe"', 1))
    for s in snaps[1:]:
        for p in s.files:
            p.unlink()
    with pytest.warns(PostHocWarning, match="kept"):
        assert collect_frozen_files(tiny_lora_folder, snaps[0].run) == []
    assert side.exists()


def test_the_clean_up_after_each_checkpoint_keeps_a_damaged_snapshots_side_file(tmp_path: Path):
    """The writer's clean-up is the same function: a new side file (a new base value)
    never makes it remove the old one while a damaged snapshot may refer to it."""
    folder = tmp_path / "snaps"
    torch.manual_seed(0)
    net = TinyLora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **KW)
    train(net, [ema], range(8), **TINY_LORA_SGD)
    (old,) = [p for p in folder.iterdir() if is_side_file(p.name)]
    steps4 = sorted(folder.glob("step-000000004_*"))
    damage_header(steps4[0])
    for p in [*steps4[1:], *folder.glob("step-000000008_*")]:
        p.unlink()
    net.base.bias.data.add_(1.0)  # a new value: the next snapshot writes a new side file
    with pytest.warns(PostHocWarning, match="kept 1 frozen weights file"):
        train(net, [ema], range(8, 12), **TINY_LORA_SGD)
    assert old.exists()
    assert len([p for p in folder.iterdir() if is_side_file(p.name)]) == 2


# -- the errors name the side file and the snapshot -------------------------------------------


def test_snapshots_copied_without_their_side_file_name_it(tiny_lora_folder: Path, tmp_path: Path):
    side = side_file(tiny_lora_folder)
    side.unlink()
    with pytest.raises(EMAStateError) as e:
        quiet_synthesize(tiny_lora_folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "does not exist" in text and "step-" in text
    assert "call checkpoint() first" not in text
    out = CliRunner().invoke(inspect_cmd, [str(tiny_lora_folder)])
    assert out.exit_code == 1 and side.name in out.output, out.output


@pytest.mark.parametrize("damage", ["truncated", "dangling", "another file"])
def test_a_broken_side_file_is_named_with_its_snapshot(
    tiny_lora_folder: Path, tmp_path: Path, damage: str
):
    side = side_file(tiny_lora_folder)
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
        quiet_synthesize(tiny_lora_folder, sigma_rel=0.1)
    text = str(e.value)
    assert side.name in text and "step-" in text, text
    out = CliRunner().invoke(
        synthesize_cmd,
        [str(tiny_lora_folder), "--sigma-rel", "0.1", "--out", str(tmp_path / "o.pt")],
    )
    assert out.exit_code == 1 and side.name in out.output and "step-" in out.output
