"""The post-hoc command line: ``emakit synthesize``, ``emakit sweep``, ``emakit inspect``,
``emakit convert``.

Four click commands, `synthesize`, `sweep_cmd` (named ``sweep``), `inspect_cmd`
(named ``inspect``) and `convert_cmd` (named ``convert``), added to the ``emakit`` group by `emakit.cli`, which imports this
module only when one of them runs::

    emakit synthesize ./post-hoc-ema-checkpoints --sigma-rel 0.05,0.1 --out ema.safetensors
    emakit sweep ./post-hoc-ema-checkpoints --sigma-rel 0.03:0.25:12 \\
        --eval my_project.evaluation:validation_loss --plot sweep.png
    emakit inspect ./post-hoc-ema-checkpoints
    emakit convert --to ema-pytorch ./post-hoc-ema-checkpoints ./ema-pytorch-checkpoints

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
* ``inspect`` reads files without unpickling anything: safetensors headers with emakit's
  own reader (every field validated), torch files with ``torch.load(weights_only=True)``;
  also the EMA inside a Lightning ``.ckpt``, an Accelerate ``save_state`` folder and a
  Transformers ``checkpoint-N`` folder. A FIFO, a socket or a device is refused.

ema-pytorch's snapshot files (``<profile index>.<step>.pt``, no profile recorded) need
``--legacy-sigma-rels`` (or ``--legacy-gammas``) and ``--legacy-update-every``; without
them ``inspect`` lists the files and the other commands refuse them. Every problem is
reported on one line (``Error: ...``), never as a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import torch

from .._files.atomic import atomic_path
from .._files.reading import open_regular, torch_load, writable_path, write_errors
from .._files.safetensors_file import ST_DTYPES, SafetensorsFile, write_safetensors
from .._version import __version__
from ..checkpoint import emakit_header
from ..errors import EMAError
from ..foreign import nested_states
from ..integrations._common import LIGHTNING_CHECKPOINT_KEY, TRAINER_WEIGHTS_NAME
from .convert import to_ema_pytorch
from .evaluations import EVAL_FILE_NAME, find_eval_file, read_eval_file
from .math import SIGMA_REL_MAX
from .snapshots.folder import (
    LOCK_NAME,
    check_output,
    describe_runs,
    existing_folder,
    find_snapshot_folder,
    list_legacy_files,
    list_snapshots,
    pick_run,
    runs_in,
    skipped_files,
)
from .snapshots.format import (
    SNAPSHOT_FORMAT,
    SYNTHESIZED_FORMAT,
    SnapshotInfo,
    read_snapshot_info,
    snapshot_sources,
)
from .snapshots.frozen import FROZEN_FORMAT, check_side_file, join_frozen
from .snapshots.legacy import LEGACY_NAME, LegacyProfiles, load_legacy_tensors
from .synthesis.plan import SynthesisPlan, pick_snapshots, plan_synthesis
from .synthesis.sweep import sweep, sweep_lengths

__all__ = [
    "COMMANDS",
    "convert_cmd",
    "inspect_cmd",
    "progress_bar",
    "sweep_cmd",
    "synthesize",
]

# -- what the commands share ----------------------------------------------------------------


def fail(error: BaseException) -> click.ClickException:
    """``error`` as a click error of one line (click prints ``Error: ...``, no traceback)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return click.ClickException(text or type(error).__name__)


def numbers(ctx: click.Context, param: click.Parameter, text: str | None) -> list[float] | None:
    """An option's comma-separated numbers (``0.05,0.1``), as floats; an empty item
    (``0.1,,0.2``, a trailing comma) is refused, not dropped."""
    if text is None:
        return None
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        empty = [i + 1 for i, part in enumerate(text.split(",")) if not part.strip()]
        why = f"; item {empty[0]} is empty" if empty else ""
        message = f"expected comma-separated numbers such as 0.05,0.1, got {text!r}{why}"
        raise click.BadParameter(message, ctx, param) from None


#: Buffers of torch's norm layers: without an emakit snapshot to say which tensors are
#: buffers, these are taken (not averaged) from ema-pytorch's files.
NORM_BUFFERS = {"running_mean": None, "running_var": None, "num_batches_tracked": torch.int64}


