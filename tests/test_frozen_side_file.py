"""The side files of post-hoc snapshots (`emakit.posthoc.snapshots.frozen`), checked piece
by piece: the header a side file is written with, its name and whether it must be written
(`frozen_part`), the copies a snapshot stores (`snapshot_tensors`), and the message of each
refusal: `check_side_file` (missing, not a side file, replaced, damaged), a snapshot whose
side file lacks or repeats tensors, the listing's warnings. The end-to-end runs (training,
synthesis, the CLI) are in ``test_posthoc_frozen.py``; here each side file is either a
`TinyLora` run's or written by hand from `frozen_part`, so every case is small."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _models import TINY_LORA_POSTHOC, TinyLora
from emakit import EMA, PostHocEMA
from emakit._files.safetensors_file import SafetensorsFile
from emakit._version import __version__
from emakit.checkpoint import load_ema_weights
from emakit.errors import EMAStateError
from emakit.posthoc import PostHocWarning, list_snapshots
from emakit.posthoc.snapshots import frozen as frozen_module
from emakit.posthoc.snapshots.format import open_snapshot
from emakit.posthoc.snapshots.frozen import (
    FrozenPart,
    check_side_file,
    frozen_part,
    frozen_ref,
    frozen_tensors,
    is_side_file,
    join_frozen,
    side_missing,
    snapshot_tensors,
    tensor_digest,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = "r1"
#: The end of every message that refuses a snapshot because of its side file.
KEEP_TOGETHER = (
    "; the snapshot cannot be read without it (the side files of a snapshot folder must "
    "stay next to its snapshots: copy or move the folder as a whole)"
)


def names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def part_of(
    folder: Path, tensors: dict[str, torch.Tensor], shard: tuple[int, int] | None = None
) -> FrozenPart:
    """The frozen part of one profile that shares all of ``tensors``."""
    part = frozen_part(
        [tensors], [frozenset(tensors)], dtype=None, folder=folder, run=RUN, shard=shard
    )
    assert part is not None
    return part


def write_side(part: FrozenPart, tensors: dict[str, torch.Tensor] | None = None, **header) -> Path:
    """Write ``part``'s side file (``tensors`` in place of its own, ``header`` entries
    changed; an entry set to None is left out), as the writer does."""
    meta = {k: v for k, v in {**part.header(RUN), **header}.items() if v is not None}
    save_file(snapshot_tensors(part.tensors if tensors is None else tensors, None), part.path, meta)
    return part.path


def side_error(snapshot: Path, side: Path, why: str) -> str:
    return (
        f"snapshot {snapshot} takes its frozen weights from {side.name}, which {why}{KEEP_TOGETHER}"
    )


def check_message(path: Path, users: tuple[Path, ...] = (), digest: str | None = None) -> str:
    with pytest.raises(EMAStateError) as info:
        check_side_file(path, users, digest)
    return str(info.value)


def side_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if is_side_file(p.name))


# -- what is written ---------------------------------------------------------------------------


def test_a_runs_side_file_header_is_the_documented_one(tiny_lora_run: Path):
    (side,) = side_files(tiny_lora_run)
    with SafetensorsFile(side) as f:
        meta = dict(f.metadata)
    run = side.name.split(".run-")[1].removesuffix(".safetensors")
    assert meta == {
        "format": "emakit.posthoc.frozen",
        "format_version": "1",
        "emakit_version": __version__,
        "digest": meta["digest"],
        "run": run,
    }
    assert side.name.startswith(f"frozen-{meta['digest'][:32]}.")


def test_frozen_part_names_the_file_and_says_whether_to_write_it(tmp_path: Path):
    tensors = {"base.weight": torch.ones(2, 2), "base.bias": torch.zeros(2)}
    part = part_of(tmp_path, tensors)
    assert part.path.name == f"frozen-{part.digest[:32]}.run-{RUN}.safetensors"
    assert part.new is True  # no side file of this digest yet
    write_side(part)
    assert part_of(tmp_path, tensors).new is False  # written: referred to, not written again
    write_side(part, digest="0" * 64)
    assert part_of(tmp_path, tensors).new is True  # another digest at that name: replaced


def test_a_ranks_side_file_is_named_with_its_rank(tmp_path: Path):
    part = part_of(tmp_path, {"w": torch.ones(3)}, shard=(1, 4))
    assert part.path.name == f"frozen-{part.digest[:32]}.run-{RUN}.rank-00001-of-00004.safetensors"
    assert is_side_file(part.path.name)


def test_snapshot_tensors_are_copies():
    t = torch.arange(4.0)
    out = snapshot_tensors({"w": t}, None)
    t.add_(10)
    assert torch.equal(out["w"], torch.arange(4.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_tensors_and_their_digest_are_taken_on_the_cpu():
    t = torch.arange(4.0)
    out = snapshot_tensors({"w": t.cuda()}, torch.float16)
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], t.half())
    assert tensor_digest({"w": t.cuda()}, None) == tensor_digest({"w": t}, None)


def test_only_values_made_infinite_by_the_cast_are_reported():
    finite = {"w": torch.full((2,), 1.5), "i": torch.arange(3)}
    already = {"w": torch.tensor([float("inf"), 1.0])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = snapshot_tensors({**finite, **already}, torch.float16)
    assert out["w"].dtype == torch.float16 and out["i"].dtype == torch.int64
    big = {n: torch.full((1,), 1e6) for n in names(6)}
    with pytest.warns(PostHocWarning) as caught:
        snapshot_tensors(big, torch.float16)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(f"post-hoc EMA snapshot: values of {names(5)} overflow torch.float16")


@pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add stack frames"
)
def test_an_overflow_warning_points_at_the_users_update(tmp_path: Path):
    """A float16 snapshot that overflows warns at the line that called ``update()``, not
    inside emakit (where Python would also show it only once for every caller)."""
    net = TinyLora()
    ema = PostHocEMA(
        net,
        checkpoint_folder=tmp_path / "snaps",
        checkpoint_dtype=torch.float16,
        **{**TINY_LORA_POSTHOC, "checkpoint_every_num_steps": 1},
    )
    with torch.no_grad():
        net.adapter.weight.mul_(1e6)
    with pytest.warns(PostHocWarning, match="overflow torch.float16") as caught:
        ema.update()
    where = {(Path(w.filename).name, w.lineno) for w in caught if "overflow" in str(w.message)}
    assert where == {(Path(__file__).name, sys._getframe().f_lineno - 2)}  # each profile's
    ema.release_folder()


# -- check_side_file ---------------------------------------------------------------------------


def test_check_side_file_names_a_missing_file_and_its_first_snapshot(tmp_path: Path):
    side = tmp_path / f"frozen-{'a' * 32}.run-{RUN}.safetensors"
    users = (tmp_path / "step-1.safetensors", tmp_path / "step-2.safetensors")
    why = f"cannot be read (frozen weights file {side} does not exist)"
    assert check_message(side, users) == side_error(users[0], side, why)
    assert check_message(side) == side_error(side, side, why)  # no snapshot: the file itself


def test_check_side_file_refuses_a_file_of_another_format(tmp_path: Path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.ones(2)}, path, {"format": "pt"})
    users = (tmp_path / "step-1.safetensors",)
    why = "is not a frozen weights file (its header format is 'pt')"
    assert check_message(path, users) == side_error(users[0], path, why)


def test_check_side_file_refuses_a_file_recording_another_digest(tmp_path: Path):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    side = write_side(part)
    check_side_file(side, (), part.digest)  # intact
    message = check_message(side, (), "0" * 64)
    assert message == side_error(
        side, side, f"records another digest ({part.digest!r}): it was replaced"
    )


def test_check_side_file_refuses_a_side_file_header_without_a_digest(tmp_path: Path):
    side = write_side(part_of(tmp_path, {"w": torch.ones(2)}), digest=None)
    assert check_message(side) == side_error(
        side, side, "records another digest (None): it was replaced"
    )


@pytest.mark.parametrize("n_users", [3, 4])
def test_a_damaged_side_file_names_three_of_its_snapshots(tmp_path: Path, n_users: int):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    side = write_side(part, {"w": torch.full((2,), 2.0)})  # other bytes, the header kept
    users = tuple(tmp_path / f"step-{i}.safetensors" for i in range(n_users))
    listed = ", ".join(str(p) for p in users[:3]) + (" ..." if n_users > 3 else "")
    message = check_message(side, users)
    assert "is damaged: the SHA-256 of its tensors is " in message
    assert f"taking their frozen weights from it ({listed}) record {part.digest};" in message


# -- a snapshot's side file read with it -------------------------------------------------------


def snapshot_of(part: FrozenPart) -> tuple[Path, dict[str, str]]:
    """A snapshot path beside ``part``'s side file and the header entries naming it."""
    fields = part.fields(0)
    assert fields is not None
    return part.path.parent / "step-000000004_sigma_rel-0.1_gamma-1.0.safetensors", fields


