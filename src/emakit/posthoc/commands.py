"""The post-hoc command line: ``emakit synthesize`` and ``emakit sweep``.

Two click commands, `synthesize` and `sweep_cmd` (named ``sweep``), added to the ``emakit``
group by `emakit.cli`, which imports this module only when one of them runs::

    emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
    emakit sweep ./post-hoc-ema-checkpoints --sigma-rel 0.03:0.25:12 \\
        --eval my_project.evaluation:validation_loss --plot sweep.png

* ``synthesize`` writes one file per requested length, in the format its suffix names
  (``.safetensors``, or ``.pt``/``.pth``/``.bin`` for ``torch.save``); it never overwrites
  an input snapshot (through symlinks and hard links too), and replaces an existing file
  only with ``--force``. The file holds the model's state dict, so it loads straight into
  the model class: ``model.load_state_dict(safetensors.torch.load_file(path))``.
* ``sweep``: ``--eval module:function`` names ``function(state_dict) -> float``, imported
  from the installed packages or the current folder (searched last); it scores each
  synthesized EMA. Without ``--eval``, the folder's ``emakit-eval.json`` may name one of
  emakit's own evaluations (`emakit.posthoc.evaluations`: a fixed registry, typed
  arguments; the file never chooses code). The table of scores and the best length are
  printed; ``--plot`` writes the score against ``sigma_rel`` (needs matplotlib).

``emakit inspect`` is `emakit.inspection`, ``emakit convert`` `emakit.posthoc.convert`; the
options they share with these are in `emakit.posthoc.command_line`. ema-pytorch's snapshot
files (``<profile index>.<step>.pt``, no profile recorded) need ``--legacy-sigma-rels`` (or
``--legacy-gammas``) and ``--legacy-update-every``. Every problem is reported on one line
(``Error: ...``), never as a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import torch

from .._files.atomic import atomic_path
from .._files.reading import writable_path, write_errors
from .._files.safetensors_file import write_safetensors
from .._version import __version__
from ..errors import EMAError
from .command_line import fail, folder_options, numbers, open_folder, progress_bar
from .evaluations import EVAL_FILE_NAME, find_eval_file, read_eval_file
from .math import SIGMA_REL_MAX
from .snapshots.folder import check_output
from .snapshots.format import SYNTHESIZED_FORMAT
from .synthesis.plan import SynthesisPlan, pick_snapshots, plan_synthesis
from .synthesis.sweep import sweep, sweep_lengths

__all__ = ["sweep_cmd", "synthesize"]


_STEP = click.option(
    "--step",
    type=click.IntRange(min=1),
    help="Training step to synthesize at, from the first snapshot's step to the last's; only "
    "snapshots at or before it are used. Default: the latest snapshot's step.",
)


# -- emakit synthesize ---------------------------------------------------------------------------

SYNTHESIZED_FORMAT_VERSION = 1

#: Output suffixes ``emakit synthesize --out`` writes, and the format of each.
OUTPUT_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def _output_paths(
    out: Path, key: str, values: Sequence[float], folder: Path, force: bool
) -> list[Path]:
    """The output files: ``out``, or one per value named after it, in the format the suffix
    names (`OUTPUT_FORMATS`). Never a file of ``folder``'s snapshots (a path to it, a
    symlink or a hard link: [`check_output()`][emakit.posthoc.snapshots.folder.check_output]);
    an existing file only with ``force``."""
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
    paths = [out.with_name(f"{out.stem}.{key}-{v:.6g}{out.suffix}") for v in values]
    paths = [out] if len(values) == 1 else paths
    if len(set(paths)) != len(paths):
        option = "--" + key.replace("_", "-")
        raise click.BadParameter(f"the values {list(values)} repeat", param_hint=option)
    for path in paths:
        check_output("--out", path, folder)
        if os.path.lexists(path) and not force:
            raise click.ClickException(
                f"--out {path} already exists; pass --force to replace it, or choose another name"
            )
    return paths


def _write_output(path: Path, state: dict[str, torch.Tensor], plan: SynthesisPlan) -> None:
    """Write ``state`` atomically in the format ``path``'s suffix names."""
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
    callback=numbers,
    metavar="S[,S...]",
    help=f"Relative EMA length(s) to reconstruct, comma-separated, each in (0, {SIGMA_REL_MAX:.5f}]; "
    "e.g. 0.05,0.1,0.15.",
)
@click.option(
    "--gamma",
    callback=numbers,
    metavar="G[,G...]",
    help="Power-function exponent(s) to reconstruct instead of --sigma-rel, comma-separated.",
)
@_STEP
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
    type=click.Choice(["bfloat16", "float16", "float32", "float64"]),
    default="float32",
    show_default=True,
    help="dtype of the averaged tensors written (buffers keep theirs).",
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@folder_options
def synthesize(
    folder: Path,
    sigma_rel: list[float] | None,
    gamma: list[float] | None,
    step: int | None,
    out: Path,
    force: bool,
    dtype: str,
    progress: bool,
    run: str | None,
    **legacy: Any,
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
    key, values = ("sigma_rel", sigma_rel) if sigma_rel is not None else ("gamma", gamma)
    try:
        folder, profiles = open_folder(folder, **legacy)
        snaps = pick_snapshots(folder, profiles, run)
        plans = [plan_synthesis(folder, step=step, snapshots=snaps, **{key: v}) for v in values]  # type: ignore[arg-type, union-attr]
        paths = _output_paths(out, key, values, folder, force)  # type: ignore[arg-type]
        with progress_bar(progress) as start:
            for plan, path in zip(plans, paths, strict=True):
                label = f"sigma_rel={plan.sigma_rel:.6g} step={plan.step}"
                state = plan.run(
                    dtype=getattr(torch, dtype), progress=start(label, len(plan.snapshots))
                )
                _write_output(path, state, plan)
                del state
    except (EMAError, OSError) as e:
        raise fail(e) from e
    for plan, path in zip(plans, paths, strict=True):
        theirs = sum(s.is_legacy for s in plan.snapshots)
        click.echo(
            f"wrote {path}  (sigma_rel={plan.sigma_rel:.6g}, gamma={plan.gamma:.6g}, "
            f"step={plan.step}, {len(plan.snapshots)} snapshots"
            + (f" ({theirs} from ema-pytorch)" if theirs else "")
            + f", profile error {plan.solution.residual:.2g})"
        )


# -- emakit sweep ----------------------------------------------------------------------------


def sweep_spec(ctx: click.Context, param: click.Parameter, spec: str) -> list[float]:
    """``--sigma-rel A:B:N`` (or ``A,B,C``) -> the lengths (`sweep_lengths()`)."""
    try:
        return sweep_lengths(spec)
    except EMAError as e:
        raise click.BadParameter(str(e), ctx, param) from None


def folder_evaluation(folder: Path) -> Callable[..., Any]:
    """The score that ``folder``'s ``emakit-eval.json`` (or its parent's) names, from
    emakit's fixed registry (`emakit.posthoc.evaluations`): the file is data, never code.

    Raises:
        click.UsageError: no such file (``--eval`` is needed).
        click.ClickException: exit code 2 and one line, ``... is not a usable
            emakit-eval.json: ...`` naming the entry, when the file is anything else.
    """
    path = find_eval_file(folder)
    if path is None:
        raise click.UsageError(
            f"Missing option '--eval' (MODULE:FUNCTION, scoring a state_dict): {folder} has "
            f"no {EVAL_FILE_NAME} to score with (emakit demo writes one beside its snapshots)"
        )
    try:
        name, score = read_eval_file(path)
    except EMAError as e:
        raise UnusableFileError(fail(e).message) from e
    click.echo(f"Note: scoring with {name} from {path}", err=True)
    return score


class UnusableFileError(click.ClickException):
    """A file in a folder that emakit refuses to use: one line, exit code 2 (click's code
    for bad usage), nothing run."""

    exit_code = 2


def load_function(
    ctx: click.Context | None, param: click.Parameter | None, spec: str
) -> Callable[..., Any]:
    """``--eval module:function`` -> the function, the user's explicit choice on the
    command line; the current folder is searched after the installed packages (appended
    to ``sys.path``), so a file in it cannot stand in for an installed module. A malformed
    spec, a module that cannot be imported or a name that is not one of its callables is
    a usage error."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise click.BadParameter(f"expected module:function, got {spec!r}", ctx, param)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise click.BadParameter(f"cannot import {module_name!r}: {e}", ctx, param) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise click.BadParameter(f"{module_name!r} has no function {name!r}", ctx, param)
    return fn  # type: ignore[no-any-return]


@click.command("sweep")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--sigma-rel",
    required=True,
    metavar="A:B:N",
    callback=sweep_spec,
    help="The lengths to try: N evenly spaced sigma_rel from A to B (e.g. 0.03:0.25:12), or "
    "a comma-separated list.",
)
@click.option(
    "--eval",
    "evaluate",
    metavar="MODULE:FUNCTION",
    callback=lambda ctx, param, spec: None if spec is None else load_function(ctx, param, spec),
    help="The scoring function, FUNCTION(state_dict) -> float, importable (installed, or "
    f"in the current folder). Default: the one of emakit's that the folder's {EVAL_FILE_NAME} "
    "names (an emakit demo folder).",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the score against sigma_rel as a PNG (needs matplotlib).",
)
@_STEP
@click.option(
    "--maximize",
    is_flag=True,
    help="Higher scores are better (accuracy); default: lower is better (loss, FID).",
)
@click.option(
    "--lengths-per-pass",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Lengths synthesized per pass over the snapshots (one model in memory each).",
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar (on stderr).")
@folder_options
def sweep_cmd(
    folder: Path,
    sigma_rel: list[float],
    evaluate: Callable[..., Any] | None,
    plot: Path | None,
    step: int | None,
    maximize: bool,
    lengths_per_pass: int,
    progress: bool,
    run: str | None,
    **legacy: Any,
) -> None:
    """Choose the EMA length by a sweep over a post-hoc snapshot FOLDER.

    Each snapshot is read once per pass (--lengths-per-pass lengths at a time), every
    length is scored by --eval, and the table and the best length are printed
    (Karras et al. 2024, arXiv:2312.02696, Fig. 1).

    \b
    Example:
        emakit sweep ./post-hoc-ema-checkpoints --sigma-rel 0.03:0.25:12
            --eval my_project.evaluation:validation_loss --plot sweep.png
        emakit sweep ./emakit-demo-20260101-120000 --sigma-rel 0.03:0.25:8
    """
    try:
        folder, profiles = open_folder(folder, **legacy)
        scorer = evaluate or folder_evaluation(folder)
        with progress_bar(progress, unit="lengths") as start:
            result = sweep(
                folder,
                scorer,
                sigma_rel,
                step=step,
                mode="max" if maximize else "min",
                lengths_per_pass=lengths_per_pass,
                run=run,
                legacy=profiles,
                plot=plot,
                progress=start("sweep", len(sigma_rel)),
            )
    except (EMAError, OSError) as e:
        raise fail(e) from e
    click.echo(result.table())
    try:
        best, score = result.best
    except EMAError as e:  # every score NaN: the table is shown, then why there is no best
        raise fail(e) from e
    click.echo(f"best: sigma_rel={best:.6g} (score {score:.6g}, step {result.step})")
    if plot is not None:
        click.echo(f"wrote {plot}")
