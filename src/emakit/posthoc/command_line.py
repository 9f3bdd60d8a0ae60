"""What emakit's commands that read a run folder share: one-line errors (`fail()`), the
folder options (`folder_options()`: ``--legacy-*`` and ``--run``, read by `open_folder()`,
which also finds a demo run's snapshot subfolder), comma-separated numbers (`numbers()`),
and the progress bar (`progress_bar()`, rich if installed, else click's).

Used by ``emakit synthesize`` and ``emakit sweep`` (`emakit.posthoc.commands`), ``emakit
convert`` (`emakit.posthoc.convert`) and ``emakit inspect`` (`emakit.inspection`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import torch

from .snapshots.folder import (
    existing_folder,
    find_snapshot_folder,
    list_legacy_files,
    list_snapshots,
)
from .snapshots.legacy import LegacyProfiles, load_legacy_tensors

__all__ = ["fail", "folder_options", "numbers", "open_folder", "progress_bar"]


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