def malformed_header(path: Path, why: str) -> str:
    return (
        f"snapshot file {path} has a malformed header ({why}); the file is damaged or was not "
        f"written by emakit: move it out of the folder"
    )


def test_a_header_naming_no_side_file_refers_to_none(tmp_path: Path):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    snapshot, meta = snapshot_of(part)
    ref = frozen_ref(snapshot, meta)
    assert ref is not None
    assert (ref.file, ref.digest, ref.names) == (part.path, part.digest, frozenset({"w"}))
    del meta["frozen_file"]
    assert frozen_ref(snapshot, meta) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frozen_file", "../frozen-0000.safetensors"),  # not a side file's name
        ("frozen_file", "step-000000004.safetensors"),
        ("frozen_digest", None),  # left out
        ("frozen_digest", "A" * 64),  # not lowercase hex
        ("frozen_digest", "0" * 64),  # well formed, but not the one the file is named after
    ],
)
def test_a_malformed_reference_is_refused_naming_the_field(
    tmp_path: Path, field: str, value: str | None
):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    snapshot, meta = snapshot_of(part)
    meta = {k: v for k, v in {**meta, field: value}.items() if v is not None}
    with pytest.raises(EMAStateError) as info:
        frozen_ref(snapshot, meta)
    assert str(info.value) == malformed_header(snapshot, f"{field}={value!r}")


