"""Reporting for the ``emakit demo``: the summary keys, the results table and the plot.

This module owns how a finished run is presented: `summary_metrics()` flattens the
final metrics into the summary's top-level keys, `results_table()` builds the rich
table (rows from `TABLE_ROWS`) and `plot_history()` renders ``demo.png``.
rich and matplotlib are imported only inside the functions that use them.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .settings import MODEL_LABELS, DemoSettings

__all__ = ["TABLE_ROWS", "history_figure", "plot_history", "results_table", "summary_metrics"]


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
        final: metrics per model key (keys of `MODEL_LABELS`, in that order).
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


def plot_history(
    history: Mapping[str, Sequence[float]],
    settings: DemoSettings,
    final: Mapping[str, Mapping[str, float]] | None = None,
) -> bytes:
    """Render the PNG of `history_figure()`.

    Returns:
        The PNG file's bytes.
    """
    buf = io.BytesIO()
    history_figure(history, settings, final).savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def history_figure(
    history: Mapping[str, Sequence[float]],
    settings: DemoSettings,
    final: Mapping[str, Mapping[str, float]] | None = None,
) -> Any:
    """The picture of a run (a matplotlib ``Figure``): held-out accuracy of each model over
    training, every evaluation inside the axes, with the post-hoc EMA (synthesized once,
    after training) as a star at the last step; and the EMA decay.

    Args:
        history: the ``history`` returned by `train()`.
        settings: the run's settings (for titles).
        final: the final metrics per model (``train()["final"]``), for the models
            evaluated only after training. Default None: none drawn.
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
    shown: list[float] = []  # every accuracy drawn, so that the axes hold them all
    last = history["step"][-1] if history["step"] else settings.steps
    for key, label in MODEL_LABELS.items():
        if f"{key}_accuracy" in history:
            values = [100 * a for a in history[f"{key}_accuracy"]]
            acc_ax.plot(
                history["step"], values, label=label, linewidth=2 if key != "online" else 1.2
            )
        elif final is not None and "accuracy" in final.get(key, {}):
            # evaluated once, after training (the post-hoc EMA): a star at the last step
            values = [100 * final[key]["accuracy"]]
            acc_ax.plot(
                [last], values, "*", markersize=14, color="tab:red", zorder=5,
                label=f"{label} (synthesized after training)",
            )  # fmt: skip
        else:
            continue
        shown += values
    acc_ax.set(
        xlabel="optimizer step",
        ylabel="held-out accuracy (%)",
        title=f"held-out accuracy: noisy SGD (lr {settings.lr:g}, batch "
        f"{settings.batch_size},\n{settings.label_noise:.0%} label noise), seed {settings.seed}",
    )
    acc_ax.legend(loc="lower right")
    if shown:
        acc_ax.set_ylim(max(0.0, min(shown) - 3), 100.5)

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
    return fig
