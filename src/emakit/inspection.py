"""``emakit inspect``: what a post-hoc snapshot folder, a checkpoint file or a framework's
checkpoint folder holds, read without unpickling anything.

Safetensors headers are read with emakit's own reader (every field validated), torch files
with ``torch.load(weights_only=True)``; an EMA state is found alone, inside a Lightning
``.ckpt`` (``EMACallback``'s entry) or in a training checkpoint's dicts (by the keys
`emakit.foreign` tells formats by), in an Accelerate ``save_state`` folder and in a
Transformers ``checkpoint-N`` folder. A FIFO, a socket or a device is refused. Every
problem is one line (``Error: ...``), never a traceback.

Example:
    .. code-block:: console

        $ emakit inspect ./post-hoc-ema-checkpoints
        $ emakit inspect checkpoint.pt
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import torch

from ._files.reading import open_regular, torch_load
from ._files.safetensors_file import ST_DTYPES, SafetensorsFile
from .checkpoint import emakit_header
from .errors import EMAError
from .foreign import detect_format, nested_states
from .integrations._common import LIGHTNING_CHECKPOINT_KEY, TRAINER_WEIGHTS_NAME
from .posthoc.command_line import fail, folder_options, open_folder
from .posthoc.snapshots.folder import (
    LOCK_NAME,
    describe_runs,
    list_legacy_files,
    list_snapshots,
    pick_run,
    runs_in,
    skipped_files,
)
from .posthoc.snapshots.format import (
    SNAPSHOT_FORMAT,
    SnapshotInfo,
    read_snapshot_info,
    snapshot_sources,
)
from .posthoc.snapshots.frozen import FROZEN_FORMAT, check_side_file, join_frozen
from .posthoc.snapshots.legacy import LEGACY_NAME, LegacyProfiles

__all__ = ["inspect_cmd"]


#: The files ``accelerator.save_state`` writes for registered objects (``prepare_ema``).
ACCELERATE_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")
#: What ``emakit inspect`` reads, for messages about what it does not.
READS = (
    "emakit inspect reads post-hoc snapshot folders, .safetensors files, torch checkpoints "
    "(.pt, .bin, a Lightning .ckpt), Accelerate save_state folders and Transformers "
    "checkpoint-N folders"
)
#: What ``inspect`` calls the safetensors files of post-hoc EMA, by their header's format.
TITLES = {
    SNAPSHOT_FORMAT: "post-hoc EMA snapshot",
    FROZEN_FORMAT: "frozen weights side file of post-hoc snapshots",
}
#: The counters of an EMA state that ``inspect`` shows.
COUNTERS = ("version", "karras_version", "step", "initted", "gammas", "gamma", "t")

#: A tensor as inspect lists it: name, dtype (safetensors' code, or torch's name), shape,
#: and whether it is floating.
Row = tuple[str, str, list[int], bool]


def _row(name: str, dtype: torch.dtype, shape: Sequence[int], code: bool = True) -> Row:
    text = ST_DTYPES.get(dtype, str(dtype)) if code else str(dtype).replace("torch.", "")
    return name, text, list(shape), dtype.is_floating_point


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _describe(
    rows: list[Row], copied: frozenset[str] | None = None, label: str = "", limit: int = 0
) -> None:
    """One line of the tensors' count, values and dtypes (the averaged values, given the
    names ``copied``), then the first ``limit`` tensors."""
    dtypes = ", ".join(sorted({r[1] for r in rows})) or "-"
    if copied is None:
        values = sum(math.prod(shape) for _, _, shape, floating in rows if floating)
        what = f"{len(rows)} tensors, {values:,} floating values"
    else:
        averaged = [math.prod(shape) for name, _, shape, _ in rows if name not in copied]
        what = (
            f"{len(rows)} tensors ({len(averaged)} averaged, {len(rows) - len(averaged)} "
            f"copied), {sum(averaged):,} averaged values"
        )
    click.echo(f"{label}{what}, {dtypes}")
    for name, text, shape, _ in rows[:limit]:
        click.echo(f"  {name}  {text}  {shape}")
    if len(rows) > limit > 0:
        click.echo(f"  ... and {len(rows) - limit} more")


def _snapshot_rows(info: SnapshotInfo) -> list[Row]:
    """A snapshot's tensors (its frozen ones too) with their global shapes (rank 0's layout
    has every tensor) and dtypes, each from a file that stores a block of it: rank 0's
    first, the other ranks' only for what rank 0 stores none of. A tensor no file stores
    (every block empty) shows rank 0's first dtype, or float32."""
    layout: Mapping[str, Any] = {}
    dtypes: dict[str, torch.dtype] = {}
    for f, rank_layout in snapshot_sources(info):
        layout = layout or rank_layout
        for n in f.keys():  # noqa: SIM118 - a reader is not a dict
            dtypes.setdefault(n, f.dtype(n))
        if set(layout) <= set(dtypes):
            break
    some = next(iter(dtypes.values()), torch.float32)
    return [_row(n, dtypes.get(n, some), shape) for n, (shape, _) in layout.items()]