def test_the_listing_checks_each_side_file_apart(tmp_path: Path):
    """Two snapshots of one folder naming two side files, one of them missing: only the
    snapshot of the missing one is skipped, whichever is checked first."""
    fine = part_of(tmp_path, {"w": torch.ones(2)})
    write_side(fine)
    gone = part_of(tmp_path, {"w": torch.zeros(2)})
    assert gone.path != fine.path
    seen: dict = {}
    for part, why in ((fine, ""), (gone, "does not exist"), (fine, "")):
        snapshot, meta = snapshot_of(part)
        message = side_missing(snapshot, meta, seen)
        assert (why in message) if why else message == "", message
    assert sorted(seen.values()) == ["", "does not exist"]


def test_a_snapshots_missing_side_file_is_named_with_the_snapshot(tmp_path: Path):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    snapshot, meta = snapshot_of(part)
    why = f"cannot be read (frozen weights file {part.path} does not exist)"
    with pytest.raises(EMAStateError) as info:
        frozen_tensors(snapshot, meta, ())
    assert str(info.value) == side_error(snapshot, part.path, why)


def test_a_side_file_of_another_format_is_refused_even_with_the_right_digest(tmp_path: Path):
    part = part_of(tmp_path, {"w": torch.ones(2)})
    write_side(part, format="emakit.posthoc.snapshot")
    snapshot, meta = snapshot_of(part)
    with pytest.raises(EMAStateError) as info:
        frozen_tensors(snapshot, meta, ())
    assert str(info.value) == side_error(
        snapshot, part.path, "records another digest (it was replaced)"
    )
    write_side(part)  # the same file with its own header: read
    assert torch.equal(frozen_tensors(snapshot, meta, ())["w"], torch.ones(2))


def test_a_side_file_lacking_tensors_lists_five(tmp_path: Path):
    tensors = {n: torch.full((1,), float(i)) for i, n in enumerate(names(7))}
    part = part_of(tmp_path, tensors)
    write_side(part, {"n6": tensors["n6"]})  # six of seven left out
    snapshot, meta = snapshot_of(part)
    with pytest.raises(EMAStateError) as info:
        frozen_tensors(snapshot, meta, ())
    assert str(info.value) == side_error(snapshot, part.path, f"lacks {names(5)}")


def test_a_snapshot_holding_its_frozen_tensors_too_lists_five(tmp_path: Path):
    tensors = {n: torch.full((1,), float(i)) for i, n in enumerate(names(7))}
    part = part_of(tmp_path, tensors)
    write_side(part)
    snapshot, meta = snapshot_of(part)
    with pytest.raises(EMAStateError) as info:
        frozen_tensors(snapshot, meta, names(6))  # six also stored in the snapshot
    assert str(info.value) == side_error(snapshot, part.path, f"repeats {names(5)}")


def test_load_ema_weights_names_the_snapshot_of_a_missing_side_file(tiny_lora_folder: Path):
    (side,) = side_files(tiny_lora_folder)
    snapshot = list_snapshots(tiny_lora_folder)[-1].path
    side.unlink()
    with pytest.raises(EMAStateError, match=f"snapshot {snapshot} takes its frozen weights from"):
        load_ema_weights(EMA(TinyLora()), snapshot)


def test_the_joined_reader_keeps_the_snapshots_header_and_hashes_once(
    tiny_lora_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    info = list_snapshots(tiny_lora_folder)[-1]
    hashed = []
    digest = frozen_module.tensor_digest
    monkeypatch.setattr(frozen_module, "tensor_digest", lambda *a: hashed.append(1) or digest(*a))
    with SafetensorsFile(info.path) as f, join_frozen(f) as g:
        assert g.metadata == f.metadata and g.path == info.path
        assert "frozen_file" in g.metadata
    with open_snapshot(info) as g:
        first, again = g.get("base.weight"), g.get("base.weight")
        g.get("base.bias")
    assert torch.equal(first, again)
    assert len(hashed) == 1  # the side file read and hashed at its first tensor only


# -- the listing's warnings --------------------------------------------------------------------


def test_the_listing_says_why_a_side_file_is_unusable(tiny_lora_folder: Path, tmp_path: Path):
    (side,) = side_files(tiny_lora_folder)
    side.unlink()
    with pytest.warns(
        PostHocWarning, match=f"{side.name} is missing or damaged: it does not exist \\("
    ):
        assert list_snapshots(tiny_lora_folder) == []
    side.symlink_to(tmp_path / "gone.safetensors")  # dangling
    why = f"it cannot be read (frozen weights file {side} does not exist)"
    with pytest.warns(PostHocWarning) as caught:
        assert list_snapshots(tiny_lora_folder) == []
    assert any(why in str(w.message) for w in caught), [str(w.message) for w in caught]
