"""Command-line front end of post-hoc EMA: ``emakit synthesize`` and ``emakit inspect``.

Two click commands, `synthesize` and `inspect_cmd` (named ``inspect``), meant
to be added to the ``emakit`` group::

    emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
    emakit inspect ./post-hoc-ema-checkpoints

ema-pytorch's snapshot files (``<profile index>.<step>.pt``, no profile recorded) need
``--legacy-sigma-rels`` (or ``--legacy-gammas``) and ``--legacy-update-every``; without
them ``inspect`` lists the files and ``synthesize`` refuses them.

``synthesize`` writes one file per requested length, in the format its suffix names
(``.safetensors``, or ``.pt``/``.pth``/``.bin`` for ``torch.save``); it never overwrites an
input snapshot (through symlinks and hard links too), and replaces an existing file only
with ``--force``. The file holds the model's state dict (parameter and buffer names as in
``model.state_dict()``), so it loads straight into the model class::

    model.load_state_dict(safetensors.torch.load_file("ema.sigma_rel-0.05.safetensors"))

``inspect`` lives in `emakit.posthoc.inspection`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import click
import torch

from .._files.atomic import atomic_path
from .._files.reading import writable_path, write_errors
from .._files.safetensors_file import write_safetensors
from ..errors import EMAError
from ._cli import (
    LEGACY_HINT,
    fail,
    floats,
    fmt,
    legacy_options,
    legacy_profiles,
    progress_bar,
    run_option,
    snapshot_folder,
)
from .inspection import inspect_cmd
from .math import SIGMA_REL_MAX
from .snapshots import (
    SYNTHESIZED_FORMAT,
    LegacyFile,
    list_legacy_files,
    list_snapshots,
)
from .synthesis import SynthesisPlan, plan_synthesis

__all__ = ["SYNTHESIZED_FORMAT", "inspect_cmd", "synthesize"]

SYNTHESIZED_FORMAT_VERSION = 1

#: Output suffixes ``emakit synthesize --out`` writes, and the format of each.
OUTPUT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _output_paths(out: Path, key: str, values: Sequence[float]) -> list[Path]:
    """The output files: ``out``, or one per value named after it; the suffix says the
    format (`OUTPUT_FORMATS`)."""
    if out.suffix.lower() not in OUTPUT_FORMATS:
        raise click.BadParameter(
            f"{out} has the suffix {out.suffix or '(none)'!r}; synthesize writes "
            f".safetensors (safetensors) or .pt/.pth/.bin (torch.save of the state dict): "
            f"name the output with one of those suffixes",
            param_hint="--out",
        )
    try:
        writable_path("--out", out)
    except EMAError as e:
        raise click.BadParameter(str(e), param_hint="--out") from None
    if len(values) == 1:
        return [out]
    paths = [out.with_name(f"{out.stem}.{key}-{fmt(v)}{out.suffix}") for v in values]
    if len(set(paths)) != len(paths):
        raise click.BadParameter(f"the values {list(values)} repeat", param_hint=f"--{key}")
    return paths


def _check_outputs(paths: Sequence[Path], inputs: Sequence[Path], force: bool) -> None:
    """Refuse an output that is (through symlinks or hard links) one of the inputs, a
    folder, or, without ``force``, any existing file."""
    real = {os.path.realpath(p): p for p in inputs}
    ids = {}
    for p in inputs:
        try:
            found = os.stat(p)
        except OSError:
            continue
        ids[(found.st_dev, found.st_ino)] = p
    for path in paths:
        st: os.stat_result | None
        try:
            st = os.stat(path)
        except OSError:
            st = None
        same = real.get(os.path.realpath(path)) or (st and ids.get((st.st_dev, st.st_ino)))
        if same:
            raise click.ClickException(
                f"--out {path} is the input snapshot {same}: synthesize never overwrites its "
                f"inputs; name the output differently"
            )
        if os.path.isdir(path):
            raise click.ClickException(f"--out {path} is a folder; give a file name")
        if os.path.lexists(path) and not force:
            raise click.ClickException(
                f"--out {path} already exists; pass --force to replace it, or choose another name"
            )


def _refuse_legacy(folder: Path, files: list[LegacyFile]) -> None:
    if files:
        shown = ", ".join(f.path.name for f in files[:4]) + (", ..." if len(files) > 4 else "")
        raise click.ClickException(
            f"{folder} holds {len(files)} ema-pytorch snapshot file(s) ({shown}), which do not "
            f"record their profiles; emakit will not ignore them: {LEGACY_HINT}, or move them "
            f"out of the folder"
        )


def _write_output(path: Path, state: dict[str, torch.Tensor], plan: SynthesisPlan) -> None:
    """Write ``state`` atomically in the format ``path``'s suffix names."""
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
    with write_errors([path], "output file"), atomic_path(path) as tmp, open(tmp, "wb") as f:
        if OUTPUT_FORMATS[path.suffix.lower()] == "safetensors":
            write_safetensors(f, state, metadata)
        else:
            torch.save(state, f)


