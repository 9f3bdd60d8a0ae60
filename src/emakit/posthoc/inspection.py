"""``emakit inspect``: what a post-hoc snapshot folder or a checkpoint file holds.

Files are read without unpickling anything: safetensors headers with emakit's own reader
(one open file, every field validated), torch files with ``torch.load(weights_only=True)``.
A FIFO, a socket or a device is refused (reading one could wait forever). Every problem is
reported on one line (``Error: ...``), never as a traceback, and never with torch's advice
to load with ``weights_only=False``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import click
import torch

from .._files.reading import file_kind, torch_load
from .._files.safetensors_file import SafetensorsFile
from ..checkpoint import emakit_header
from ..errors import EMAError
from ._cli import (
    LEGACY_HINT,
    fail,
    fmt,
    legacy_options,
    legacy_profiles,
    run_option,
    snapshot_folder,
)
from .framework_files import (
    describe_ema_state,
    ema_state_in,
    framework_folder,
    not_a_checkpoint,
)
from .frozen_files import FROZEN_FORMAT, join_frozen
from .runs import LOCK_NAME, describe_runs, pick_run, runs_in
from .shards import parse_layout
from .snapshots import (
    LEGACY_NAME,
    SNAPSHOT_FORMAT,
    LegacyFile,
    LegacyProfiles,
    SnapshotInfo,
    list_legacy_files,
    list_snapshots,
    read_snapshot_info,
)
from .synthesis import load_legacy_tensors

__all__ = ["inspect_cmd"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _safetensors_summary(path: Path) -> tuple[dict[str, str], list[tuple[str, str, list[int]]]]:
    with SafetensorsFile(path) as f:
        tensors = [(n, f.code(n), list(f.shape(n))) for n in f.keys()]  # noqa: SIM118
        return dict(f.metadata), tensors


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _describe_tensors(
    tensors: list[tuple[str, str, list[int]]], copied: frozenset[str] | None = None
) -> str:
    dtypes = ", ".join(sorted({d for _, d, _ in tensors}))
    if copied is None:
        values = sum(_numel(s) for _, _, s in tensors)
        return f"{len(tensors)} tensors, {values:,} values, dtypes {dtypes}"
    averaged = [t for t in tensors if t[0] not in copied]
    return (
        f"{len(tensors)} tensors ({len(averaged)} averaged, {len(tensors) - len(averaged)} "
        f"copied), {sum(_numel(s) for _, _, s in averaged):,} averaged values, dtypes {dtypes}"
    )


_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16"}
_CODES.update({torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL"})


def _snapshot_summary(info: SnapshotInfo) -> list[tuple[str, str, list[int]]]:
    if info.shards:  # a sharded snapshot: the global shapes from the layout of rank 0's file
        with SafetensorsFile(info.path) as f, join_frozen(f) as g:
            layout = parse_layout(info.path, f.metadata, {n: g.shape(n) for n in g.keys()})  # noqa: SIM118
            codes = {n: g.code(n) for n in g.keys()}  # noqa: SIM118
        code = next(iter(codes.values()), "?")
        return [(n, codes.get(n, code), list(shape)) for n, (shape, _) in layout.items()]
    if not info.is_legacy:  # its frozen tensors (in its side file) included
        with SafetensorsFile(info.path) as f, join_frozen(f) as g:
            return [(n, g.code(n), list(g.shape(n))) for n in g.keys()]  # noqa: SIM118
    return [
        (n, _CODES.get(v.dtype, str(v.dtype).replace("torch.", "")), list(v.shape))
        for n, v in load_legacy_tensors(info.path).items()
    ]


def _list_legacy_files(files: list[LegacyFile], limit: int = 20) -> None:
    steps = sorted({f.step for f in files})
    indices = ", ".join(str(i) for i in sorted({f.profile for f in files}))
    click.echo(
        f"{len(files)} ema-pytorch snapshot file(s) (<profile index>.<step>.pt): profile "
        f"indices {indices}, steps {steps[0]}..{steps[-1]}"
    )
    rows = [["profile index", "step", "file"]]
    rows += [[str(f.profile), str(f.step), f.path.name] for f in files[:limit]]
    click.echo(_table(rows))
    if len(files) > limit:
        click.echo(f"... and {len(files) - limit} more")
    click.echo(f"they do not record their profiles; to synthesize from them, {LEGACY_HINT}")


def _inspect_folder(folder: Path, legacy: LegacyProfiles | None, run: str | None) -> None:
    listed = list_snapshots(folder, legacy=legacy)
    snaps = pick_run(listed, run, folder)
    theirs = list_legacy_files(folder)
    known = {p for s in listed for p in (*(s.shards or (s.path,)), *s.frozen)}
    known |= {f.path for f in theirs}
    others = [p for p in folder.iterdir() if p.is_file() and p not in known and p.name != LOCK_NAME]
    if not snaps and not theirs:
        raise click.ClickException(
            f"{folder} holds no emakit post-hoc snapshots ({len(others)} other file(s))"
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
        _list_legacy_files(theirs)
    elif theirs:
        used = sum(s.is_legacy for s in snaps)
        click.echo(
            f"{used} of them ema-pytorch snapshot files (<profile index>.<step>.pt), read as "
            f"the given profiles with update_every={legacy.update_every}"  # type: ignore[union-attr]
        )
    if others:
        click.echo(f"{len(others)} other file(s) in the folder ignored")


def _snapshot_table(snaps: list[SnapshotInfo]) -> None:
    by_profile: dict[tuple[float, float], list[SnapshotInfo]] = {}
    for s in snaps:
        by_profile.setdefault((s.gamma, s.sigma_rel), []).append(s)
    rows = [["profile", "sigma_rel", "gamma", "snapshots", "steps", "dtype", "size", "source"]]
    for (gamma, sigma_rel), group in sorted(by_profile.items(), key=lambda kv: kv[1][0].profile):
        tensors = _snapshot_summary(group[-1])
        float_dtypes = sorted({d for n, d, _ in tensors if n not in group[-1].copied})
        sources = sorted({s.source for s in group}, reverse=True)
        rows.append(
            [
                str(group[0].profile),
                fmt(sigma_rel),
                fmt(gamma),
                str(len(group)),
                f"{group[0].step}..{group[-1].step}",
                ",".join(float_dtypes),
                _size(sum(s.nbytes for s in group)),
                "+".join(sources),
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
        click.echo(
            f"frozen weights stored once: {len(sides)} side file(s) ({_size(side_bytes)}, "
            f"{names} tensors), used by {users} snapshot(s); not counted in the sizes above"
        )
    ref = next((s for s in reversed(snaps) if not s.is_legacy), snaps[-1])
    click.echo(f"each snapshot: {_describe_tensors(_snapshot_summary(ref), ref.copied)}")


def _inspect_safetensors(path: Path) -> None:
    meta, tensors = _safetensors_summary(path)
    kind = meta.get("format", "(none)")
    size = _size(path.stat().st_size)
    if kind == SNAPSHOT_FORMAT:
        info = read_snapshot_info(path)
        click.echo(f"post-hoc EMA snapshot {path} ({size})")
        click.echo(
            f"profile {info.profile}: sigma_rel={fmt(info.sigma_rel)} gamma={fmt(info.gamma)}"
        )
        click.echo(
            f"step {info.step} (profile ends at t={info.t}), update_every={info.update_every}, "
            f"format_version {info.format_version}, run {info.run or '(none)'}"
        )
        with SafetensorsFile(path) as f, join_frozen(f) as g:
            tensors = [(n, g.code(n), list(g.shape(n))) for n in g.keys()]  # noqa: SIM118
        click.echo(_describe_tensors(tensors, info.copied))
        if info.frozen:
            click.echo(
                f"{len(info.frozen_names)} frozen tensor(s) stored once, in "
                f"{info.frozen[0].name} ({_size(info.frozen[0].stat().st_size)})"
            )
        return
    if kind == FROZEN_FORMAT:
        click.echo(f"frozen weights side file of post-hoc snapshots {path} ({size})")
        click.echo(f"run {meta.get('run')}, digest {meta.get('digest')}")
        click.echo(_describe_tensors(tensors))
        return
    emakit_header(meta, str(path))  # a damaged emakit header is an error, not a listing
    click.echo(f"safetensors file {path} ({size}), format {kind}")
    for key in sorted(k for k in meta if k not in {"format", "copied"}):
        click.echo(f"  {key}: {meta[key]}")
    click.echo(_describe_tensors(tensors))
    for name, code, shape in tensors[:12]:
        click.echo(f"  {name}  {code}  {shape}")
    if len(tensors) > 12:
        click.echo(f"  ... and {len(tensors) - 12} more")


def _inspect_torch(path: Path) -> None:
    refusal = not_a_checkpoint(path)  # summary.json, a text file: say what it is
    if refusal is not None:
        raise refusal
    obj = torch_load(path, "checkpoint file")  # weights_only=True; never advises otherwise
    click.echo(f"torch checkpoint {path} ({_size(path.stat().st_size)})")
    found = ema_state_in(obj)
    if found is not None:  # an EMA state, alone or inside a framework's checkpoint
        click.echo(f"{found[0]}:")
        click.echo("\n".join(describe_ema_state(found[1])))
        return
    m = LEGACY_NAME.match(path.name)
    if m:
        click.echo(
            f"named like an ema-pytorch post-hoc snapshot: profile index {m.group(1)}, step "
            f"{m.group(2)} (values stored in its checkpoint_dtype)"
        )
    if not isinstance(obj, dict):
        click.echo(f"holds a {type(obj).__name__}")
        return
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    for key in ("version", "karras_version", "step", "initted", "gammas", "gamma", "t"):
        v = tensors.get(key)
        if v is not None:
            click.echo(f"  {key}: {v.tolist()}")
    for key, value in getattr(obj, "_metadata", {}).get("", {}).items():  # emakit's extras
        click.echo(f"  {key} (metadata): {value}")
    others = sorted(k for k in obj if k not in tensors)
    floats = [v for v in tensors.values() if v.is_floating_point()]
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()})
    click.echo(
        f"{len(tensors)} tensors, {sum(v.numel() for v in floats):,} floating values, "
        f"dtypes {', '.join(dtypes) or '-'}" + (f"; other entries: {others[:10]}" if others else "")
    )


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@legacy_options
@run_option
def inspect_cmd(
    path: Path,
    legacy_sigma_rels: str | None,
    legacy_gammas: str | None,
    legacy_update_every: int | None,
    run: str | None,
) -> None:
    """Show what a post-hoc snapshot FOLDER or a checkpoint FILE holds.

    For a folder: each profile with its sigma_rel and gamma, the snapshot steps, dtype and
    size, and ema-pytorch's <index>.<step>.pt files (listed, or with --legacy-sigma-rels
    read as those profiles); a folder holding several runs needs --run. For a file: its
    header (.safetensors) or its EMA state (.pt, read with weights_only=True), also the
    EMA inside a Lightning .ckpt. A Transformers checkpoint-N folder or an Accelerate
    save_state folder: the EMA it holds. Anything but a folder or a regular file (a FIFO,
    a device) is refused.
    """
    try:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise click.ClickException(f"{path} does not exist") from None
        if stat.S_ISDIR(mode) and framework_folder(path) is not None:
            _inspect_framework_folder(path)
        elif stat.S_ISDIR(mode):
            path = snapshot_folder(path)
            legacy, _ = legacy_profiles(path, legacy_sigma_rels, legacy_gammas, legacy_update_every)
            _inspect_folder(path, legacy, run)
        elif not stat.S_ISREG(mode):
            raise click.ClickException(
                f"{path} is {file_kind(mode)}, not a checkpoint file or a snapshot folder; "
                f"emakit inspect reads only regular files and folders"
            )
        elif path.suffix == ".safetensors":
            _inspect_safetensors(path)
        else:
            _inspect_torch(path)
    except BrokenPipeError:
        raise  # `emakit inspect DIR | head`: click exits quietly, as Unix tools do
    except (EMAError, OSError) as e:
        raise fail(e) from e


def _inspect_framework_folder(folder: Path) -> None:
    what, files = framework_folder(folder)  # type: ignore[misc]
    click.echo(f"{what} {folder}")
    for path in files:
        click.echo("")
        if path.suffix == ".safetensors":
            _inspect_safetensors(path)
        else:
            _inspect_torch(path)
