"""Command-line front end of post-hoc EMA: ``emakit synthesize`` and ``emakit inspect``.

Two click commands, :data:`synthesize` and :data:`inspect_cmd` (named ``inspect``), meant
to be added to the ``emakit`` group::

    emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
    emakit inspect ./post-hoc-ema-checkpoints

ema-pytorch's snapshot files (``<profile index>.<step>.pt``, no profile recorded) need
``--legacy-sigma-rels`` (or ``--legacy-gammas``) and ``--legacy-update-every``; without
them ``inspect`` lists the files and ``synthesize`` refuses them.

``synthesize`` writes one safetensors file per requested length; the file holds the model's
state dict (parameter and buffer names as in ``model.state_dict()``), so it loads straight
into the model class::

    model.load_state_dict(safetensors.torch.load_file("ema.sigma_rel-0.05.safetensors"))
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import torch

from .._io import atomic_path
from ..errors import EMAError
from .math import SIGMA_REL_MAX
from .snapshots import (
    LEGACY_NAME,
    SNAPSHOT_FORMAT,
    LegacyFile,
    LegacyProfiles,
    SnapshotInfo,
    list_legacy_files,
    list_snapshots,
)
from .synthesis import SynthesisPlan, load_legacy_tensors, plan_synthesis

__all__ = ["SYNTHESIZED_FORMAT", "inspect_cmd", "synthesize"]

#: ``format`` value in the header of files ``emakit synthesize`` writes.
SYNTHESIZED_FORMAT = "emakit.posthoc.synthesized"
SYNTHESIZED_FORMAT_VERSION = 1

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _floats(option: str, text: str | None) -> list[float]:
    if text is None:
        return []
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(float(part))
        except ValueError:
            raise click.BadParameter(
                f"expected comma-separated numbers such as 0.05,0.1, got {text!r}",
                param_hint=option,
            ) from None
    if not values:
        raise click.BadParameter(f"no value given in {text!r}", param_hint=option)
    return values


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _output_paths(out: Path, key: str, values: Sequence[float]) -> list[Path]:
    if len(values) == 1:
        return [out]
    suffix = out.suffix or ".safetensors"
    paths = [out.with_name(f"{out.stem}.{key}-{_fmt(v)}{suffix}") for v in values]
    if len(set(paths)) != len(paths):
        raise click.BadParameter(f"the values {list(values)} repeat", param_hint=f"--{key}")
    return paths


@contextmanager
def _progress_bar(enabled: bool) -> Iterator[Callable[[str, int], Callable[[int, int], None]]]:
    """Yield ``start(label, total) -> advance(done, total)``; rich if installed, else click."""
    if not enabled:
        yield lambda label, total: lambda done, total_: None
        return
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:  # rich is an optional extra: fall back to click's bar
        with ExitStack() as stack:

            def start_click(label: str, total: int) -> Callable[[int, int], None]:
                stream = click.get_text_stream("stderr")  # type: ignore[operator]
                bar: Any = stack.enter_context(
                    click.progressbar(length=total, label=label, file=stream)
                )

                def advance(done: int, total_: int) -> None:
                    bar.update(done - bar.pos)

                return advance

            yield start_click
        return
    from rich.console import Console

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("snapshots"),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout stays for the results
        transient=False,
    )
    with progress:

        def start_rich(label: str, total: int) -> Callable[[int, int], None]:
            task = progress.add_task(label, total=total)
            return lambda done, total_: progress.update(task, completed=done)

        yield start_rich


# -- ema-pytorch's snapshot files ----------------------------------------------------------

#: Buffers of torch's norm layers: without an emakit snapshot to say which tensors are
#: buffers, these are taken (not averaged) from ema-pytorch's files.
_NORM_BUFFERS = {"running_mean": None, "running_var": None, "num_batches_tracked": torch.int64}
_LEGACY_HINT = (
    "pass --legacy-sigma-rels S,S (the sigma_rels of the ema-pytorch PostHocEMA that wrote "
    "them, in its order: <i>.<step>.pt is of the i-th) or --legacy-gammas G,G, with "
    "--legacy-update-every N"
)


_LEGACY_OPTIONS = [
    click.option(
        "--legacy-sigma-rels",
        metavar="S[,S...]",
        help="Profiles of ema-pytorch's <index>.<step>.pt snapshot files in FOLDER: the "
        "sigma_rels of its PostHocEMA, in order. Needed to synthesize from them.",
    ),
    click.option("--legacy-gammas", metavar="G[,G...]", help="The same as gammas, in order."),
    click.option(
        "--legacy-update-every",
        type=click.IntRange(min=1),
        default=None,
        help="The update_every of that ema-pytorch run (its default: 100); required with "
        "--legacy-sigma-rels / --legacy-gammas.",
    ),
]


def legacy_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--legacy-sigma-rels``, ``--legacy-gammas``, ``--legacy-update-every``."""
    for option in reversed(_LEGACY_OPTIONS):
        command = option(command)
    return command