def _inspect_folder(folder: Path, legacy: LegacyProfiles | None, run: str | None) -> None:
    listed = list_snapshots(folder, legacy=legacy)
    snaps = pick_run(listed, run, folder)
    theirs = list_legacy_files(folder)
    known = {p for s in listed for p in (*s.files, *s.frozen)} | {f.path for f in theirs}
    others = [p for p in folder.iterdir() if p.is_file() and p not in known and p.name != LOCK_NAME]
    if not snaps and not theirs:
        skipped = skipped_files(folder)
        raise click.ClickException(
            f"{folder} holds no emakit post-hoc snapshots ({len(others)} other file(s))"
            + (f"; {len(skipped)} file(s) skipped: {'; '.join(skipped[:3])}" if skipped else "")
        )
    click.echo(f"post-hoc EMA snapshot folder {folder}")
    runs = runs_in(listed)
    if run is not None or any(runs):
        shown = run if run is not None else next(iter(runs), "")
        more = f" (of {len(runs)} runs: {describe_runs(runs)})" if len(runs) > 1 else ""
        click.echo(f"run {shown or '(none)'}{more}")
    if snaps:
        _snapshot_table(snaps)
    if theirs and legacy is None:
        steps = sorted({f.step for f in theirs})
        indices = ", ".join(str(i) for i in sorted({f.profile for f in theirs}))
        click.echo(
            f"{len(theirs)} ema-pytorch snapshot file(s) (<profile index>.<step>.pt): profile "
            f"indices {indices}, steps {steps[0]}..{steps[-1]}"
        )
        rows = [["profile index", "step", "file"]]
        click.echo(_table(rows + [[str(f.profile), str(f.step), f.path.name] for f in theirs[:20]]))
        if len(theirs) > 20:
            click.echo(f"... and {len(theirs) - 20} more")
        click.echo(
            "they do not record their profiles; to synthesize from them, pass "
            "--legacy-sigma-rels S,S (the sigma_rels of the ema-pytorch PostHocEMA that wrote "
            "them, in its order: <i>.<step>.pt is of the i-th) or --legacy-gammas G,G, with "
            "--legacy-update-every N"
        )
    elif theirs:
        click.echo(
            f"{sum(s.is_legacy for s in snaps)} of them ema-pytorch snapshot files (<profile "
            f"index>.<step>.pt), read as the given profiles with update_every="
            f"{legacy.update_every}"  # type: ignore[union-attr]
        )
    if others:
        click.echo(f"{len(others)} other file(s) in the folder ignored")


def _snapshot_table(snaps: list[SnapshotInfo]) -> None:
    by_profile: dict[tuple[float, float], list[SnapshotInfo]] = {}
    for s in snaps:
        by_profile.setdefault((s.gamma, s.sigma_rel), []).append(s)
    rows = [["profile", "sigma_rel", "gamma", "snapshots", "steps", "dtype", "size", "source"]]
    for (gamma, sigma_rel), group in sorted(by_profile.items(), key=lambda kv: kv[1][0].profile):
        last = group[-1]
        dtypes = {d for n, d, _, _ in _snapshot_rows(last) if n not in last.copied}
        rows.append(
            [
                str(group[0].profile),
                f"{sigma_rel:.6g}",
                f"{gamma:.6g}",
                str(len(group)),
                f"{group[0].step}..{last.step}",
                ",".join(sorted(dtypes)),
                _size(sum(s.nbytes for s in group)),
                "+".join(sorted({s.source for s in group}, reverse=True)),
            ]
        )
    steps = sorted({s.step for s in snaps})
    sides = sorted({p for s in snaps for p in s.frozen})
    side_bytes = sum(p.stat().st_size for p in sides)
    click.echo(_table(rows))
    click.echo(
        f"{len(snaps)} snapshots at {len(steps)} steps ({steps[0]}..{steps[-1]}), "
        f"{_size(sum(s.nbytes for s in snaps) + side_bytes)} in all"
    )
    if sides:
        users = sum(bool(s.frozen) for s in snaps)
        names = len(frozenset().union(*(s.frozen_names for s in snaps)))
        for side in sides:  # read whole: a damaged side file is named here, not at synthesis
            check_side_file(side, [p for s in snaps if side in s.frozen for p in s.files])
        click.echo(
            f"frozen weights stored once: {len(sides)} side file(s) ({_size(side_bytes)}, "
            f"{names} tensors, SHA-256 checked), used by {users} snapshot(s); not counted in "
            f"the sizes above"
        )
    ref = next((s for s in reversed(snaps) if not s.is_legacy), snaps[-1])
    _describe(_snapshot_rows(ref), ref.copied, label="each snapshot: ")


