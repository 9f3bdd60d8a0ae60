"""The ``emakit`` command line.

``emakit`` is a click group: a subcommand is one ``@main.command()`` function here, or
one entry of ``_LAZY_COMMANDS`` for a command of a module that imports torch
(``synthesize`` and ``sweep`` of `emakit.posthoc.commands`, ``inspect`` of
`emakit.inspection`, ``convert`` of `emakit.posthoc.convert`). This module imports only click and
torch-free parts of emakit: torch, the extras (scikit-learn, matplotlib, rich) and the
post-hoc commands are imported when a command runs, so ``emakit --help`` and
``--version`` answer in about the time Python and click take to start, and a missing extra
becomes a one-line error with the install command instead of a traceback. Warnings raised
while a command runs are printed as one plain ``Warning: ...`` line on stderr, without a
file path or source line.

Example:
    .. code-block:: console

        $ emakit demo --steps 500 --seed 1 --out demo-run
        $ python -m emakit --version
"""

from __future__ import annotations

import importlib
import math
import warnings
from pathlib import Path

import click

from ._version import __version__
from .demo.settings import DEFAULTS

__all__ = ["lazy_command", "main"]

#: The commands of modules that import torch, imported only when one runs: name ->
#: (module, attribute, the short help ``emakit --help`` lists; a test checks that it is the
#: command's own).
_LAZY_COMMANDS = {
    "inspect": (
        "emakit.inspection",
        "inspect_cmd",
        "Show what a post-hoc snapshot FOLDER or a checkpoint FILE holds.",
    ),
    "synthesize": (
        "emakit.posthoc.commands",
        "synthesize",
        "Reconstruct EMA weights of any length from a post-hoc snapshot FOLDER.",
    ),
    "sweep": (
        "emakit.posthoc.commands",
        "sweep_cmd",
        "Choose the EMA length by a sweep over a post-hoc snapshot FOLDER.",
    ),
    "convert": (
        "emakit.posthoc.convert",
        "convert_cmd",
        "Write a post-hoc snapshot FOLDER as another tool's snapshot folder OUT.",
    ),
}


def lazy_command(name: str) -> click.Command:
    """The command ``name`` of ``_LAZY_COMMANDS`` (``inspect``, ``synthesize``, ``sweep``,
    ``convert``), importing its module."""
    module, attribute, _ = _LAZY_COMMANDS[name]
    command: click.Command = getattr(importlib.import_module(module), attribute)
    return command


class _LazyGroup(click.Group):
    """A group whose ``_LAZY_COMMANDS`` are imported only when one of them runs: until then
    each is a placeholder carrying its short help, which ``emakit --help`` lists."""

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] in _LAZY_COMMANDS:
            # returned, not added: the group keeps listing the placeholder's short help
            return args[0], lazy_command(args[0]), args[1:]
        return super().resolve_command(ctx, args)


def _show_warning(message: Warning | str, *where: object, **more: object) -> None:
    """Show a warning as one ``Warning: <message>`` line on stderr: Python's default display
    adds the file path, line number and source line of the code that warned, which mean
    nothing to someone running a command."""
    click.echo(f"Warning: {message}", err=True)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through: every comparison with NaN is False.
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number.", ctx=ctx, param=param)
    return value


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="emakit")
@click.pass_context
def main(ctx: click.Context) -> None:
    """emakit: exponential moving averages of PyTorch model weights.

    Run `emakit COMMAND --help` for the options of a command.
    """
    ctx.with_resource(warnings.catch_warnings())  # restores showwarning when the command ends
    warnings.showwarning = _show_warning


for _name, (_, _, _short_help) in _LAZY_COMMANDS.items():
    main.add_command(click.Command(_name, short_help=_short_help))


@main.command(short_help="Train on the digits with noisy SGD: online vs EMA vs post-hoc EMA.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, writable=True, path_type=Path),
    default=None,
    help="Folder for summary.json, demo.png, the post-hoc snapshots (its "
    "posthoc-snapshots/ subfolder) and emakit-eval.json (how emakit sweep scores); created if missing. If it exists, the demo's own files "
    "in it are replaced (the posthoc-snapshots/ folder is emptied and rewritten, and a "
    "demo.png left by an earlier run is removed with --no-plot); other files are left alone. "
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
    help="Do not write demo.png (matplotlib is then not needed); an old one in --out is removed.",
)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def demo(
    out: Path | None, steps: int, seed: int, beta: float, no_plot: bool, progress: bool
) -> None:
    """Train a small convnet on scikit-learn's digits with noisy SGD, online vs EMA.

    The digits ship inside scikit-learn: nothing is downloaded. Training shows a
    progress bar, then prints the held-out accuracy and loss of the online weights, of
    their EMA and of a post-hoc EMA synthesized after training, and writes
    OUT/summary.json, OUT/demo.png (accuracy curves and the decay schedule) and the
    post-hoc snapshots in OUT/posthoc-snapshots (try: emakit inspect OUT, or choose the
    EMA length with emakit sweep OUT --sigma-rel 0.03:0.25:8). Needs the demo
    extra (scikit-learn, matplotlib, rich): pip install -e ".[demo]" in a clone of emakit.
    """
    from .demo import DemoDependencyError, check_dependencies, new_output_dir, run_demo

    try:
        check_dependencies(plot=not no_plot)
    except DemoDependencyError as e:
        raise click.ClickException(str(e)) from None
    created = out is None
    if out is None:
        out = new_output_dir()
    try:
        run_demo(
            out, steps=steps, seed=seed, beta=beta, plot=not no_plot, progress=progress, report=True
        )
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
    help="Rounds: each times one ~10 ms batch of calls of every path in turn, in alternating "
    "order; each row reports the median over the rounds and the spread.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch CPU threads during the timing. 1 gives steady numbers on a shared machine; "
    "more can be faster on an idle one.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    help="Show a progress bar (on stderr) while the rounds run.",
)
def bench(model: str, device: str, repeats: int, threads: int, progress: bool) -> None:
    """Time one averaging update() of each engine path on a standard model.

    The floor is one lerp_ over a flat tensor with as many elements: the cost of streaming
    the weights through memory once. A ratio near 1.0 is as fast as an update can be. The
    paths are timed side by side, round-robin, so a disturbance hits them alike; the spread
    is the interquartile range over the median. A busy machine, a wide spread or a path
    faster than the floor is reported as a warning: rerun on an idle machine then.
    """
    import torch

    from .bench import MODELS, bench_update
    from .errors import EMAError
    from .posthoc.command_line import progress_bar

    try:
        with progress_bar(progress, unit="rounds") as start:
            advance = start(f"timing 5 paths on {model}", repeats)
            result = bench_update(model, device, repeats, threads=threads, progress=advance)
    except EMAError as e:
        raise click.ClickException(str(e)) from e
    load = "" if result.load_average is None else f", load average {result.load_average:.2f}"
    click.echo(
        f"{MODELS[model][0]} on {device}, torch {torch.__version__}, {result.threads} CPU "
        f"thread(s) of {result.cpus}{load}; {repeats} rounds side by side"
    )
    click.echo(f"{'path':<36}{'median':>10}{'spread':>9}{'x floor':>9}")
    for row in result.rows:
        click.echo(f"{row.path:<36}{row.median_s * 1e6:>8.0f}us{row.spread:>8.0%}{row.ratio:>9.2f}")
    for note in result.warnings:
        click.echo(f"Warning: {note}", err=True)