def _legacy_profiles(
    folder: Path, sigma_rels: str | None, gammas: str | None, update_every: int | None
) -> tuple[LegacyProfiles | None, str | None]:
    """The profiles to read ema-pytorch's files with (None without the options), and a
    note to print when it had to guess which tensors are buffers."""
    if sigma_rels is not None and gammas is not None:
        raise click.UsageError("give at most one of --legacy-sigma-rels and --legacy-gammas")
    if sigma_rels is None and gammas is None:
        return None, None
    if update_every is None:
        raise click.UsageError(
            "--legacy-sigma-rels / --legacy-gammas need --legacy-update-every N too: the "
            "update_every of the ema-pytorch run (its default: 100); it sets where each "
            "file's averaging ends"
        )
    legacy = (
        LegacyProfiles.from_sigma_rels(
            _floats("--legacy-sigma-rels", sigma_rels), update_every=update_every
        )
        if sigma_rels is not None
        else LegacyProfiles(tuple(_floats("--legacy-gammas", gammas)), update_every=update_every)
    )
    files = list_legacy_files(folder) if folder.is_dir() else []
    if not files or list_snapshots(folder):
        return legacy, None  # nothing to read, or emakit's snapshots say which are buffers
    names = sorted(load_legacy_tensors(files[-1].path))
    leaf = {n: n.rsplit(".", 1)[-1] for n in names}
    copied = frozenset(n for n in names if leaf[n] in _NORM_BUFFERS)
    exact = tuple((n, d) for n in sorted(copied) if (d := _NORM_BUFFERS[leaf[n]]) is not None)
    note = (
        f"Note: ema-pytorch's files do not say which tensors are buffers; taking "
        f"{len(copied)} norm-layer buffer(s) from the latest snapshot "
        f"({', '.join(sorted(copied)[:4]) or 'none'}{', ...' if len(copied) > 4 else ''}) "
        f"and averaging the other {len(names) - len(copied)} tensors"
    )
    return LegacyProfiles(
        legacy.gammas,
        sigma_rels=legacy.sigma_rels,
        update_every=update_every,
        copied=copied,
        exact_dtypes=exact,
    ), note


def _refuse_legacy(folder: Path, files: list[LegacyFile]) -> None:
    if files:
        shown = ", ".join(f.path.name for f in files[:4]) + (", ..." if len(files) > 4 else "")
        raise click.ClickException(
            f"{folder} holds {len(files)} ema-pytorch snapshot file(s) ({shown}), which do not "
            f"record their profiles; emakit will not ignore them: {_LEGACY_HINT}, or move them "
            f"out of the folder"
        )


def _write_output(path: Path, state: dict[str, torch.Tensor], plan: SynthesisPlan) -> None:
    from safetensors.torch import save_file

    from .._version import __version__

    metadata = {
        "format": SYNTHESIZED_FORMAT,
        "format_version": str(SYNTHESIZED_FORMAT_VERSION),
        "emakit_version": __version__,
        "sigma_rel": repr(plan.sigma_rel),
        "gamma": repr(plan.gamma),
        "step": str(plan.step),
        "num_snapshots": str(len(plan.snapshots)),
        "profile_error": repr(plan.solution.residual),
        "buffers_from": plan.buffers_from.path.name,
    }
    with atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata=metadata)


