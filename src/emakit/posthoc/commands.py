"""Command-line front end of post-hoc EMA: ``emakit synthesize`` and ``emakit inspect``.

Two click commands, :data:`synthesize` and :data:`inspect_cmd` (named ``inspect``), meant
to be added to the ``emakit`` group::

    emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
    emakit inspect ./post-hoc-ema-checkpoints

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
    SNAPSHOT_FORMAT,
    SnapshotInfo,
    list_snapshots,
)
from .synthesis import SynthesisPlan, plan_synthesis

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
def synthesize(
    folder: Path,
    sigma_rel: str | None,
    gamma: str | None,
    step: int | None,
    out: Path,
    dtype: str,
    progress: bool,
) -> None:
    """Reconstruct EMA weights of any length from a post-hoc snapshot FOLDER.

    Uses the least-squares synthesis of Karras et al. 2024 (arXiv:2312.02696), streaming
    one snapshot at a time. The output holds the model's state dict and loads straight
    into the model class.

    \b
    Example:
        emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plans = [
                plan_synthesis(folder, step=step, **{key: v})  # type: ignore[arg-type]
                for v in values
            ]
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
        click.echo(
            f"wrote {path}  (sigma_rel={_fmt(plan.sigma_rel)}, gamma={_fmt(plan.gamma)}, "
            f"step={plan.step}, {len(plan.snapshots)} snapshots, "
            f"profile error {plan.solution.residual:.2g})"
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


def _inspect_folder(folder: Path) -> None:
    snaps = list_snapshots(folder)
    others = [p for p in folder.iterdir() if p.is_file() and p not in {s.path for s in snaps}]
    if not snaps:
        raise click.ClickException(
            f"{folder} holds no emakit post-hoc snapshots ({len(others)} other file(s))"
        )
    by_profile: dict[tuple[float, float], list[SnapshotInfo]] = {}
    for s in snaps:
        by_profile.setdefault((s.gamma, s.sigma_rel), []).append(s)
    _, first_tensors = _safetensors_summary(snaps[-1].path)
    rows = [["profile", "sigma_rel", "gamma", "snapshots", "steps", "dtype", "size"]]
    for (gamma, sigma_rel), group in sorted(by_profile.items(), key=lambda kv: kv[1][0].profile):
        _, tensors = _safetensors_summary(group[-1].path)
        float_dtypes = sorted({d for n, d, _ in tensors if n not in group[-1].copied})
        rows.append(
            [
                str(group[0].profile),
                _fmt(sigma_rel),
                _fmt(gamma),
                str(len(group)),
                f"{group[0].step}..{group[-1].step}",
                ",".join(float_dtypes),
                _size(sum(s.nbytes for s in group)),
            ]
        )
    steps = sorted({s.step for s in snaps})
    click.echo(f"post-hoc EMA snapshot folder {folder}")
    click.echo(_table(rows))
    click.echo(
        f"{len(snaps)} snapshots at {len(steps)} steps ({steps[0]}..{steps[-1]}), "
        f"{_size(sum(s.nbytes for s in snaps))} in all"
    )
    click.echo(f"each snapshot: {_describe_tensors(first_tensors, snaps[-1].copied)}")
    if others:
        click.echo(f"{len(others)} other file(s) in the folder ignored")


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
    if not isinstance(obj, dict):
        click.echo(f"holds a {type(obj).__name__}")
        return
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    for key in ("version", "karras_version", "step", "initted", "gammas", "gamma", "t"):
        v = tensors.get(key)
        if v is not None:
            click.echo(f"  {key}: {v.tolist()}")
    others = sorted(k for k in obj if k not in tensors)
    floats = [v for v in tensors.values() if v.is_floating_point()]
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in tensors.values()})
    click.echo(
        f"{len(tensors)} tensors, {sum(v.numel() for v in floats):,} floating values, "
        f"dtypes {', '.join(dtypes) or '-'}" + (f"; other entries: {others[:10]}" if others else "")
    )


@click.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
def inspect_cmd(path: Path) -> None:
    """Show what a post-hoc snapshot FOLDER or a checkpoint FILE holds.

    For a folder: each profile with its sigma_rel and gamma, the snapshot steps, dtype and
    size. For a file: its header (.safetensors) or its EMA state (.pt).
    """
    try:
        if not os.path.exists(path):
            raise click.ClickException(f"{path} does not exist")
        if path.is_dir():
            _inspect_folder(path)
        elif path.suffix == ".safetensors":
            _inspect_safetensors(path)
        else:
            _inspect_torch(path)
    except EMAError as e:
        raise click.ClickException(str(e)) from e
