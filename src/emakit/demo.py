"""The ``emakit demo``: online weights vs their EMA on a noisy training run.

A small convnet learns scikit-learn's bundled digits (8x8 images, 1797 samples, no
download) with deliberately noisy SGD: a small batch, a high constant learning rate and
a fraction of the training labels flipped. The online weights keep jittering around a
good solution; an :class:`~emakit.EMA` of them averages the jitter out. The demo
evaluates both on a held-out split while training and reports the final numbers.

Everything here is a plain function (:func:`run_demo` is the entry point) so it can be
tested without the command line. scikit-learn, matplotlib and rich are loaded only when
the demo runs (they are the ``emakit[demo]`` extra); ``import emakit`` never loads them.

Example:
    >>> from pathlib import Path
    >>> summary = run_demo(Path("demo-out"), steps=200, progress=False)  # doctest: +SKIP
    >>> summary["ema_accuracy"] >= 0.0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._io import atomic_write_bytes

__all__ = [
    "DEFAULTS",
    "INSTALL_HINT",
    "MODEL_LABELS",
    "PLOT_NAME",
    "SUMMARY_NAME",
    "TABLE_ROWS",
    "DemoDependencyError",
    "DemoSettings",
    "check_dependencies",
    "evaluate",
    "late_statistics",
    "load_digits_split",
    "make_model",
    "new_output_dir",
    "plot_history",
    "results_table",
    "run_demo",
    "summary_metrics",
    "train",
]

SUMMARY_NAME = "summary.json"
PLOT_NAME = "demo.png"
POSTHOC_DIR = "posthoc-snapshots"
INSTALL_HINT = 'pip install "emakit[demo]"'

#: Display names of the evaluated models, in table/plot order. A new model (e.g. a
#: post-hoc EMA) is one more entry here plus one more entry in the evaluators that
#: :func:`run_demo` builds; the table, the summary keys and the plot follow.
MODEL_LABELS: dict[str, str] = {"online": "online", "ema": "EMA", "posthoc": "post-hoc EMA"}

#: Relative EMA length synthesized after training from the post-hoc snapshots. It lies
#: between the two tracked profiles (0.05 and 0.28), so the column shows a length that was
#: never tracked directly; it is fixed in advance, not picked on the held-out set.
POSTHOC_SIGMA_REL = 0.10
POSTHOC_TRACKED = (0.05, 0.28)


class DemoDependencyError(ImportError):
    """A package of the ``emakit[demo]`` extra is missing."""


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines a demo run (all of it is written to the summary).

    Attributes:
        steps: optimizer steps. Default 1500.
        seed: seeds the train/test split, the label noise, the initial weights and the
            batch order. Default 0.
        beta: ceiling of the EMA decay. Default 0.995 (a horizon of ~200 steps).
        update_after_step: EMA copies the model until this step. Default 100.
        update_every: EMA averages every this many steps. Default 1.
        power: exponent of the inverse-gamma warm-up. Default 3/4 (the value timm and
            diffusers recommend for short runs).
        lr: constant SGD learning rate (no momentum), high on purpose. Default 0.1.
        batch_size: examples per step, small on purpose. Default 16.
        label_noise: fraction of training labels replaced by a random class. Default 0.2.
        test_fraction: fraction of the digits held out for evaluation. Default 0.3.
        eval_every: steps between held-out evaluations. Default 50.
        posthoc_every: steps between post-hoc EMA snapshots (profiles sigma_rel 0.05 and
            0.28, updated every step); after training the demo synthesizes sigma_rel 0.10
            from them. 0 turns the post-hoc column off. Default 100.
        threads: torch CPU threads during the run. Default 1: the model is so small that
            intra-op parallelism costs more in synchronization than it saves, and on a
            busy machine extra threads slow the run down many times over.
    """

    steps: int = 1500
    seed: int = 0
    beta: float = 0.995
    update_after_step: int = 100
    update_every: int = 1
    power: float = 3 / 4
    lr: float = 0.1
    batch_size: int = 16
    label_noise: float = 0.2
    test_fraction: float = 0.3
    eval_every: int = 50
    posthoc_every: int = 100
    threads: int = 1


DEFAULTS = DemoSettings()


# -- dependencies ------------------------------------------------------------------------