@click.command("synthesize")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--sigma-rel",
    "sigma_rel",
    metavar="S[,S...]",
    help=f"Relative EMA length(s) to reconstruct, comma-separated, each in (0, {SIGMA_REL_MAX:.4f}); "
    "e.g. 0.05,0.1,0.15.",
)
@click.option(
    "--gamma",
    "gamma",
    metavar="G[,G...]",
    help="Power-function exponent(s) to reconstruct instead of --sigma-rel, comma-separated.",
)
@click.option(
    "--step",
    type=click.IntRange(min=1),
    default=None,
    help="Training step to reconstruct at; only snapshots at or before it are used. "
    "Default: the latest snapshot's step.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output .safetensors file. With several values, one file each: "
    "OUT_STEM.sigma_rel-S.safetensors.",
)
@click.option(
    "--dtype",
    type=click.Choice(sorted(_DTYPES)),
    default="float32",
    show_default=True,
    help="dtype of the averaged tensors written (buffers keep theirs).",
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@legacy_options
def synthesize(
    folder: Path,
    sigma_rel: str | None,
    gamma: str | None,
    step: int | None,
    out: Path,
    dtype: str,
    progress: bool,
    legacy_sigma_rels: str | None,
    legacy_gammas: str | None,
    legacy_update_every: int | None,
) -> None:
    """Reconstruct EMA weights of any length from a post-hoc snapshot FOLDER.

    Uses the least-squares synthesis of Karras et al. 2024 (arXiv:2312.02696), streaming
    one snapshot at a time. The output holds the model's state dict and loads straight
    into the model class.

    ema-pytorch's snapshot files (<index>.<step>.pt) in FOLDER are used with emakit's when
    --legacy-sigma-rels (or --legacy-gammas) gives their profiles; without it they are
    refused.

    \b
    Example:
        emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
        emakit synthesize ./ema-pytorch-checkpoints --legacy-sigma-rels 0.05,0.28
            --legacy-update-every 1 --sigma-rel 0.1 --out ema.safetensors
    """
    if (sigma_rel is None) == (gamma is None):
        raise click.UsageError("give exactly one of --sigma-rel and --gamma")
    key, values = (
        ("sigma_rel", _floats("--sigma-rel", sigma_rel))
        if sigma_rel is not None
        else ("gamma", _floats("--gamma", gamma))
    )
    paths = _output_paths(out, key, values)
    try:
        legacy, note = _legacy_profiles(
            folder, legacy_sigma_rels, legacy_gammas, legacy_update_every
        )
        if legacy is None and folder.is_dir():
            _refuse_legacy(folder, list_legacy_files(folder))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plans = [
                plan_synthesis(folder, step=step, legacy=legacy, **{key: v})  # type: ignore[arg-type]
                for v in values
            ]
        if note and any(s.is_legacy for p in plans for s in p.snapshots):
            click.echo(note, err=True)
        for w in caught:
            click.echo(f"Warning: {w.message}", err=True)
        with _progress_bar(progress) as start:
            for plan, path in zip(plans, paths, strict=True):
                label = f"sigma_rel={_fmt(plan.sigma_rel)} step={plan.step}"
                state = plan.run(dtype=_DTYPES[dtype], progress=start(label, len(plan.snapshots)))
                _write_output(path, state, plan)
                del state
    except EMAError as e:
        raise click.ClickException(str(e)) from e
    for plan, path in zip(plans, paths, strict=True):
        theirs = sum(s.is_legacy for s in plan.snapshots)
        click.echo(
            f"wrote {path}  (sigma_rel={_fmt(plan.sigma_rel)}, gamma={_fmt(plan.gamma)}, "
            f"step={plan.step}, {len(plan.snapshots)} snapshots"
            + (f" ({theirs} from ema-pytorch)" if theirs else "")
            + f", profile error {plan.solution.residual:.2g})"
        )


# -- inspect --------------------------------------------------------------------------------


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
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = dict(f.metadata() or {})
        tensors = []
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            s = f.get_slice(name)
            tensors.append((name, s.get_dtype(), list(s.get_shape())))
    return meta, tensors


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
    if not info.is_legacy:
        return _safetensors_summary(info.path)[1]
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
    click.echo(f"they do not record their profiles; to synthesize from them, {_LEGACY_HINT}")


def _inspect_folder(folder: Path, legacy: LegacyProfiles | None) -> None:
    snaps = list_snapshots(folder, legacy=legacy)
    theirs = list_legacy_files(folder)
    known = {s.path for s in snaps} | {f.path for f in theirs}
    others = [p for p in folder.iterdir() if p.is_file() and p not in known]
    if not snaps and not theirs:
        raise click.ClickException(
            f"{folder} holds no emakit post-hoc snapshots ({len(others)} other file(s))"
        )
    click.echo(f"post-hoc EMA snapshot folder {folder}")
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
                _fmt(sigma_rel),
                _fmt(gamma),
                str(len(group)),
                f"{group[0].step}..{group[-1].step}",
                ",".join(float_dtypes),
                _size(sum(s.nbytes for s in group)),
                "+".join(sources),
            ]
        )
    steps = sorted({s.step for s in snaps})
    click.echo(_table(rows))
    click.echo(
        f"{len(snaps)} snapshots at {len(steps)} steps ({steps[0]}..{steps[-1]}), "
        f"{_size(sum(s.nbytes for s in snaps))} in all"
    )
    ref = next((s for s in reversed(snaps) if not s.is_legacy), snaps[-1])
    click.echo(f"each snapshot: {_describe_tensors(_snapshot_summary(ref), ref.copied)}")


