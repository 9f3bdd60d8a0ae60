"""``emakit sweep``: choose the EMA length of a snapshot folder by a sweep.

::

    emakit sweep ./post-hoc-ema-checkpoints --sigma-rel 0.03:0.25:12 \\
        --eval my_project.evaluation:validation_loss --plot sweep.png

``--eval module:function`` names ``function(state_dict) -> float``, imported like
``python -c "import module"`` from the current folder; it receives each synthesized EMA
as a state dict (whole tensors, loadable straight into the model class) and returns its
score. The table of scores, in order, and the best length are printed; ``--plot`` writes
the score against ``sigma_rel`` with the tracked profiles marked (needs matplotlib).
Imported by the CLI only when the command runs.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import EMAError
from ._cli import fail, fmt, legacy_options, legacy_profiles, run_option, snapshot_folder
from .sweeping import sweep, sweep_lengths

__all__ = ["load_function", "sweep_cmd"]


def load_function(spec: str) -> Callable[[Any], Any]:
    """``module:function`` -> the function (the current folder is importable).

    Raises:
        click.BadParameter: a malformed spec, a module that cannot be imported, or a name
            that is not a callable of the module.
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise click.BadParameter(f"expected module:function, got {spec!r}", param_hint="--eval")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise click.BadParameter(f"cannot import {module_name!r}: {e}", param_hint="--eval") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise click.BadParameter(f"{module_name!r} has no function {name!r}", param_hint="--eval")
    return fn  # type: ignore[no-any-return]


@click.command("sweep")
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--sigma-rel",
    "sigma_rel",
    required=True,
    metavar="A:B:N",
    help="The lengths to try: N evenly spaced sigma_rel from A to B (e.g. 0.03:0.25:12), or "
    "a comma-separated list.",
)
@click.option(
    "--eval",
    "eval_spec",
    required=True,
    metavar="MODULE:FUNCTION",
    help="The scoring function, FUNCTION(state_dict) -> float, importable from the current folder.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the score against sigma_rel as a PNG (needs matplotlib).",
)
@click.option(
    "--step",
    type=click.IntRange(min=1),
    default=None,
    help="Training step to synthesize at. Default: the latest snapshot's.",
)
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
@legacy_options
@run_option
def sweep_cmd(
    folder: Path,
    sigma_rel: str,
    eval_spec: str,
    plot: Path | None,
    step: int | None,
    maximize: bool,
    lengths_per_pass: int,
    legacy_sigma_rels: str | None,
    legacy_gammas: str | None,
    legacy_update_every: int | None,
    run: str | None,
) -> None:
    """Choose the EMA length by a sweep over a post-hoc snapshot FOLDER.

    Each snapshot is read once per pass (--lengths-per-pass lengths at a time), every
    length is scored by --eval, and the table and the best length are printed
    (Karras et al. 2024, arXiv:2312.02696, Fig. 1).

    \b
    Example:
        emakit sweep ./post-hoc-ema-checkpoints --sigma-rel 0.03:0.25:12
            --eval my_project.evaluation:validation_loss --plot sweep.png
    """
    try:
        lengths = sweep_lengths(sigma_rel)
    except EMAError as e:
        raise click.BadParameter(str(e), param_hint="--sigma-rel") from e
    evaluate = load_function(eval_spec)
    try:
        folder = snapshot_folder(folder)
        legacy, _ = legacy_profiles(folder, legacy_sigma_rels, legacy_gammas, legacy_update_every)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = sweep(
                folder,
                evaluate,
                lengths,
                step=step,
                mode="max" if maximize else "min",
                lengths_per_pass=lengths_per_pass,
                run=run,
                legacy=legacy,
            )
        for w in {str(w.message): w for w in caught}.values():
            click.echo(f"Warning: {w.message}", err=True)
        if plot is not None:
            result.plot(plot)
    except (EMAError, OSError) as e:
        raise fail(e) from e
    click.echo(result.table())
    best, score = result.best
    click.echo(f"best: sigma_rel={fmt(best)} (score {score:.6g}, step {result.step})")
    if plot is not None:
        click.echo(f"wrote {plot}")