def _inspect_safetensors(path: Path) -> None:
    with SafetensorsFile(path) as f, join_frozen(f) as g:  # a snapshot's frozen tensors too
        meta, rows = dict(f.metadata), [_row(n, g.dtype(n), g.shape(n)) for n in g.keys()]  # noqa: SIM118
    kind = meta.get("format", "(none)")
    side = path.parent / meta.get("frozen_file", "") if "frozen_file" in meta else None
    if kind == FROZEN_FORMAT or side is not None:  # its bytes against its digest
        check_side_file(side or path, [path] if side else [], meta.get("frozen_digest"))
    # every field of a snapshot's header checked; a damaged emakit header is an error
    info = read_snapshot_info(path) if kind == SNAPSHOT_FORMAT else emakit_header(meta, str(path))
    what = TITLES.get(kind, "safetensors file")
    click.echo(f"{what} {path} ({_size(path.stat().st_size)}), format {kind}")
    if not isinstance(info, SnapshotInfo):
        for key in sorted(meta.keys() - {"format"}):
            click.echo(f"  {key}: {meta[key]}")
        _describe(rows, limit=12)
        return
    click.echo(
        f"profile {info.profile}: sigma_rel={info.sigma_rel:.6g} gamma={info.gamma:.6g}, "
        f"step {info.step} (profile ends at t={info.t}), update_every={info.update_every}, "
        f"format_version {info.format_version}, run {info.run or '(none)'}"
    )
    _describe(rows, info.copied)
    if info.frozen:
        click.echo(
            f"{len(info.frozen_names)} frozen tensor(s) stored once, in "
            f"{info.frozen[0].name} ({_size(info.frozen[0].stat().st_size)})"
        )


def _ema_state_in(obj: Any) -> tuple[str | None, Any]:
    """``(what holds it, the EMA's state dict)`` in a loaded torch object, or ``(None,
    obj)`` for anything else.

    A Lightning checkpoint holds ``EMACallback``'s entry under ``"emakit_ema"`` (layout
    version 1: ``{"version": 1, "ema": state}``; version 2 keeps an FSDP2 EMA's shards in
    the checkpoint's distributed ``state_dict``); an Accelerate custom checkpoint or a
    ``torch.save(ema.state_dict())`` is the state itself.
    """
    if not isinstance(obj, Mapping):
        return None, obj
    entry = obj.get(LIGHTNING_CHECKPOINT_KEY)
    if isinstance(entry, Mapping) and isinstance(entry.get("ema"), Mapping):
        where = (
            f"Lightning checkpoint, EMACallback layout version {entry.get('version', 1)} "
            f"(global_step {obj.get('global_step', '?')}, epoch {obj.get('epoch', '?')})"
        )
        if "shards_in_state_dict" in entry:
            where += "; the EMA's shards are in the checkpoint's distributed state_dict"
        return where, entry["ema"]
    if _is_ema_state(obj):
        return "EMA state_dict", obj
    found = nested_states(obj, _is_ema_state)  # in a training checkpoint's dicts
    if found:
        where = f"EMA state_dict at {found[0][0]} of a checkpoint dict"
        if len(found) > 1:
            where += f" (more at {', '.join(p for p, _ in found[1:])})"
        own = [f"{k} {_counter(obj[k])}" for k in CHECKPOINT_COUNTERS if _counter(obj.get(k))]
        if own:  # the training loop's count, to compare with the EMA's (docs/resume.md)
            where += f"; the checkpoint's own {', '.join(own)}"
        return where, found[0][1]
    return None, obj


#: The counters a training checkpoint keeps beside its EMA state, shown by ``inspect``.
CHECKPOINT_COUNTERS = ("step", "global_step", "epoch", "updates", "num_updates")