def check_dependencies(*, plot: bool = True) -> None:
    """Raise :class:`DemoDependencyError` naming every missing demo package.

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


# -- files -----------------------------------------------------------------------------


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


# -- data and model -------------------------------------------------------------------------


def load_digits_split(
    seed: int, test_fraction: float = DEFAULTS.test_fraction, label_noise: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The digits, scaled to [0, 1], split into train and held-out parts by ``seed``.

    The split is stratified and depends only on ``seed`` and ``test_fraction``. Label
    noise touches the training labels only: each is replaced, with probability
    ``label_noise``, by a uniformly random class (which may be the true one).

    Args:
        seed: seeds the split and the label noise.
        test_fraction: fraction held out. Default 0.3.
        label_noise: probability of replacing a training label. Default 0.0.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; images are ``(N, 1, 8, 8)`` float32,
        labels int64.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    x_train, y_train = x[idx_train], y[idx_train].clone()
    x_test, y_test = x[idx_test], y[idx_test]
    if label_noise > 0:
        g = torch.Generator().manual_seed(seed + 1)
        flip = torch.rand(len(y_train), generator=g) < label_noise
        y_train[flip] = torch.randint(0, 10, (int(flip.sum()),), generator=g)
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Module:
    """A small convnet for 1x8x8 images: two 3x3 convolutions, a max-pool, a linear head.

    Returns:
        The module (about 10k parameters), freshly initialized from torch's global RNG.
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


@torch.no_grad()
def evaluate(forward: Callable[[Tensor], Tensor], x: Tensor, y: Tensor) -> dict[str, float]:
    """Held-out accuracy and mean cross-entropy of ``forward`` on ``(x, y)``.

    Args:
        forward: maps a batch of images to logits (the caller sets eval mode).
        x: images.
        y: labels.

    Returns:
        ``{"accuracy": ..., "loss": ...}`` as Python floats.
    """
    logits = forward(x)
    return {
        "accuracy": int((logits.argmax(1) == y).sum()) / len(y),
        "loss": F.cross_entropy(logits, y).item(),
    }


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    # A tiny model on a few threads: more threads only add synchronization overhead.
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -- training ---------------------------------------------------------------------------


def train(
    settings: DemoSettings,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    on_eval: Callable[[int, Mapping[str, Mapping[str, float]]], None] | None = None,
    on_step: Callable[[int], None] | None = None,
    posthoc_folder: Path | None = None,
) -> dict[str, Any]:
    """Train the online model with noisy SGD and track its EMA.

    Args:
        settings: the run's settings.
        data: ``(x_train, y_train, x_test, y_test)`` from :func:`load_digits_split`.
        on_eval: called as ``on_eval(step, metrics)`` after each held-out evaluation,
            ``metrics`` mapping each key of :data:`MODEL_LABELS` to its metrics.
        on_step: called as ``on_step(step)`` after each optimizer step and EMA update.
        posthoc_folder: where the post-hoc EMA writes its snapshots; None (or
            ``settings.posthoc_every == 0``) skips the post-hoc model.

    Returns:
        ``{"final": {model: {"accuracy", "loss"}}, "history": {...}}`` where the
        history holds the evaluation steps, each model's accuracy and loss at those
        steps, and the EMA decay at every step.
    """
    from . import EMA

    x_train, y_train, x_test, y_test = data
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        net = make_model()
    ema = EMA(
        net,
        beta=settings.beta,
        update_after_step=settings.update_after_step,
        update_every=settings.update_every,
        power=settings.power,
    )
    opt = torch.optim.SGD(net.parameters(), lr=settings.lr)
    g = torch.Generator().manual_seed(settings.seed + 2)
    posthoc = None
    if posthoc_folder is not None and settings.posthoc_every > 0:
        from .posthoc import PostHocEMA

        posthoc = PostHocEMA(
            net,
            sigma_rels=POSTHOC_TRACKED,
            update_every=1,
            checkpoint_every_num_steps=settings.posthoc_every,
            checkpoint_folder=posthoc_folder,
        )

    def online(x: Tensor) -> Tensor:
        net.eval()
        try:
            logits: Tensor = net(x)
        finally:
            net.train()
        return logits

    evaluators: dict[str, Callable[[Tensor], Tensor]] = {"online": online, "ema": ema}
    tracked = ["online", "ema"]  # evaluated during training; post-hoc only at the end
    history: dict[str, list[float]] = {"step": [], "decay": []}
    for key in tracked:
        history[f"{key}_accuracy"] = []
        history[f"{key}_loss"] = []

    def record(step: int) -> dict[str, dict[str, float]]:
        metrics = {key: evaluate(evaluators[key], x_test, y_test) for key in tracked}
        history["step"].append(step)
        for key, m in metrics.items():
            history[f"{key}_accuracy"].append(m["accuracy"])
            history[f"{key}_loss"].append(m["loss"])
        if on_eval is not None:
            on_eval(step, metrics)
        return metrics

    n = len(y_train)
    perm = torch.randperm(n, generator=g)
    cursor = 0
    net.train()
    metrics: dict[str, dict[str, float]] = {}
    for step in range(1, settings.steps + 1):
        if cursor + settings.batch_size > n:
            perm, cursor = torch.randperm(n, generator=g), 0
        idx = perm[cursor : cursor + settings.batch_size]
        cursor += settings.batch_size
        loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        ema.update()
        if posthoc is not None:
            posthoc.update()
        history["decay"].append(ema.get_current_decay())
        if on_step is not None:
            on_step(step)
        if step % settings.eval_every == 0 or step == settings.steps:
            metrics = record(step)
    final = {key: {**metrics[key], **late_statistics(history, key)} for key in metrics}
    if posthoc is not None:
        if not any(snap.step == settings.steps for snap in posthoc.snapshots()):
            posthoc.checkpoint()  # the synthesis targets the final step
        synthesized = posthoc.synthesize_ema_model(sigma_rel=POSTHOC_SIGMA_REL)
        final["posthoc"] = evaluate(synthesized, x_test, y_test)
    return {"final": final, "history": history}


