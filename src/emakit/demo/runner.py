"""Entry point of the ``emakit demo``: `run_demo()` and its output folder.

This module owns a run from start to finish: the demo extra's dependency check
(`check_dependencies()`, `DemoDependencyError`), the output folder
(`new_output_dir()` and the file names `SUMMARY_NAME`, `PLOT_NAME`,
`POSTHOC_DIR`), validating the settings, the progress bar, and writing
``summary.json`` and ``demo.png`` atomically. It builds on `emakit.demo.training`
(the run itself) and `emakit.demo.report` (table, plot, summary keys); rich is
imported only inside `run_demo()`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.util
import json
import os
import platform
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from .. import _validate as check
from .._files.atomic import atomic_write_bytes
from .._version import __version__
from ..posthoc.evaluations import EVAL_FILE_NAME, write_eval_file
from .report import plot_history, results_table, summary_metrics
from .settings import (
    DEFAULTS,
    MODEL_LABELS,
    POSTHOC_SIGMA_REL,
    POSTHOC_TRACKED,
    SEED_RANGE,
    TEST_FRACTION_RANGE,
    DemoSettings,
)
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
INSTALL_HINT = (
    'pip install scikit-learn matplotlib rich (in a clone of emakit: pip install -e ".[demo]")'
)


class DemoDependencyError(ImportError):
    """A package of the ``emakit[demo]`` extra is missing."""


def check_dependencies(*, plot: bool = True) -> None:
    """Raise `DemoDependencyError` naming every missing demo package.

    Args:
        plot: also require matplotlib. Default True.

    Raises:
        DemoDependencyError: with the install command (`INSTALL_HINT`).
    """
    wanted = {"scikit-learn": "sklearn", "rich": "rich"}
    if plot:
        wanted["matplotlib"] = "matplotlib"
    missing = [dist for dist, module in wanted.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise DemoDependencyError(
            f"the demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed; install the demo extra: {INSTALL_HINT}"
        )


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
    candidate, n = base, 1
    while True:
        with contextlib.suppress(FileExistsError):
            candidate.mkdir()
            return candidate
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")


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
    """Run the demo and write ``out/summary.json``, ``out/demo.png``, the post-hoc
    snapshots in ``out/posthoc-snapshots`` and ``out/emakit-eval.json`` (the scoring that
    ``emakit sweep out`` uses without ``--eval``: `held_out_loss` on this run's split).

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
    posthoc_dir = out / POSTHOC_DIR
    if posthoc_dir.is_dir():
        # The demo's own folder: a rerun starts afresh instead of resuming into the previous
        # run's snapshots.
        shutil.rmtree(posthoc_dir)

    import rich.progress as bars
    from rich.console import Console

    columns = (
        bars.TextColumn("[progress.description]{task.description}"),
        bars.BarColumn(),
        bars.MofNCompleteColumn(),
        bars.TimeElapsedColumn(),
        bars.TimeRemainingColumn(),
        bars.TextColumn("{task.fields[status]}"),
    )
    console = console or Console()
    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    # A tiny model on a few threads: more threads only add synchronization overhead.
    torch.set_num_threads(max(1, min(settings.threads, os.cpu_count() or 1)))
    try:
        data = load_digits_split(settings.seed, settings.test_fraction, settings.label_noise)
        with bars.Progress(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task("training", total=settings.steps, status="")

            def on_eval(step: int, metrics: Mapping[str, Mapping[str, float]]) -> None:
                status = "  ".join(
                    f"{MODEL_LABELS[k]} {100 * m['accuracy']:.1f}%" for k, m in metrics.items()
                )
                bar.update(task, status=status)

            def on_step(step: int) -> None:
                bar.update(task, completed=step)

            result = train(settings, data, on_eval, on_step, posthoc_folder=posthoc_dir)
    finally:
        torch.set_num_threads(old_threads)
    final = result["final"]
    elapsed = time.perf_counter() - start

    tracked_posthoc = settings.posthoc_every > 0
    posthoc = {
        "sigma_rels_tracked": list(POSTHOC_TRACKED),
        "sigma_rel_synthesized": POSTHOC_SIGMA_REL,
        "synthesized_at_step": settings.steps,
        "update_every": 1,
        "checkpoint_every_num_steps": settings.posthoc_every,
        "snapshot_folder": POSTHOC_DIR,
    }
    summary: dict[str, Any] = {
        **summary_metrics(final),
        "results": final,
        "settings": {**asdict(settings), "n_train": len(data[1]), "n_test": len(data[3])},
        "posthoc": posthoc if tracked_posthoc else None,
        "versions": {
            "emakit": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "elapsed_s": round(elapsed, 3),
        "files": {
            "summary": SUMMARY_NAME,
            "plot": PLOT_NAME if plot else None,
            "posthoc_snapshots": POSTHOC_DIR if tracked_posthoc else None,
            "sweep_eval": EVAL_FILE_NAME if tracked_posthoc else None,
        },
        "history": result["history"],
    }
    # Each file goes to a temporary file in ``out`` first, then os.replace (emakit._files.atomic).
    if plot:
        atomic_write_bytes(out / PLOT_NAME, plot_history(result["history"], settings))
    else:
        # A plot left by an earlier run would no longer match summary.json.
        (out / PLOT_NAME).unlink(missing_ok=True)
    atomic_write_bytes(out / SUMMARY_NAME, (json.dumps(summary, indent=2) + "\n").encode())
    if tracked_posthoc:  # `emakit sweep out` scores lengths with this, without --eval
        write_eval_file(
            out,
            "emakit.demo.training:held_out_loss",
            seed=settings.seed,
            test_fraction=settings.test_fraction,
        )
    else:
        (out / EVAL_FILE_NAME).unlink(missing_ok=True)  # it would score an older run

    if progress:
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
                f"emakit synthesize {posthoc_dir} --sigma-rel 0.15 --out ema.safetensors; "
                f"emakit sweep {out} --sigma-rel 0.03:0.25:8)",
                soft_wrap=True,
                highlight=False,
            )
    return summary


def _check_settings(s: DemoSettings) -> None:
    """Refuse a setting out of range (an EMAValueError, which is a ValueError, naming it)."""
    for name in ("steps", "batch_size", "eval_every", "update_every", "threads"):
        check.integer(name, getattr(s, name), low=1)
    check.integer("seed", s.seed, low=SEED_RANGE[0], high=SEED_RANGE[1])
    check.integer("update_after_step", s.update_after_step, low=0)
    for name in ("beta", "label_noise"):
        check.real(name, getattr(s, name), low=0.0, high=1.0)
    for name in ("lr", "power"):
        check.real(name, getattr(s, name), low=0.0, low_open=True)
    check.real(
        "test_fraction", s.test_fraction, low=TEST_FRACTION_RANGE[0], high=TEST_FRACTION_RANGE[1]
    )
