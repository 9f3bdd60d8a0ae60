"""The ``emakit demo``: online weights vs their EMA on a noisy training run.

A small convnet learns scikit-learn's bundled digits (8x8 images, 1797 samples, no
download) with deliberately noisy SGD: a small batch, a high constant learning rate and
a fraction of the training labels flipped. The online weights keep jittering around a
good solution; an [`EMA`][emakit.EMA] of them averages the jitter out. The demo
evaluates both on a held-out split while training and reports the final numbers.

Everything here is a plain function (`run_demo()` is the entry point) so it can be
tested without the command line. scikit-learn, matplotlib and rich are loaded only when
the demo runs (they are the ``emakit[demo]`` extra); ``import emakit`` never loads them.

This package only re-exports, lazily (``import emakit.demo`` loads neither torch nor an
extra; each name is imported on first use, so type checkers see these names as ``Any``:
import them from their module for types); the code lives in four modules, imported one
way (``runner`` -> ``report`` and ``training`` -> ``settings``):

* `emakit.demo.settings`: the settings and their defaults (no third-party import).
* `emakit.demo.training`: data, model, evaluation and the training loop.
* `emakit.demo.report`: summary keys, the rich results table and the matplotlib plot.
* `emakit.demo.runner`: `run_demo()`, the dependency check and the output folder.

Example:
    >>> from pathlib import Path
    >>> summary = run_demo(Path("demo-out"), steps=200, progress=False)  # doctest: +SKIP
    >>> summary["ema_accuracy"] >= 0.0  # doctest: +SKIP
    True
"""

from __future__ import annotations

from .._lazy import lazy_attributes

# The names each module exports, imported on first access.
_MODULES = {
    "report": ("TABLE_ROWS", "history_figure", "plot_history", "results_table", "summary_metrics"),
    "runner": (
        "INSTALL_HINT",
        "PLOT_NAME",
        "POSTHOC_DIR",
        "SUMMARY_NAME",
        "DemoDependencyError",
        "check_dependencies",
        "new_output_dir",
        "run_demo",
    ),
    "settings": (
        "DEFAULTS",
        "MODEL_LABELS",
        "POSTHOC_SIGMA_REL",
        "POSTHOC_TRACKED",
        "DemoSettings",
    ),
    "training": (
        "evaluate",
        "held_out_loss",
        "late_statistics",
        "load_digits_split",
        "make_model",
        "train",
    ),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
__all__ = sorted(_EXPORTS)
