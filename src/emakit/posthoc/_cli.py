"""Pieces shared by ``emakit synthesize`` and ``emakit inspect``: number lists, the
ema-pytorch options, the snapshot folder, the ``--run`` option, one-line errors, and the
progress bar (``emakit bench`` uses it too)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import click
import torch

from .snapshots import LegacyProfiles, list_legacy_files, list_snapshots
from .synthesis import load_legacy_tensors
from .where import find_snapshot_folder

__all__ = [
    "LEGACY_HINT",
    "NORM_BUFFERS",
    "fail",
    "floats",
    "fmt",
    "legacy_options",
    "legacy_profiles",
    "progress_bar",
    "run_option",
    "snapshot_folder",
]


def fail(error: BaseException) -> click.ClickException:
    """``error`` as a click error of one line (click prints ``Error: ...``, no traceback)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return click.ClickException(text or type(error).__name__)


def fmt(x: float) -> str:
    """A number in at most 6 significant digits."""
    return f"{x:.6g}"


def floats(option: str, text: str | None) -> list[float]:
    """Comma-separated numbers of ``option`` (empty for None), or a usage error."""
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


def snapshot_folder(folder: Path) -> Path:
    """The folder holding the snapshots (``folder``, or its one snapshot subfolder)."""
    found = find_snapshot_folder(folder)
    if found != folder:
        click.echo(f"Note: {folder} holds no snapshots itself; using {found}", err=True)
    return found


def run_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--run ID``: the run to use in a folder holding the snapshots of several."""
    return click.option(
        "--run",
        "run",
        metavar="ID",
        default=None,
        help="The run whose snapshots to use, for a folder holding several runs' snapshots "
        "(inspect lists them); '' picks snapshots written before emakit recorded runs.",
    )(command)


# -- ema-pytorch's snapshot files ----------------------------------------------------------

#: Buffers of torch's norm layers: without an emakit snapshot to say which tensors are
#: buffers, these are taken (not averaged) from ema-pytorch's files.
NORM_BUFFERS = {"running_mean": None, "running_var": None, "num_batches_tracked": torch.int64}
LEGACY_HINT = (
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


def legacy_profiles(
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
            floats("--legacy-sigma-rels", sigma_rels), update_every=update_every
        )
        if sigma_rels is not None
        else LegacyProfiles(tuple(floats("--legacy-gammas", gammas)), update_every=update_every)
    )
    files = list_legacy_files(folder) if folder.is_dir() else []
    if not files or list_snapshots(folder):
        return legacy, None  # nothing to read, or emakit's snapshots say which are buffers
    names = sorted(load_legacy_tensors(files[-1].path))
    leaf = {n: n.rsplit(".", 1)[-1] for n in names}
    copied = frozenset(n for n in names if leaf[n] in NORM_BUFFERS)
    exact = tuple((n, d) for n in sorted(copied) if (d := NORM_BUFFERS[leaf[n]]) is not None)
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
        TextColumn(unit),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout stays for the results
        transient=False,
    )
    with progress:

        def start_rich(label: str, total: int) -> Callable[[int, int], None]:
            task = progress.add_task(label, total=total)
            return lambda done, total_: progress.update(task, completed=done)

        yield start_rich
