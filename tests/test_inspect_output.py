"""``emakit inspect``'s whole output on each kind of input, compared with an expected text.

Each case runs ``emakit inspect`` through click's test runner on a small fixture built
here (a post-hoc snapshot folder, the folders of several runs, of ema-pytorch and of a
sharded model, exported weights, EMA states in torch files, files that are no checkpoint)
and compares the command, its exit code, stdout and stderr with
``tests/fixtures/inspect/<case>.txt``. After an intended change of the output, rewrite the
expected texts and review their diff::

    EMAKIT_REGENERATE=1 pytest tests/test_inspect_output.py

What would differ between machines is pinned or normalized:

* the temporary folder is shown as ``<tmp>``;
* emakit's version, which every header emakit writes records, would change the files'
  sizes with each release: the fixtures are written as emakit ``0.0.0`` (`pinned_version`);
* the size of a file ``torch.save`` wrote (a torch checkpoint, ema-pytorch's snapshots)
  follows torch's zip layout, which changes between torch versions: in the cases that
  show one it is ``<size>``, and as it widens a table's column, the runs of spaces that
  align the columns are cut to two and the rule under the header to one dash per column
  (the other cases check the alignment);
* every tensor value is set explicitly (no random numbers), so the SHA-256 digest that
  names a side file of frozen weights is the same everywhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import emakit
from emakit import EMA, PostHocEMA
from emakit._files.safetensors_file import write_safetensors
from emakit.checkpoint import save_ema_weights
from emakit.inspection import inspect_cmd
from emakit.posthoc.math import sigma_rel_to_gamma
from emakit.posthoc.snapshots.format import (
    SnapshotInfo,
    snapshot_filename,
    snapshot_header,
    write_snapshot,
)
from emakit.posthoc.snapshots.legacy import legacy_filename, legacy_state
from emakit.posthoc.snapshots.shards import Block, shard_header

GOLDEN = Path(__file__).parent / "fixtures" / "inspect"
REGENERATE = os.environ.get("EMAKIT_REGENERATE") == "1"
#: A file size as inspect prints it (`emakit.inspection._size`).
SIZE = re.compile(r"\b\d+(?:\.\d)? (?:B|KiB|MiB|GiB)\b")


# -- fixtures: every value set explicitly --------------------------------------------------


def filled(module: nn.Module) -> nn.Module:
    """``module`` with each parameter and floating buffer holding ``arange`` values."""
    with torch.no_grad():
        for i, t in enumerate([*module.parameters(), *module.buffers()]):
            if t.is_floating_point():
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) / (10 + i))
    return module


class Tagger(nn.Module):
    """A frozen base (stored once, in a side file), a float32 head and a float64 scale
    (averaged), a BatchNorm whose buffers are copied."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.bn = nn.BatchNorm1d(2)
        filled(self)


def seven_layers() -> nn.Sequential:
    """14 tensors: more than inspect lists (12)."""
    return filled(nn.Sequential(*[nn.Linear(2, 2) for _ in range(7)]))


def six_layers() -> nn.Sequential:
    """12 tensors: as many as inspect lists."""
    return filled(nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)]))


def ema_state(model: nn.Module, steps: int = 3) -> dict[str, torch.Tensor]:
    ema = EMA(model, beta=0.9, update_after_step=0)
    for _ in range(steps):
        ema.update()
    return ema.state_dict()


def write_snapshots_of(model: nn.Module, folder: Path, steps: range, **kwargs: object) -> None:
    """``model``'s post-hoc snapshots, every step of ``steps`` (one update per step)."""
    ema = PostHocEMA(
        model,
        update_every=1,
        checkpoint_every_num_steps=steps.step,
        checkpoint_folder=folder,
        checkpoint_dtype=None,
        **kwargs,
    )
    for _ in range(steps.stop - 1):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.01)
        ema.update()


def write_by_hand(
    folder: Path, tensors: dict[str, torch.Tensor], sigma_rel: float, step: int, **fields: object
) -> None:
    """One snapshot of profile ``fields["profile"]`` (default 0) written as ``sigma_rel``'s."""
    gamma = sigma_rel_to_gamma(sigma_rel)
    name = snapshot_filename(step, sigma_rel, gamma)
    if fields.get("run"):
        name = name.replace(".safetensors", f"_run-{fields['run']}.safetensors")
    fields = {"profile": 0, "update_every": 1, "copied": frozenset(), **fields}
    write_snapshot(
        folder / name, tensors, step=step, t=step, gamma=gamma, sigma_rel=sigma_rel, **fields
    )


