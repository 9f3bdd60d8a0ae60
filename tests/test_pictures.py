"""The pictures show every curve they name, on axes that hold them (issue 41, item 6):
the demo's accuracy plot (every evaluation inside the axes, the post-hoc EMA drawn) and the
sweep's plot (its y-axis names the score and which way is better)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from emakit.demo.settings import DEFAULTS, MODEL_LABELS
from emakit.posthoc.synthesis.sweep import SweepResult

pytest.importorskip("matplotlib")

from emakit.demo.report import history_figure, plot_history

HISTORY = {
    "step": [50, 100, 150, 200, 250, 300, 350, 400],
    "online_accuracy": [0.11, 0.35, 0.80, 0.90, 0.92, 0.93, 0.94, 0.95],
    "ema_accuracy": [0.10, 0.30, 0.78, 0.91, 0.95, 0.96, 0.96, 0.97],
    "decay": [0.0] * 100 + [0.5 + 0.001 * i for i in range(300)],
}
FINAL = {
    "online": {"accuracy": 0.95, "loss": 0.2},
    "ema": {"accuracy": 0.97, "loss": 0.1},
    "posthoc": {"accuracy": 0.965, "loss": 0.12},
}


def accuracy_axes(fig):
    return next(ax for ax in fig.axes if ax.get_ylabel() == "held-out accuracy (%)")


def test_every_evaluation_lies_inside_the_accuracy_axes() -> None:
    ax = accuracy_axes(history_figure(HISTORY, DEFAULTS, FINAL))
    low, high = ax.get_ylim()
    drawn = [y for line in ax.get_lines() for y in line.get_ydata()]
    assert drawn and all(low <= y <= high for y in drawn)
    assert low <= 10.0  # the first evaluations (10-11 %) are shown, not cut off


def test_the_post_hoc_ema_is_drawn_at_the_last_step() -> None:
    ax = accuracy_axes(history_figure(HISTORY, DEFAULTS, FINAL))
    labels = {line.get_label(): line for line in ax.get_lines()}
    star = labels[f"{MODEL_LABELS['posthoc']} (synthesized after training)"]
    assert list(star.get_xdata()) == [400] and list(star.get_ydata()) == [96.5]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all(label in " ".join(legend) for label in MODEL_LABELS.values())
    without = accuracy_axes(history_figure(HISTORY, DEFAULTS))  # no final metrics: no star
    assert not any("post-hoc" in str(line.get_label()) for line in without.get_lines())


def test_the_png_renders(tmp_path: Path) -> None:
    png = plot_history(HISTORY, DEFAULTS, FINAL)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


@pytest.mark.parametrize(("mode", "better"), [("min", "lower"), ("max", "higher")])
def test_the_sweeps_y_axis_names_its_score(tmp_path: Path, mode: str, better: str) -> None:
    result = SweepResult(((0.05, 1.0), (0.1, 0.5)), 100, (0.05, 0.28), mode, "my.loss")  # type: ignore[arg-type]
    ax = result.figure().axes[0]
    assert ax.get_ylabel() == f"my.loss ({better} is better)"
    assert result.figure(ylabel="FID").axes[0].get_ylabel() == "FID"
    out = result.plot(tmp_path / "sweep.png")
    assert out.read_bytes().startswith(b"\x89PNG") and not list(tmp_path.glob(".*tmp*"))
    nan = SweepResult(((0.05, math.nan),), 1, (), mode)  # type: ignore[arg-type]
    assert nan.figure().axes[0].get_ylabel() == f"score ({better} is better)"


@pytest.mark.filterwarnings("ignore::emakit.posthoc.math.PostHocWarning")  # a short run
def test_a_sweep_names_its_function_on_the_plot(tmp_path: Path) -> None:
    """The sweep records the scoring function's name (a partial's function's)."""
    import functools

    import torch

    from emakit import PostHocEMA
    from emakit.posthoc import sweep

    net = torch.nn.Linear(2, 2)
    ema = PostHocEMA(net, checkpoint_every_num_steps=5, checkpoint_folder=tmp_path / "s")
    for _ in range(20):
        ema.update()

    def loss(state, scale=1.0):
        return scale

    result = sweep(
        tmp_path / "s", functools.partial(loss, scale=2.0), [0.1], plot=tmp_path / "p.png"
    )
    assert result.score_name == f"{__name__}.{loss.__qualname__}"
    assert result.figure().axes[0].get_ylabel().startswith(f"{__name__}.")
