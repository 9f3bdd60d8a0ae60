"""The ``emakit`` command line.

``emakit`` is a click group: a subcommand is one ``@main.command()`` function here (or
one ``main.add_command(cmd)`` for a command defined elsewhere). Optional extras
(scikit-learn, matplotlib, rich) are imported only when a command runs, so
``emakit --help`` works without them and a missing extra becomes a one-line error with
the install command instead of a traceback.

Example:
    .. code-block:: console

        $ emakit demo --steps 500 --seed 1 --out demo-run
        $ python -m emakit --version
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from . import __version__
from .demo import DEFAULTS, DemoDependencyError, check_dependencies, new_output_dir, run_demo

__all__ = ["main"]


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through: every comparison with NaN is False.
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number.", ctx=ctx, param=param)
    return value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="emakit")
def main() -> None:
    """emakit: exponential moving averages of PyTorch model weights.

    Run `emakit COMMAND --help` for the options of a command.
    """


@main.command(short_help="Train on the digits with noisy SGD: online vs EMA accuracy.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, dir_okay=True, writable=True, path_type=Path),
    default=None,
    help="Folder for summary.json and demo.png; created if missing. If it exists, the "
    "demo's own two files in it are replaced and other files are left alone. "
    "[default: a new folder emakit-demo-YYYYmmdd-HHMMSS in the current directory]",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=DEFAULTS.steps,
    show_default=True,
    help="Optimizer steps to train for.",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0, max=2**32 - 1),
    default=DEFAULTS.seed,
    show_default=True,
    help="Seed of the train/test split, the label noise, the initial weights and the batch order.",
)
@click.option(
    "--beta",
    type=click.FloatRange(min=0.0, max=1.0),
    default=DEFAULTS.beta,
    callback=_finite,
    show_default=True,
    help="Ceiling of the EMA decay (1/(1-beta) ~ the averaging horizon in steps).",
)
@click.option(
    "--no-plot",
    is_flag=True,
    default=False,
    help="Do not write demo.png (matplotlib is then not needed).",
)
def demo(out: Path | None, steps: int, seed: int, beta: float, no_plot: bool) -> None:
    """Train a small convnet on scikit-learn's digits with noisy SGD, online vs EMA.

    The digits ship inside scikit-learn: nothing is downloaded. Training shows a
    progress bar, then prints the held-out accuracy and loss of the online weights and
    of their EMA, and writes OUT/summary.json and OUT/demo.png (accuracy curves and the
    decay schedule). Needs the demo extra: pip install "emakit[demo]".
    """
    try:
        check_dependencies(plot=not no_plot)
    except DemoDependencyError as e:
        raise click.ClickException(str(e)) from None
    created = out is None
    if out is None:
        out = new_output_dir()
    try:
        run_demo(out, steps=steps, seed=seed, beta=beta, plot=not no_plot)
    except NotADirectoryError as e:
        raise click.BadParameter(str(e), param_hint="'--out'") from None
    except OSError as e:
        raise click.ClickException(f"could not write the demo's files to {out}: {e}") from None
    finally:
        # A folder we named and that stayed empty (interrupted run) is not worth keeping.
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