def late_statistics(history: Mapping[str, Sequence[float]], key: str) -> dict[str, float]:
    """Mean and standard deviation of a model's held-out accuracy over the second half of
    training: a final accuracy is one noisy sample, these show the level and the jitter.

    Args:
        history: the evaluation history (``step`` and ``<key>_accuracy`` lists).
        key: the model key, e.g. ``"online"``.

    Returns:
        ``{"accuracy_late_mean": ..., "accuracy_late_std": ...}`` over the evaluations at
        steps greater than half the last evaluated step (population std; 0 for one value).
    """
    steps = history["step"]
    half = steps[-1] / 2 if steps else 0
    acc = [a for s, a in zip(steps, history[f"{key}_accuracy"], strict=True) if s > half]
    if not acc:
        return {}
    mean = sum(acc) / len(acc)
    std = math.sqrt(sum((a - mean) ** 2 for a in acc) / len(acc))
    return {"accuracy_late_mean": mean, "accuracy_late_std": std}


# -- reporting --------------------------------------------------------------------------------


def summary_metrics(final: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Flatten ``{model: {metric: value}}`` into ``{"<model>_<metric>": value}``.

    Args:
        final: final metrics per model key.

    Returns:
        e.g. ``{"online_accuracy": 0.95, "online_loss": 0.2, "ema_accuracy": ...}``.
    """
    return {f"{key}_{name}": value for key, m in final.items() for name, value in m.items()}


#: Rows of the results table: ``(metric, label, format, higher_is_better)``. A model that
#: lacks a metric (e.g. one evaluated only at the end) shows a dash in that row.
TABLE_ROWS: tuple[tuple[str, str, Callable[[float], str], bool | None], ...] = (
    ("accuracy", "accuracy (final)", lambda v: f"{100 * v:.2f}%", True),
    ("loss", "loss (final, cross-entropy)", lambda v: f"{v:.4f}", False),
    ("accuracy_late_mean", "accuracy (mean, 2nd half)", lambda v: f"{100 * v:.2f}%", True),
    ("accuracy_late_std", "accuracy (std, 2nd half)", lambda v: f"{100 * v:.2f}%", None),
)


def results_table(final: Mapping[str, Mapping[str, float]], title: str | None = None) -> Any:
    """A rich table with one column per model and one row per held-out metric.

    Args:
        final: metrics per model key (keys of :data:`MODEL_LABELS`, in that order).
        title: the table title. Default None.

    Returns:
        A ``rich.table.Table``; the best value of each ranked row is bold.
    """
    from rich.table import Table

    table = Table(title=title)
    table.add_column("held-out")
    keys = [k for k in MODEL_LABELS if k in final]
    for key in keys:
        table.add_column(MODEL_LABELS[key], justify="right")
    for metric, label, fmt, higher_is_better in TABLE_ROWS:
        values = [final[k].get(metric) for k in keys]
        present = [v for v in values if v is not None]
        if not present:
            continue
        best = None
        if higher_is_better is not None and len(present) > 1:
            best = max(present) if higher_is_better else min(present)
        cells = [
            "-" if v is None else f"[bold]{fmt(v)}[/bold]" if v == best else fmt(v) for v in values
        ]
        table.add_row(label, *cells)
    return table


def plot_history(history: Mapping[str, Sequence[float]], settings: DemoSettings) -> bytes:
    """Render the PNG: held-out accuracy of each model over training, and the EMA decay.

    Args:
        history: the ``history`` returned by :func:`train`.
        settings: the run's settings (for titles).

    Returns:
        The PNG file's bytes.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.4), layout="constrained")
    acc_ax, decay_ax = fig.subplots(1, 2)
    warm = settings.update_after_step
    for ax in (acc_ax, decay_ax):
        # Until update_after_step the EMA is a plain copy of the model.
        ax.axvspan(0, warm, color="0.9", zorder=0, label="EMA copies (warm-up)")
        ax.grid(alpha=0.3)
    for key, label in MODEL_LABELS.items():
        if f"{key}_accuracy" not in history:
            continue  # evaluated once, after training (the post-hoc EMA)
        acc_ax.plot(
            history["step"],
            [100 * a for a in history[f"{key}_accuracy"]],
            label=label,
            linewidth=2 if key != "online" else 1.2,
        )
    acc_ax.set(
        xlabel="optimizer step",
        ylabel="held-out accuracy (%)",
        title=f"held-out accuracy: noisy SGD (lr {settings.lr:g}, batch "
        f"{settings.batch_size},\n{settings.label_noise:.0%} label noise), seed {settings.seed}",
    )
    acc_ax.legend(loc="lower right")
    n_eval = len(history["step"])
    if n_eval:
        tail = [
            100 * a
            for key in MODEL_LABELS
            for a in history.get(f"{key}_accuracy", [])[n_eval // 4 :]
        ]
        acc_ax.set_ylim(max(0.0, min(tail) - 3), 100.5)

    # A logit axis spreads 0.9, 0.99, 0.999 evenly; the warm-up's zero decay is masked.
    steps = list(range(1, len(history["decay"]) + 1))
    decay_ax.plot(steps, history["decay"], color="tab:orange", linewidth=2, label="decay")
    averaged = [d for d in history["decay"] if 0 < d < 1]
    if averaged:  # a run that ends within the warm-up has nothing to spread out
        decay_ax.set_yscale("logit", nonpositive="mask")
        ticks = sorted({0.5, 0.9, 0.99, 0.999, 0.9999} | ({settings.beta} - {0.0, 1.0}))
        decay_ax.set_yticks(ticks, labels=[f"{t:g}" for t in ticks])
        decay_ax.set_yticks([], minor=True)
        top = max(max(averaged), settings.beta if settings.beta < 1 else 0)
        decay_ax.set_ylim(min(0.3, min(averaged)), 1 - (1 - top) / 3)
    if 0 < settings.beta < 1:
        decay_ax.axhline(settings.beta, color="gray", linestyle="--", linewidth=1, label="beta")
    decay_ax.set(
        xlabel="optimizer step",
        ylabel="EMA decay",
        title=f"decay schedule: inverse gamma, power {settings.power:.3g}, beta "
        f"{settings.beta:g},\nupdate_after_step {warm}, update_every {settings.update_every}",
    )
    decay_ax.legend(loc="lower right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _versions() -> dict[str, str]:
    from ._version import __version__

    return {"emakit": __version__, "torch": torch.__version__, "python": platform.python_version()}


# -- entry point ------------------------------------------------------------------------------


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
    """Run the demo and write ``out/summary.json`` (and ``out/demo.png``).

    ``out`` is created if missing. If it exists, the demo's own files in it are replaced
    (atomically; its ``posthoc-snapshots`` folder is emptied and rewritten) and every other
    file is left alone.

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
        **overrides: any other field of :class:`DemoSettings` (e.g. ``lr=0.05``).

    Returns:
        The summary written to ``summary.json``: ``online_accuracy``, ``ema_accuracy``,
        ``online_loss``, ``ema_loss``, ``results`` (per model), ``settings``,
        ``versions``, ``history``, ``elapsed_s`` and ``files``.

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

    files = {"summary": SUMMARY_NAME, "plot": PLOT_NAME if plot else None}
    summary: dict[str, Any] = {
        **summary_metrics(final),
        "results": final,
        "settings": {**asdict(settings), "n_train": len(data[1]), "n_test": len(data[3])},
        "versions": _versions(),
        "elapsed_s": round(elapsed, 3),
        "files": files,
        "history": result["history"],
    }
    # Each file goes to a temporary file in ``out`` first, then os.replace (emakit._io).
    if plot:
        atomic_write_bytes(out / PLOT_NAME, plot_history(result["history"], settings))
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
            + f" in {elapsed:.1f} s"
        )
    return summary


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
