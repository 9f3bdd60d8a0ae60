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

from ._version import __version__
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


@main.command(short_help="Time one EMA update per engine path vs the memory-bandwidth floor.")
@click.option(
    "--model",
    type=click.Choice(["tiny", "transformer", "mlp", "resnet"]),
    default="tiny",
    show_default=True,
    help="tiny: 1200 small tensors; transformer: 12 encoder layers (21M); mlp: 6 x 2048^2; "
    "resnet: torchvision ResNet-50.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the model and its EMA live.",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Timed calls per path; the median is reported.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch CPU threads (default: torch's own choice). On a busy machine 1 gives "
    "steadier numbers.",
)
def bench(model: str, device: str, repeats: int, threads: int | None) -> None:
    """Time one averaging update() of each engine path on a standard model.

    The floor is one lerp_ over a flat tensor with as many elements: the cost of streaming
    the weights through memory once. A ratio near 1.0 is as fast as an update can be.
    """
    import torch

    from .bench import MODELS, bench_update
    from .errors import EMAError

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        rows = bench_update(model, device, repeats)
    except EMAError as e:
        raise click.ClickException(str(e)) from e
    click.echo(
        f"{MODELS[model][0]} on {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, median of {repeats}"
    )
    click.echo(f"{'path':<36}{'time':>12}{'x floor':>10}")
    for label, seconds, ratio in rows:
        click.echo(f"{label:<36}{seconds * 1e6:>10.0f}us{ratio:>10.2f}")


def _register_posthoc_commands() -> None:
    from .posthoc.commands import inspect_cmd, synthesize

    main.add_command(synthesize)
    main.add_command(inspect_cmd)


_register_posthoc_commands()
