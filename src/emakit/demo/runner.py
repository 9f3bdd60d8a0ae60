"""Entry point of the ``emakit demo``: `run_demo()` and its output folder.

This module owns a run from start to finish: the demo extra's dependency check
(`check_dependencies()`, `DemoDependencyError`), the output folder
(`new_output_dir()` and the file names `SUMMARY_NAME`, `PLOT_NAME`,
`POSTHOC_DIR`), validating the settings, the progress bar, and writing
``summary.json`` and ``demo.png`` atomically. It builds on `emakit.demo.training`
(the run itself) and `emakit.demo.report` (table, plot, summary keys); rich is
imported only inside the functions that show progress or print the table.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._files.atomic import atomic_write_bytes
from .._version import __version__
from .report import plot_history, results_table, summary_metrics
from .settings import DEFAULTS, MODEL_LABELS, POSTHOC_SIGMA_REL, POSTHOC_TRACKED, DemoSettings
from .training import load_digits_split, train

__all__ = [
    "INSTALL_HINT",
    "PLOT_NAME",
    "POSTHOC_DIR",
    "SUMMARY_NAME",
    "DemoDependencyError",
    "check_dependencies",
    "new_output_dir",
    "run_demo",
]

SUMMARY_NAME = "summary.json"
PLOT_NAME = "demo.png"
POSTHOC_DIR = "posthoc-snapshots"
INSTALL_HINT = 'pip install "emakit[demo]"'


class DemoDependencyError(ImportError):
    """A package of the ``emakit[demo]`` extra is missing."""


# -- dependencies --------------------------------------------------------------------------


def check_dependencies(*, plot: bool = True) -> None:
    """Raise `DemoDependencyError` naming every missing demo package.

    Args:
        plot: also require matplotlib. Default True.

    Raises:
        DemoDependencyError: with the install command ``pip install "emakit[demo]"``.
    """
    wanted = {"scikit-learn": "sklearn", "rich": "rich"}
    if plot:
        wanted["matplotlib"] = "matplotlib"
    missing = []
    for dist, module in wanted.items():
        try:
            __import__(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise DemoDependencyError(
            f"the demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed; install the demo extra: {INSTALL_HINT}"
        )


# -- files ---------------------------------------------------------------------------------


def new_output_dir(parent: Path | None = None, *, now: _dt.datetime | None = None) -> Path:
    """Create and return a fresh folder ``emakit-demo-YYYYmmdd-HHMMSS`` in ``parent``.

    An existing folder is never reused: if the name is taken, ``-2``, ``-3``, ... is
    appended. ``os.mkdir`` creates it, so two concurrent runs cannot get the same one.

    Args:
        parent: where to create it. Default None: the current directory.
        now: the timestamp to use. Default None: the current local time.

    Returns:
        The newly created folder.
    """
    parent = Path.cwd() if parent is None else Path(parent)
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = parent / f"emakit-demo-{stamp}"
    for i in range(1, 10_000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            candidate.mkdir(parents=False)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"could not find a free folder name like {base}")


# -- entry point ---------------------------------------------------------------------------


def run_demo(
    out: Path,
    steps: int = DEFAULTS.steps,
    seed: int = DEFAULTS.seed,
    beta: float = DEFAULTS.beta,
    *,
    plot: bool = True,
    progress: bool = True,
    console: Any = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run the demo and write ``out/summary.json``, ``out/demo.png`` and the post-hoc
    snapshots in ``out/posthoc-snapshots``.

    ``out`` is created if missing. If it exists, the demo's own files in it are replaced
    (atomically; its ``posthoc-snapshots`` folder is emptied and rewritten; with
    ``plot=False`` an old ``demo.png`` is removed, as it would no longer match the summary)
    and every other file is left alone.

    Args:
        out: the output folder.
        steps: optimizer steps, >= 1. Default 1500.
        seed: seed of the split, label noise, initialization and batch order, >= 0.
            Default 0.
        beta: ceiling of the EMA decay, in [0, 1]. Default 0.995.
        plot: write ``demo.png``. Default True.
        progress: show a progress bar and print the final table on ``console``.
            Default True.
        console: a ``rich.console.Console`` for the output. Default None: a new one.
        **overrides: any other field of `DemoSettings` (e.g. ``lr=0.05``).

    Returns:
        The summary written to ``summary.json``: ``online_accuracy``, ``ema_accuracy``,
        ``posthoc_accuracy`` (and the same ``*_loss``), ``results`` (per model),
        ``settings``, ``posthoc`` (the tracked ``sigma_rels_tracked``, the
        ``sigma_rel_synthesized``, its step, the snapshot cadence and folder; None when
        ``posthoc_every=0``), ``versions``, ``history``, ``elapsed_s`` and ``files``.

    Raises:
        DemoDependencyError: a package of the ``emakit[demo]`` extra is missing.
        ValueError: a setting is out of range (the message names it).
        NotADirectoryError: ``out`` exists and is not a folder.
    """
    unknown = sorted(set(overrides) - set(asdict(DEFAULTS)))
    if unknown:
        raise TypeError(
            f"run_demo() got unknown settings {unknown}; the settings are the fields of "
            f"DemoSettings: {sorted(asdict(DEFAULTS))}"
        )
    settings = replace(DEFAULTS, **overrides, steps=steps, seed=seed, beta=beta)
    _check_settings(settings)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out must be a folder, got out={str(out)!r}, which is a file")
    check_dependencies(plot=plot)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    with _torch_threads(settings.threads):
        data = load_digits_split(settings.seed, settings.test_fraction, settings.label_noise)
        posthoc_dir = out / POSTHOC_DIR
        if posthoc_dir.is_dir():
            # The demo's own folder: a rerun starts afresh instead of resuming into the
            # previous run's snapshots.
            shutil.rmtree(posthoc_dir)
        if progress:
            result = _train_with_progress(settings, data, console, posthoc_dir)
        else:
            result = train(settings, data, posthoc_folder=posthoc_dir)
    final = result["final"]
    elapsed = time.perf_counter() - start

    tracked_posthoc = settings.posthoc_every > 0
    files = {
        "summary": SUMMARY_NAME,
        "plot": PLOT_NAME if plot else None,
        "posthoc_snapshots": POSTHOC_DIR if tracked_posthoc else None,
    }
    summary: dict[str, Any] = {
        **summary_metrics(final),
        "results": final,
        "settings": {**asdict(settings), "n_train": len(data[1]), "n_test": len(data[3])},
        "posthoc": _posthoc_settings(settings) if tracked_posthoc else None,
        "versions": _versions(),
        "elapsed_s": round(elapsed, 3),
        "files": files,
        "history": result["history"],
    }
    # Each file goes to a temporary file in ``out`` first, then os.replace (emakit._files.atomic).
    if plot:
        atomic_write_bytes(out / PLOT_NAME, plot_history(result["history"], settings))
    else:
        # A plot left by an earlier run would no longer match summary.json.
        (out / PLOT_NAME).unlink(missing_ok=True)
    atomic_write_bytes(out / SUMMARY_NAME, (json.dumps(summary, indent=2) + "\n").encode())

    if progress:
        from rich.console import Console

        console = console or Console()
        console.print(
            results_table(final, title=f"emakit demo: {settings.steps} steps, seed {settings.seed}")
        )
        console.print(
            f"wrote {out / SUMMARY_NAME}"
            + (f" and {out / PLOT_NAME}" if plot else "")
            + f" in {elapsed:.1f} s",
            soft_wrap=True,
        )
        if tracked_posthoc:
            console.print(
                f"post-hoc EMA snapshots: {posthoc_dir} (emakit inspect {posthoc_dir}; "
                f"emakit synthesize {posthoc_dir} --sigma-rel 0.15 --out ema.safetensors)",
                soft_wrap=True,
                highlight=False,
            )
    return summary