@click.command("synthesize")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--sigma-rel",
    "sigma_rel",
    metavar="S[,S...]",
    help=f"Relative EMA length(s) to reconstruct, comma-separated, each in (0, {SIGMA_REL_MAX:.5f}]; "
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
    help="Output file: .safetensors, or .pt/.pth/.bin for torch.save of the state dict. With "
    "several values, one file each: OUT_STEM.sigma_rel-S.SUFFIX. Never one of the input "
    "snapshots; an existing file needs --force.",
)
@click.option("--force", is_flag=True, help="Replace existing output files.")
@click.option(
    "--dtype",
    type=click.Choice(sorted(_DTYPES)),
    default="float32",
    show_default=True,
    help="dtype of the averaged tensors written (buffers keep theirs).",
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@legacy_options
@run_option
def synthesize(
    folder: Path,
    sigma_rel: str | None,
    gamma: str | None,
    step: int | None,
    out: Path,
    force: bool,
    dtype: str,
    progress: bool,
    legacy_sigma_rels: str | None,
    legacy_gammas: str | None,
    legacy_update_every: int | None,
    run: str | None,
) -> None:
    """Reconstruct EMA weights of any length from a post-hoc snapshot FOLDER.

    Uses the least-squares synthesis of Karras et al. 2024 (arXiv:2312.02696), streaming
    one snapshot at a time. The output holds the model's state dict and loads straight
    into the model class.

    ema-pytorch's snapshot files (<index>.<step>.pt) in FOLDER are used with emakit's when
    --legacy-sigma-rels (or --legacy-gammas) gives their profiles; without it they are
    refused. A FOLDER holding the snapshots of several runs needs --run ID.

    \b
    Example:
        emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
        emakit synthesize ./ema-pytorch-checkpoints --legacy-sigma-rels 0.05,0.28
            --legacy-update-every 1 --sigma-rel 0.1 --out ema.safetensors
    """
    if (sigma_rel is None) == (gamma is None):
        raise click.UsageError("give exactly one of --sigma-rel and --gamma")
    key, values = (
        ("sigma_rel", floats("--sigma-rel", sigma_rel))
        if sigma_rel is not None
        else ("gamma", floats("--gamma", gamma))
    )
    paths = _output_paths(out, key, values)
    try:
        folder = snapshot_folder(folder)
        legacy, note = legacy_profiles(
            folder, legacy_sigma_rels, legacy_gammas, legacy_update_every
        )
        if legacy is None and folder.is_dir():
            _refuse_legacy(folder, list_legacy_files(folder))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plans = [
                plan_synthesis(folder, step=step, legacy=legacy, run=run, **{key: v})  # type: ignore[arg-type]
                for v in values
            ]
        inputs = [f for s in list_snapshots(folder, legacy=legacy) for f in s.shards or [s.path]]
        inputs += [f.path for f in list_legacy_files(folder)]
        used = [f for p in plans for s in p.snapshots for f in s.shards or [s.path]]
        _check_outputs(paths, inputs + used, force)
        if note and any(s.is_legacy for p in plans for s in p.snapshots):
            click.echo(note, err=True)
        for w in caught:
            click.echo(f"Warning: {w.message}", err=True)
        with progress_bar(progress) as start:
            for plan, path in zip(plans, paths, strict=True):
                label = f"sigma_rel={fmt(plan.sigma_rel)} step={plan.step}"
                state = plan.run(dtype=_DTYPES[dtype], progress=start(label, len(plan.snapshots)))
                _write_output(path, state, plan)
                del state
    except (EMAError, OSError) as e:
        raise fail(e) from e
    for plan, path in zip(plans, paths, strict=True):
        theirs = sum(s.is_legacy for s in plan.snapshots)
        click.echo(
            f"wrote {path}  (sigma_rel={fmt(plan.sigma_rel)}, gamma={fmt(plan.gamma)}, "
            f"step={plan.step}, {len(plan.snapshots)} snapshots"
            + (f" ({theirs} from ema-pytorch)" if theirs else "")
            + f", profile error {plan.solution.residual:.2g})"
        )