def write_ema_pytorch_files(folder: Path, profiles: int, steps: range) -> None:
    """ema-pytorch's ``<profile index>.<step>.pt`` snapshots of a Linear and a BatchNorm,
    every value in float16 as ema-pytorch stores them."""
    folder.mkdir()
    net = filled(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    tensors = {k: v.half() for k, v in net.state_dict().items()}
    for step in steps:
        for profile in range(profiles):
            torch.save(legacy_state(tensors, step), folder / legacy_filename(profile, step))


def write_shards(
    folder: Path, step: int, sigma_rel: float, profile: int, ranks: list[dict[str, object]]
) -> None:
    """One sharded snapshot, rank by rank: each ``{name: (global shape, offset, tensor)}``
    or ``{name: (global shape, None, None)}`` for a tensor that rank stores nothing of."""
    gamma = sigma_rel_to_gamma(sigma_rel)
    for rank, layout in enumerate(ranks):
        path = folder / snapshot_filename(step, sigma_rel, gamma, shard=(rank, len(ranks)))
        copied = frozenset({"running_mean"} & set(layout))
        info = SnapshotInfo(path, step, step, gamma, sigma_rel, profile, 1, copied)
        shapes = {n: shape for n, (shape, _, _) in layout.items()}
        stored = {n: t for n, (_, _, t) in layout.items() if t is not None}
        blocks = {
            n: Block(tuple(offset), tuple(t.shape))
            for n, (_, offset, t) in layout.items()
            if t is not None
        }
        header = {**snapshot_header(info), **shard_header((rank, len(ranks)), 7, shapes, blocks)}
        with open(path, "wb") as f:
            write_safetensors(f, stored, header)


@contextmanager
def pinned_version() -> Iterator[None]:
    """emakit's version as its writers record it, ``0.0.0``, inside the block: its length
    would change the files' sizes with each release."""
    real = emakit.__version__
    with pytest.MonkeyPatch.context() as mp:
        for name, module in list(sys.modules.items()):  # the writers are imported above
            if name.startswith("emakit") and getattr(module, "__version__", None) == real:
                mp.setattr(module, "__version__", "0.0.0")
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    with pinned_version():
        build(root)
    return root


def build(root: Path) -> None:
    """Every fixture, under ``root``."""

    # a PostHocEMA folder: 2 profiles, 3 steps, a side file (the frozen base is shared, so
    # stored once: share_frozen=True; copied by default), and a file of the user's
    snaps = root / "snapshots"
    write_snapshots_of(
        Tagger(), snaps, range(2, 7, 2), sigma_rels=(0.05, 0.28), run_id="golden", share_frozen=True
    )
    (snaps / "notes.txt").write_text("not a snapshot\n")

    # the same, its side file damaged (the last byte of its tensors flipped)
    damaged = root / "damaged-side-file"
    shutil.copytree(snaps, damaged)
    side = next(damaged.glob("frozen-*.safetensors"))
    data = bytearray(side.read_bytes())
    data[-1] ^= 0xFF
    side.write_bytes(bytes(data))

    # two runs in one folder: snapshots written before run ids, and run "second"
    runs = root / "runs"
    runs.mkdir()
    linear = filled(nn.Linear(2, 1))
    for step in (2, 4):
        write_by_hand(runs, dict(linear.state_dict()), 0.05, step)
    for step in (2, 4, 6):
        write_by_hand(runs, dict(linear.state_dict()), 0.05, step, run="second")

    # ema-pytorch's folders: 21 files (one more than inspect lists) and 20
    write_ema_pytorch_files(root / "ema-pytorch", 3, range(10, 71, 10))
    shutil.copytree(root / "ema-pytorch", root / "ema-pytorch-20")
    (root / "ema-pytorch-20" / legacy_filename(2, 70)).unlink()
    # ema-pytorch's files holding a tensor of a dtype safetensors has no code for
    complex128 = root / "ema-pytorch-complex128"
    complex128.mkdir()
    tensors = {
        "w": torch.ones(2, dtype=torch.float16),
        "phase": torch.ones(2, dtype=torch.complex128),
    }
    for step in (10, 20):
        torch.save(legacy_state(tensors, step), complex128 / legacy_filename(0, step))

    # ema-pytorch's files, then emakit's snapshots of the same profiles (a resumed run)
    resumed = root / "resumed"
    write_ema_pytorch_files(resumed, 2, range(10, 21, 10))
    net = filled(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    copied = frozenset({"1.running_mean", "1.running_var", "1.num_batches_tracked"})
    for step in (30, 40):
        for profile, sigma_rel in enumerate((0.05, 0.28)):
            write_by_hand(
                resumed,
                dict(net.state_dict()),
                sigma_rel,
                step,
                profile=profile,
                copied=copied,
                run="resumed",
            )

    # a sharded model on 2 ranks: rank 0 stores the buffer, rank 1 none of "gate"
    sharded = root / "sharded"
    sharded.mkdir()
    w, mean = torch.arange(6.0).reshape(3, 2), torch.zeros(2)
    for step in (2, 4):
        write_shards(sharded, step, 0.05, 0, [
            {"inp.weight": ((3, 2), (0, 0), w[:2]), "gate": ((1, 2), (0, 0), torch.ones(1, 2)),
             "running_mean": ((2,), (0,), mean)},
            {"inp.weight": ((3, 2), (2, 0), w[2:]), "gate": ((1, 2), None, None),
             "running_mean": ((2,), None, None)},
        ])  # fmt: skip
    # rank 0 stores nothing of "gate" (inspect shows it in the dtype of rank 1's block); a
    # set whose rank 0 stores nothing at all
    write_shards(sharded, 4, 0.28, 1, [
        {"inp.weight": ((3, 2), (0, 0), w[:2]), "gate": ((1, 2), None, None),
         "running_mean": ((2,), (0,), mean)},
        {"inp.weight": ((3, 2), (2, 0), w[2:]), "gate": ((1, 2), (0, 0), torch.ones(1, 2)),
         "running_mean": ((2,), None, None)},
    ])  # fmt: skip
    empty_rank = root / "sharded-rank-0-empty"
    empty_rank.mkdir()
    write_shards(empty_rank, 2, 0.05, 0, [
        {"gate": ((1, 2), None, None)},
        {"gate": ((1, 2), (0, 0), torch.ones(1, 2))},
    ])  # fmt: skip

    # rank 0 stores an integer buffer and nothing of a bfloat16 tensor: each tensor is shown
    # in the dtype of the file that stores it
    mixed = root / "sharded-dtypes"
    mixed.mkdir()
    write_shards(mixed, 2, 0.05, 0, [
        {"count": ((2,), (0,), torch.zeros(2, dtype=torch.int64)), "gate": ((1, 2), None, None)},
        {"count": ((2,), None, None), "gate": ((1, 2), (0, 0), torch.ones(1, 2).bfloat16())},
    ])  # fmt: skip

    # a tensor of no elements is stored by no rank: shown in rank 0's first dtype; a set
    # whose every tensor is empty: in float32
    nowhere = root / "sharded-empty-tensor"
    nowhere.mkdir()
    half = torch.arange(4.0).reshape(2, 2).half()
    write_shards(nowhere, 2, 0.05, 0, [
        {"w": ((2, 2), (0, 0), half[:1]), "empty": ((0, 2), None, None)},
        {"w": ((2, 2), (1, 0), half[1:]), "empty": ((0, 2), None, None)},
    ])  # fmt: skip
    all_empty = root / "sharded-all-empty"
    all_empty.mkdir()
    write_shards(all_empty, 2, 0.05, 0, [
        {"empty": ((0, 2), None, None)},
        {"empty": ((0, 2), None, None)},
    ])  # fmt: skip

    # folders without snapshots: another file only; snapshots with a damaged header
    (root / "nothing").mkdir()
    (root / "nothing" / "notes.txt").write_text("x\n")
    headers = root / "damaged-headers"  # a format a character or two off: skipped, said why
    headers.mkdir()
    formats = [
        "emakit.posthoc.snapshoT",
        "emakit.posthoc.snapsh0t",
        "Emakit.posthoc.snapshot",
        "emakit.posthoc.snapshoX",
        "emakit.posthoc.snapshoY",
    ]
    for i, fmt in enumerate(formats):
        with open(headers / f"snapshot-{i}.safetensors", "wb") as f:
            write_safetensors(f, {"w": torch.ones(2)}, {"format": fmt})

    files = root / "files"
    files.mkdir()
    # safetensors: exported EMA weights (14 tensors), a file with no metadata, a damaged
    # emakit header
    ema = EMA(seven_layers(), beta=0.9, update_after_step=0)
    ema.update()
    save_ema_weights(ema, files / "ema.safetensors")
    twelve = EMA(six_layers(), beta=0.9, update_after_step=0)
    twelve.update()
    save_ema_weights(twelve, files / "ema-12.safetensors")
    with open(files / "plain.safetensors", "wb") as f:
        write_safetensors(f, {"w": torch.ones(2, 3), "n": torch.tensor([1, 2])}, {})
    with open(files / "damaged-header.safetensors", "wb") as f:
        write_safetensors(f, {"w": torch.ones(2)}, {"format": "emakit.ema_weights"})

    # torch files holding an EMA state: alone, in Lightning checkpoints, nested
    state = ema_state(seven_layers())
    small = ema_state(filled(nn.Linear(2, 1)), steps=2)
    torch.save(state, files / "ema-state.pt")
    lightning = {"version": 2, "ema": small, "shards_in_state_dict": True}
    model = filled(nn.Linear(2, 1)).state_dict()
    torch.save(
        {"epoch": 2, "global_step": 30, "state_dict": model, "emakit_ema": lightning},
        files / "lightning-v2.ckpt",
    )
    torch.save({"state_dict": model, "emakit_ema": {"ema": small}}, files / "lightning-bare.ckpt")
    torch.save({"model": model, "ema": small}, files / "nested-one.pt")
    torch.save(
        {
            "model": model,
            "ema": small,
            "slow": {"ema": small},
            "fast": small,
            "epoch": 4,
            "step": torch.tensor(120),  # the training loop's own counters, shown beside
        },
        files / "nested-three.pt",
    )
    # torch files holding something else
    plain = {"w": torch.ones(2, 2), "h": torch.ones(3, dtype=torch.float16), "n": torch.tensor(5)}
    plain.update({f"setting_{i:02d}": i for i in range(11)})
    torch.save(plain, files / "plain.pt")
    torch.save(filled(nn.Linear(2, 1)).state_dict(prefix="net."), files / "prefixed-state.pt")
    torch.save({"a": torch.ones(3)}, files / "old-format.pt", _use_new_zipfile_serialization=False)
    torch.save([1, 2, 3], files / "3.1200.pt")
    torch.save({"epoch": 3, "best": 0.25}, files / "counters.pt")
    # files that are no checkpoint
    (files / "summary.json").write_text('{"loss": 0.5}\n')
    (files / "list.json").write_text("[1, 2]\n")
    (files / "indented.json").write_text('\n  {"a": 1}\n')
    (files / "spaced.json").write_text(" " * 64 + "{}\n")
    (files / "empty.bin").write_bytes(b"")
    (files / "notes.txt").write_text("hello, world\n")


# -- the cases ---------------------------------------------------------------------------

#: case -> (inspect's arguments under the fixture root, whether it shows torch.save's sizes)
CASES: dict[str, tuple[list[str], bool]] = {
    # post-hoc snapshot folders
    "folder": (["snapshots"], False),
    "folder_side_file_damaged": (["damaged-side-file"], False),
    "runs_one_picked": (["runs", "--run", "second"], False),
    "runs_before_run_ids_picked": (["runs", "--run", ""], False),
    "runs_none_picked": (["runs"], False),
    "runs_unknown_picked": (["runs", "--run", "third"], False),
    "ema_pytorch_folder": (["ema-pytorch"], False),
    "ema_pytorch_folder_of_20": (["ema-pytorch-20"], False),
    "ema_pytorch_folder_of_complex128": (
        ["ema-pytorch-complex128", "--legacy-sigma-rels", "0.05", "--legacy-update-every", "10"],
        True,
    ),
    "ema_pytorch_folder_with_profiles": (
        ["ema-pytorch", "--legacy-sigma-rels", "0.05,0.15,0.28", "--legacy-update-every", "10"],
        True,
    ),
    "resumed_from_ema_pytorch": (
        ["resumed", "--legacy-sigma-rels", "0.05,0.28", "--legacy-update-every", "10"],
        True,
    ),
    "sharded": (["sharded"], False),
    "sharded_rank_0_empty": (["sharded-rank-0-empty"], False),
    "sharded_dtypes_by_rank": (["sharded-dtypes"], False),
    "sharded_tensor_stored_nowhere": (["sharded-empty-tensor"], False),
    "sharded_every_tensor_empty": (["sharded-all-empty"], False),
    "folder_without_snapshots": (["nothing"], False),
    "folder_of_damaged_headers": (["damaged-headers"], False),
    # safetensors files
    "snapshot": (["snapshots/step-000000004_sigma_rel-0.28_gamma-0.169344.safetensors"], False),
    "snapshot_before_run_ids": (
        ["runs/step-000000002_sigma_rel-0.05_gamma-16.9722.safetensors"],
        False,
    ),
    "snapshot_side_file_damaged": (
        ["damaged-side-file/step-000000002_sigma_rel-0.05_gamma-16.9722.safetensors"],
        False,
    ),
    "side_file": (["snapshots/frozen-*.safetensors"], False),
    "side_file_damaged": (["damaged-side-file/frozen-*.safetensors"], False),
    "exported_weights": (["files/ema.safetensors"], False),
    "exported_weights_of_12_tensors": (["files/ema-12.safetensors"], False),
    "safetensors_without_metadata": (["files/plain.safetensors"], False),
    "safetensors_damaged_emakit_header": (["files/damaged-header.safetensors"], False),
    # torch files
    "ema_state": (["files/ema-state.pt"], True),
    "lightning_layout_2": (["files/lightning-v2.ckpt"], True),
    "lightning_bare": (["files/lightning-bare.ckpt"], True),
    "nested_ema_state": (["files/nested-one.pt"], True),
    "nested_ema_states": (["files/nested-three.pt"], True),
    "torch_dict": (["files/plain.pt"], True),
    "state_dict_with_prefix": (["files/prefixed-state.pt"], True),
    "torch_legacy_serialization": (["files/old-format.pt"], True),
    "named_like_ema_pytorch": (["files/3.1200.pt"], True),
    "torch_dict_without_tensors": (["files/counters.pt"], True),
    # no checkpoint
    "missing_file": (["files/missing.pt"], False),
    "demo_summary_json": (["files/summary.json"], False),
    "json_list": (["files/list.json"], False),
    "json_after_a_blank_line": (["files/indented.json"], False),
    "json_after_64_spaces": (["files/spaced.json"], False),
    "empty_file": (["files/empty.bin"], False),
    "text_file": (["files/notes.txt"], False),
}


def normalized(text: str, root: Path, torch_sizes: bool) -> str:
    """``text`` with the temporary folder as ``<tmp>`` and, with ``torch_sizes``, every
    size as ``<size>``, runs of spaces cut to two and a table's rule to one dash per
    column (see the module docstring)."""
    text = text.replace(str(root), "<tmp>")
    if torch_sizes:
        lines = SIZE.sub("<size>", text).split("\n")
        lines = [re.sub(r" {2,}", "  ", line) for line in lines]
        text = "\n".join(re.sub(r"-+", "-", x) if set(x) == {"-", " "} else x for x in lines)
    return text


def runner() -> CliRunner:
    """A runner keeping stderr apart from stdout (click >= 8.2 always does; before it,
    ``mix_stderr=False``, which click 8.2 removed, asks for it)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


def inspect_output(root: Path, args: list[str], torch_sizes: bool) -> str:
    """``emakit inspect`` of ``args`` (paths under ``root``, a ``*`` globbed): the command,
    exit code, stdout and stderr, normalized."""
    argv = [str(root / a) if i == 0 else a for i, a in enumerate(args)]
    if "*" in argv[0]:
        (argv[0],) = map(str, root.glob(args[0]))
    result = runner().invoke(inspect_cmd, argv)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # inspect reports every problem in one line, never this way
    text = (
        f"$ emakit inspect {shlex.join(argv)}\nexit code {result.exit_code}\n"
        f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}"
    )
    return normalized(text, root, torch_sizes)


def check(case: str, text: str) -> None:
    """``text`` is ``case``'s expected output (rewritten with ``EMAKIT_REGENERATE=1``)."""
    path = GOLDEN / f"{case}.txt"
    if REGENERATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8", newline="\n")
    assert path.is_file(), f"no expected output {path}: run with EMAKIT_REGENERATE=1, review it"
    assert text == path.read_text(encoding="utf-8")


@pytest.mark.filterwarnings("ignore::emakit.posthoc.math.PostHocWarning")  # skipped files
@pytest.mark.parametrize("case", CASES)
def test_inspect_prints_the_expected_text(root: Path, case: str) -> None:
    args, torch_sizes = CASES[case]
    check(case, inspect_output(root, args, torch_sizes))


def test_every_expected_text_has_its_case() -> None:
    """No expected text is left over from a renamed or removed case."""
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(CASES)


# -- sizes ---------------------------------------------------------------------------------


def write_safetensors_of_size(path: Path, size: int) -> None:
    """A safetensors file of exactly ``size`` bytes: one uint8 tensor filling it after the
    header, its bytes left a hole (zeros) so that a GiB costs no disk."""
    n = size - 8
    while True:  # the header's length depends on the tensor's, which depends on it
        header = json.dumps({"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}})
        header += " " * (-len(header) % 8)
        if 8 + len(header) + n == size:
            break
        n = size - 8 - len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(size)


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (1024**2, "1.0 MiB"),
        (5 * 1024**2 // 2, "2.5 MiB"),
        (1024**3, "1.0 GiB"),
        (3 * 1024**3 // 2, "1.5 GiB"),
    ],
)
def test_a_size_is_shown_in_the_next_unit_from_exactly_1024(
    tmp_path: Path, size: int, shown: str
) -> None:
    """Bytes as a whole number below 1024, then KiB, MiB, GiB with one decimal."""
    path = tmp_path / "weights.safetensors"
    write_safetensors_of_size(path, size)
    assert path.stat().st_size == size
    result = runner().invoke(inspect_cmd, [str(path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"safetensors file {path} ({shown}), format (none)"


def test_a_snapshot_whose_side_file_was_replaced_by_another_runs_is_refused(
    tmp_path: Path,
) -> None:
    """The side file in place is whole (its bytes hash to its own digest) but is another
    run's: the snapshot's recorded digest tells, and inspect says so instead of listing."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    write_snapshots_of(Tagger(), mine, range(2, 3, 2), sigma_rels=(0.05,), share_frozen=True)
    changed = Tagger()
    with torch.no_grad():
        changed.base.weight.add_(1.0)
    write_snapshots_of(changed, other, range(2, 3, 2), sigma_rels=(0.05,), share_frozen=True)
    (side,) = mine.glob("frozen-*.safetensors")
    (theirs,) = other.glob("frozen-*.safetensors")
    shutil.copyfile(theirs, side)
    snapshot = next(p for p in mine.glob("step-*.safetensors"))
    result = runner().invoke(inspect_cmd, [str(snapshot)])
    assert result.exit_code != 0
    assert side.name in result.stderr and "digest" in result.stderr, result.stderr


def test_an_ema_pytorch_state_is_shown_as_an_ema(tmp_path: Path) -> None:
    """``torch.save(ema.state_dict())`` of ema-pytorch's ``EMA``: its counters and the EMA
    apart from the online model, as for emakit's own state."""
    state = {
        "initted": torch.tensor(True),
        "step": torch.tensor(3),
        "ema_model.weight": torch.zeros(2, 2),
        "online_model.weight": torch.ones(2, 2),
    }
    torch.save(state, tmp_path / "ema.pt")
    result = runner().invoke(inspect_cmd, [str(tmp_path / "ema.pt")])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1:5] == [
        "EMA state_dict:",
        "  step: 3",
        "  initted: True",
        "EMA: 1 tensors, 4 floating values, float32",
    ]