# -- helpers of run_demo ----------------------------------------------------------------


def _check_settings(s: DemoSettings) -> None:
    def bad(name: str, value: object, want: str) -> ValueError:
        return ValueError(f"{name} must be {want}, got {name}={value!r}")

    for name in ("steps", "batch_size", "eval_every", "update_every", "threads"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad(name, v, "an integer >= 1")
    for name, high in (("seed", 2**32 - 1), ("update_after_step", math.inf)):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= high:
            raise bad(
                name, v, "an integer >= 0" if high == math.inf else f"an integer in [0, {high}]"
            )
    for name, low, high in (("beta", 0.0, 1.0), ("label_noise", 0.0, 1.0)):
        v = getattr(s, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
            raise bad(name, v, f"in [{low}, {high}]")
    for name in ("lr", "power", "test_fraction"):
        v = getattr(s, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise bad(name, v, "a positive number")
    if s.test_fraction >= 1:
        raise bad("test_fraction", s.test_fraction, "in (0, 1)")


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    # A tiny model on a few threads: more threads only add synchronization overhead.
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _train_with_progress(
    settings: DemoSettings,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    console: Any,
    posthoc_folder: Path | None = None,
) -> dict[str, Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[status]}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("training", total=settings.steps, status="")

        def on_eval(step: int, metrics: Mapping[str, Mapping[str, float]]) -> None:
            status = "  ".join(
                f"{MODEL_LABELS[k]} {100 * m['accuracy']:.1f}%" for k, m in metrics.items()
            )
            bar.update(task, status=status)

        def on_step(step: int) -> None:
            bar.update(task, completed=step)

        return train(
            settings, data, on_eval=on_eval, on_step=on_step, posthoc_folder=posthoc_folder
        )


def _posthoc_settings(settings: DemoSettings) -> dict[str, Any]:
    """The post-hoc EMA's settings, as ``summary.json`` records them."""
    return {
        "sigma_rels_tracked": list(POSTHOC_TRACKED),
        "sigma_rel_synthesized": POSTHOC_SIGMA_REL,
        "synthesized_at_step": settings.steps,
        "update_every": 1,
        "checkpoint_every_num_steps": settings.posthoc_every,
        "snapshot_folder": POSTHOC_DIR,
    }


def _versions() -> dict[str, str]:
    return {"emakit": __version__, "torch": torch.__version__, "python": platform.python_version()}