def folder_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--legacy-sigma-rels``, ``--legacy-gammas``, ``--legacy-update-every`` (passed
    on to `open_folder()`) and ``--run`` (the run to use in a folder holding several)."""
    options = [
        click.option(
            "--legacy-sigma-rels",
            callback=numbers,
            metavar="S[,S...]",
            help="Profiles of ema-pytorch's <index>.<step>.pt snapshot files in FOLDER: the "
            "sigma_rels of its PostHocEMA, in order. Needed to synthesize from them.",
        ),
        click.option(
            "--legacy-gammas",
            callback=numbers,
            metavar="G[,G...]",
            help="The same as gammas, in order.",
        ),
        click.option(
            "--legacy-update-every",
            type=click.IntRange(min=1),
            help="The update_every of that ema-pytorch run (its default: 100); required with "
            "--legacy-sigma-rels / --legacy-gammas.",
        ),
        click.option(
            "--run",
            metavar="ID",
            help="The run whose snapshots to use, for a folder holding several runs' snapshots "
            "(inspect lists them); '' picks snapshots written before emakit recorded runs.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def open_folder(
    folder: Path,
    legacy_sigma_rels: list[float] | None = None,
    legacy_gammas: list[float] | None = None,
    legacy_update_every: int | None = None,
) -> tuple[Path, LegacyProfiles | None]:
    """``(the folder holding the snapshots, the profiles to read ema-pytorch's files with,
    None without the options)``: ``folder``, or its one snapshot subfolder (a demo run's),
    said so. Where ema-pytorch's files alone cannot say which tensors are buffers, the
    guess is said too."""
    found = existing_folder(find_snapshot_folder(folder))  # a mistyped folder said first
    if found != folder:
        click.echo(f"Note: {folder} holds no snapshots itself; using {found}", err=True)
    sigma_rels, gammas, update_every = legacy_sigma_rels, legacy_gammas, legacy_update_every
    if sigma_rels is not None and gammas is not None:
        raise click.UsageError("give at most one of --legacy-sigma-rels and --legacy-gammas")
    if sigma_rels is None and gammas is None:
        return found, None
    if update_every is None:
        raise click.UsageError(
            "--legacy-sigma-rels / --legacy-gammas need --legacy-update-every N too: the "
            "update_every of the ema-pytorch run (its default: 100); it sets where each "
            "file's averaging ends"
        )
    legacy = (
        LegacyProfiles.from_sigma_rels(sigma_rels, update_every=update_every)
        if sigma_rels is not None
        else LegacyProfiles(tuple(gammas), update_every=update_every)  # type: ignore[arg-type]
    )
    files = list_legacy_files(found) if found.is_dir() else []
    if not files or list_snapshots(found):
        return found, legacy  # nothing to read, or emakit's snapshots say which are buffers
    names = sorted(load_legacy_tensors(files[-1].path))
    copied = [n for n in names if n.rsplit(".", 1)[-1] in NORM_BUFFERS]
    exact = [(n, d) for n in copied if (d := NORM_BUFFERS[n.rsplit(".", 1)[-1]]) is not None]
    click.echo(
        f"Note: ema-pytorch's files do not say which tensors are buffers; taking "
        f"{len(copied)} norm-layer buffer(s) from the latest snapshot "
        f"({', '.join(copied[:4]) or 'none'}{', ...' if len(copied) > 4 else ''}) "
        f"and averaging the other {len(names) - len(copied)} tensors",
        err=True,
    )
    return found, dataclasses.replace(legacy, copied=frozenset(copied), exact_dtypes=tuple(exact))


@contextmanager
def progress_bar(
    enabled: bool, unit: str = "snapshots"
) -> Iterator[Callable[[str, int], Callable[[int, int], None]]]:
    """Yield ``start(label, total) -> advance(done, total)``: a bar on stderr counting
    ``unit``, rich if installed (imported here, when a bar is shown), else click's."""
    if not enabled:
        yield lambda label, total: lambda done, total_: None
        return
    try:
        from rich import console
        from rich import progress as bars
    except ImportError:  # rich is an optional extra: fall back to click's bar
        with ExitStack() as stack:

            def start_click(label: str, total: int) -> Callable[[int, int], None]:
                stream = click.get_text_stream("stderr")  # type: ignore[operator]
                bar: Any = stack.enter_context(
                    click.progressbar(length=total, label=label, file=stream)
                )
                return lambda done, total_: bar.update(done - bar.pos)

            yield start_click
        return
    columns = [bars.TextColumn("{task.description}"), bars.BarColumn(), bars.MofNCompleteColumn()]
    columns += [bars.TextColumn(unit), bars.TimeElapsedColumn()]
    stderr = console.Console(stderr=True)  # stdout stays for the results
    with bars.Progress(*columns, console=stderr) as progress:

        def start_rich(label: str, total: int) -> Callable[[int, int], None]:
            task = progress.add_task(label, total=total)
            return lambda done, total_: progress.update(task, completed=done)

        yield start_rich


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


# -- emakit inspect ----------------------------------------------------------------------------

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
    return (
        isinstance(obj, Mapping)
        and "step" in obj
        and "initted" in obj
        and any(str(k).startswith("ema_model.") for k in obj)
    )


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
def inspect_cmd(
    path: Path,
    run: str | None,
    **legacy: Any,
) -> None:
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


#: The commands by name, which `emakit.cli` adds to the ``emakit`` group when one runs.
# -- emakit convert --------------------------------------------------------------------------


@click.command("convert")
@click.argument("folder", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(["ema-pytorch"]),
    help="The format to write: ema-pytorch's <profile index>.<step>.pt files.",
)
@click.option("--run", metavar="ID", help="The run to convert, when FOLDER holds several.")
@click.option("--force", is_flag=True, help="Write into a non-empty OUT.")
def convert_cmd(folder: Path, out: Path, to: str, run: str | None, force: bool) -> None:
    """Write a post-hoc snapshot FOLDER as another tool's snapshot folder OUT.

    --to ema-pytorch writes each snapshot as <profile index>.<step>.pt, which
    ema-pytorch's PostHocEMA(..., sigma_rels=<the same, in order>,
    checkpoint_folder=OUT).synthesize_ema_model(...) reads. FOLDER is only read; OUT must
    be empty (or new) unless --force; the files appear all at once or not at all.

    \b
    Example:
        emakit convert --to ema-pytorch ./post-hoc-ema ./ema-pytorch-checkpoints
    """
    try:
        folder, _ = open_folder(folder)  # a demo's run folder: its snapshot subfolder
        paths = to_ema_pytorch(folder, out, run=run, force=force)
    except (EMAError, OSError) as e:
        raise fail(e) from e
    steps = sorted({int(p.stem.split(".")[1]) for p in paths})
    click.echo(
        f"wrote {len(paths)} ema-pytorch snapshot file(s) to {out} (steps "
        f"{steps[0]}..{steps[-1]}); read them with ema_pytorch.PostHocEMA(model, "
        f"sigma_rels=<the run's, in order>, checkpoint_folder={str(out)!r})"
    )


COMMANDS = {
    "synthesize": synthesize,
    "sweep": sweep_cmd,
    "inspect": inspect_cmd,
    "convert": convert_cmd,
}