def _inspect_safetensors(path: Path) -> None:
    try:
        meta, tensors = _safetensors_summary(path)
    except Exception as e:
        raise click.ClickException(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e
    fmt = meta.get("format", "(none)")
    size = _size(path.stat().st_size)
    if fmt == SNAPSHOT_FORMAT:
        from .snapshots import read_snapshot_info

        info = read_snapshot_info(path)
        click.echo(f"post-hoc EMA snapshot {path} ({size})")
        click.echo(
            f"profile {info.profile}: sigma_rel={_fmt(info.sigma_rel)} gamma={_fmt(info.gamma)}"
        )
        click.echo(
            f"step {info.step} (profile ends at t={info.t}), update_every={info.update_every}, "
            f"format_version {info.format_version}"
        )
        click.echo(_describe_tensors(tensors, info.copied))
        return
    click.echo(f"safetensors file {path} ({size}), format {fmt}")
    for key in sorted(k for k in meta if k not in {"format", "copied"}):
        click.echo(f"  {key}: {meta[key]}")
    click.echo(_describe_tensors(tensors))


def _inspect_torch(path: Path) -> None:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise click.ClickException(
            f"{path} could not be read as a torch checkpoint ({type(e).__name__}: {e})"
        ) from e
    click.echo(f"torch checkpoint {path} ({_size(path.stat().st_size)})")
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
def inspect_cmd(
    path: Path,
    legacy_sigma_rels: str | None,
    legacy_gammas: str | None,
    legacy_update_every: int | None,
) -> None:
    """Show what a post-hoc snapshot FOLDER or a checkpoint FILE holds.

    For a folder: each profile with its sigma_rel and gamma, the snapshot steps, dtype and
    size, and ema-pytorch's <index>.<step>.pt files (listed, or with --legacy-sigma-rels
    read as those profiles). For a file: its header (.safetensors) or its EMA state (.pt).
    """
    try:
        if not os.path.exists(path):
            raise click.ClickException(f"{path} does not exist")
        if path.is_dir():
            legacy, _ = _legacy_profiles(
                path, legacy_sigma_rels, legacy_gammas, legacy_update_every
            )
            _inspect_folder(path, legacy)
        elif path.suffix == ".safetensors":
            _inspect_safetensors(path)
        else:
            _inspect_torch(path)
    except EMAError as e:
        raise click.ClickException(str(e)) from e