def _counter(value: Any) -> str:
    """A whole number (an int, or a one-element integer tensor) as text; '' otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else ""


def _is_ema_state(obj: Any) -> bool:
    """An emakit or ema-pytorch EMA state (``step``, ``initted``, ``ema_model.*``), told
    as `emakit.foreign` tells every format."""
    return detect_format(obj) in ("emakit", "ema_pytorch")


def _not_a_checkpoint(path: Path) -> None:
    """Refuse, saying what it is, a file whose first bytes show it is neither a torch file
    (a zip archive, or a pickle) nor anything else ``inspect`` reads; refuse a FIFO, a
    socket or a device without waiting on it."""
    with open_regular(path, "checkpoint file") as f:
        head = f.read(64)
    if head.startswith((b"PK\x03\x04", b"\x80")):
        return
    if head.lstrip()[:1] in (b"{", b"["):
        what = "a JSON file"
        if path.name == "summary.json":
            what += (
                " (the demo's summary.json: its metrics and settings; the demo's "
                "snapshots are in the posthoc-snapshots/ folder beside it)"
            )
    elif not head:
        what = "an empty file"
    else:
        what = f"not a torch file (it starts with {head[:8]!r})"
    raise click.ClickException(f"{path} is {what}, not a checkpoint; {READS}")


def _inspect_torch(path: Path) -> None:
    """A torch file: an EMA state (alone, or inside a framework's checkpoint) with its
    counters, emakit's metadata and its tensors; any other dict's counters and sizes."""
    _not_a_checkpoint(path)  # summary.json, a text file: say what it is
    obj = torch_load(path, "checkpoint file")  # weights_only=True; never advises otherwise
    click.echo(f"torch checkpoint {path} ({_size(path.stat().st_size)})")
    where, state = _ema_state_in(obj)
    if where is not None:
        click.echo(f"{where}:")
    elif m := LEGACY_NAME.match(path.name):
        click.echo(
            f"named like an ema-pytorch post-hoc snapshot: profile index {m.group(1)}, step "
            f"{m.group(2)} (values stored in its checkpoint_dtype)"
        )
    if not isinstance(state, Mapping):
        click.echo(f"holds a {type(state).__name__}")
        return
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    shown = [(k, tensors[k].tolist()) for k in COUNTERS if k in tensors]
    metadata = (getattr(state, "_metadata", None) or {}).get("", {})
    # emakit writes its layout version (2 and up) there; torch's own 1 is no emakit version
    shown += sorted((k, v) for k, v in metadata.items() if (k, v) != ("version", 1))
    for key, value in shown:  # the counters, then emakit's extras (layout, run, skips...)
        click.echo(f"  {key}: {value}")
    if where is None:
        _describe([_row(k, v.dtype, v.shape, code=False) for k, v in tensors.items()])
        if others := sorted(str(k) for k in state if str(k) not in tensors):
            click.echo(f"other entries: {others[:10]}")
        return
    for prefix, label, limit in (
        ("ema_model.", "EMA: ", 12),
        ("online_model.", "online model: ", 0),
    ):
        group = [
            _row(k[len(prefix) :], v.dtype, v.shape, False)
            for k, v in tensors.items()
            if k.startswith(prefix)
        ]
        if group:
            _describe(group, label=label, limit=limit)


def _framework_files(folder: Path) -> tuple[str, list[Path]] | None:
    """``(what the folder is, the files holding an EMA)`` for a Transformers
    ``checkpoint-N`` folder (its ``ema.safetensors``) or an Accelerate ``save_state``
    folder (its ``custom_checkpoint_<i>.pkl`` files), else None."""
    if (folder / TRAINER_WEIGHTS_NAME).is_file():
        return "Transformers Trainer checkpoint folder", [folder / TRAINER_WEIGHTS_NAME]
    found = [(ACCELERATE_FILE.fullmatch(p.name), p) for p in folder.iterdir() if p.is_file()]
    custom = sorted((int(m.group(1)), p) for m, p in found if m)
    return ("Accelerate save_state folder", [p for _, p in custom]) if custom else None


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@folder_options
def inspect_cmd(path: Path, run: str | None, **legacy: Any) -> None:
    """Show what a post-hoc snapshot FOLDER or a checkpoint FILE holds.

    For a folder: each profile with its sigma_rel and gamma, the snapshot steps, dtype and
    size, and ema-pytorch's <index>.<step>.pt files (listed, or with --legacy-sigma-rels
    read as those profiles); a folder holding several runs needs --run. Side files of
    frozen weights are read whole, their SHA-256 checked. For a file: its
    header (.safetensors) or its EMA state (.pt, read with weights_only=True), also the
    EMA inside a Lightning .ckpt. A Transformers checkpoint-N folder or an Accelerate
    save_state folder: the EMA it holds. Anything but a folder or a regular file (a FIFO,
    a device) is refused. An EMA state inside a training checkpoint's dict (``{"model":
    ..., "ema": ema.state_dict()}``) is found and named by its key path.
    """
    try:
        framework = _framework_files(path) if path.is_dir() else None
        if framework is not None:
            click.echo(f"{framework[0]} {path}")
            for file in framework[1]:
                click.echo("")
                (_inspect_safetensors if file.suffix == ".safetensors" else _inspect_torch)(file)
        elif path.is_dir():
            _inspect_folder(*open_folder(path, **legacy), run)
        elif path.suffix == ".safetensors":
            _inspect_safetensors(path)
        else:
            _inspect_torch(path)
    except BrokenPipeError:
        raise  # `emakit inspect DIR | head`: click exits quietly, as Unix tools do
    except (EMAError, OSError) as e:
        raise fail(e) from e
