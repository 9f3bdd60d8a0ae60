"""Choose the EMA length by a sweep: synthesize many lengths in one pass, score each.

How the EMA length of a diffusion model is chosen (Karras et al. 2024,
arXiv:2312.02696, Fig. 1 and §3): synthesize the EMA at a range of ``sigma_rel`` from the
snapshots of one training run, evaluate each (FID for them; any ``evaluate(model) ->
float`` here), and keep the best. [`sweep()`][emakit.posthoc.synthesis.sweep.sweep] does it from a snapshot folder alone
(``evaluate`` receives a state dict), [`PostHocEMA.sweep()`][emakit.PostHocEMA.sweep] from a training
run's objects (``evaluate`` receives the synthesized EMA model, sharded like the model),
and ``emakit sweep FOLDER --sigma-rel A:B:N --eval module:function`` from the shell.

Each snapshot is read **once** for a whole batch of lengths: its tensors are added, one at
a time, into the accumulator of every length of the batch
(`emakit.posthoc.synthesis.weighted_sum.weighted_sums()`). Memory is one float32 model per length
of a batch (``lengths_per_pass``, default 8; more lengths take more passes) plus one
stored tensor; each length is evaluated, then dropped, before the next batch.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from ..._validate import integer
from ...errors import EMATypeError, EMAValueError
from ..math import check_sigma_rel
from ..snapshots.folder import check_output
from ..snapshots.format import SnapshotInfo
from ..snapshots.legacy import LegacyProfiles
from .plan import pick_snapshots, plan_synthesis
from .weighted_sum import weighted_sums

__all__ = ["SweepResult", "run_sweep", "sweep", "sweep_lengths"]

#: What `run_sweep()` gets from its caller once the lengths are checked: the function
#: that scores one reconstruction, and the keywords that shape the reconstructions.
Scorer = Callable[[], tuple[Callable[[dict[str, Tensor]], Any], dict[str, Any]]]


@dataclass(frozen=True)
class SweepResult:
    """The scores of a sweep, in the order the lengths were given.

    Iterating yields ``(sigma_rel, score)`` pairs; ``dict(result)`` maps each length to its
    score.

    Attributes:
        pairs: ``(sigma_rel, score)`` per length.
        step: the step the EMAs were synthesized at.
        tracked: the ``sigma_rel`` of the profiles the snapshots were taken with.
        mode: ``"min"`` (lower scores are better: a loss, FID) or ``"max"`` (accuracy).
    """

    pairs: tuple[tuple[float, float], ...]
    step: int
    tracked: tuple[float, ...]
    mode: Literal["min", "max"] = "min"

    def __iter__(self) -> Iterator[tuple[float, float]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[float, float]:
        return self.pairs[index]

    @property
    def best(self) -> tuple[float, float]:
        """The ``(sigma_rel, score)`` with the best score (NaN scores never win).

        Raises:
            EMAValueError: every score is NaN: there is no best length.
        """
        scored = [p for p in self.pairs if not math.isnan(p[1])]
        if not scored:
            raise EMAValueError(
                f"every score of the sweep is NaN ({len(self.pairs)} length(s), sigma_rel "
                f"{[round(s, 6) for s, _ in self.pairs[:5]]}{' ...' if len(self.pairs) > 5 else ''}"
                f"), so no length is best: the evaluation function returned NaN for each "
                f"reconstruction; check it on the tracked EMA first"
            )
        pick = min if self.mode == "min" else max
        return pick(scored, key=lambda p: p[1])

    def table(self) -> str:
        """The scores as text, one line per length, the best marked (none when every score
        is NaN)."""
        scored = any(not math.isnan(v) for _, v in self.pairs)
        best = self.best[0] if scored else None
        better = "lower" if self.mode == "min" else "higher"
        lines = [f"sigma_rel  score  (step {self.step}, {better} is better)"]
        for s, v in self.pairs:
            lines.append(f"{s:9.4f}  {v:.6g}" + ("  <- best" if s == best else ""))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], *, ylabel: str = "score") -> Path:
        """Write the score against ``sigma_rel`` as a PNG, the tracked profiles marked
        (vertical lines) and the best length starred. Needs matplotlib (the ``demo``
        extra: ``pip install matplotlib``).

        Returns:
            ``path`` as a `Path`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.figure import Figure
        except ImportError as e:  # pragma: no cover - matplotlib is in the test environment
            raise EMATypeError("SweepResult.plot needs matplotlib: pip install matplotlib") from e
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        xs, ys = zip(*self.pairs, strict=True) if self.pairs else ((), ())
        ax.plot(xs, ys, "o-", label="synthesized post-hoc EMA")
        for i, t in enumerate(self.tracked):
            ax.axvline(
                t, color="tab:green", alpha=0.4, label="tracked profiles" if i == 0 else None
            )
        if any(not math.isnan(v) for _, v in self.pairs):
            bx, by = self.best
            ax.plot(
                [bx], [by], "*", color="tab:red", markersize=14, label=f"best: sigma_rel={bx:.3g}"
            )
        ax.set(
            xlabel="EMA length sigma_rel",
            ylabel=ylabel,
            title=f"post-hoc EMA sweep at step {self.step}",
        )
        ax.legend()
        out = Path(path)
        fig.savefig(out, dpi=100)
        return out


def sweep_lengths(spec: str) -> list[float]:
    """The lengths a sweep spec names: ``"A:B:N"`` -> ``N`` evenly spaced ``sigma_rel``
    from ``A`` to ``B`` (inclusive); ``"A,B,C"`` -> those values. [`sweep()`][emakit.posthoc.synthesis.sweep.sweep]
    and ``emakit sweep --sigma-rel`` take such a spec; this gives the list itself.

    Raises:
        EMAValueError: a malformed spec or a value outside ``(0, SIGMA_REL_MAX]``.
    """
    parts = spec.split(":")
    try:
        if len(parts) == 3:
            lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
            if n < 1:
                raise ValueError
            values = [lo] if n == 1 else [lo + (hi - lo) * i / (n - 1) for i in range(n)]
        elif len(parts) == 1:
            values = [float(x) for x in spec.split(",")]
        else:
            raise ValueError
    except ValueError:
        raise EMAValueError(
            f"sigma_rel sweep must be A:B:N (N >= 1 lengths from A to B) or A,B,C; got {spec!r}"
        ) from None
    return [check_sigma_rel(v, "sigma_rel") for v in values]


def _function_name(fn: object) -> str:
    """``module.qualname`` of a function, for messages (its ``repr`` when it has none)."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if isinstance(name, str) and module else repr(fn)


def _score(value: object, evaluate: str) -> float:
    """A score ``evaluate`` returned, as a float: a real number (Python's, NumPy's) or a
    one-element real tensor; anything else (a string, None, a complex number, a tensor of
    several values) raises, naming the function and the value.

    Raises:
        EMATypeError: ``value`` is not a real number.
    """
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    text = repr(value)
    raise EMATypeError(
        f"the evaluation function {evaluate} must return a number (a float, or a "
        f"one-element tensor), got {text[:80]}{'...' if len(text) > 80 else ''} "
        f"({type(value).__name__}); return the score itself, e.g. float(loss)"
    )


def run_sweep(
    folder: str | os.PathLike[str],
    sigma_rels: Sequence[float] | str,
    *,
    step: int | None,
    mode: Literal["min", "max"],
    lengths_per_pass: int,
    plot: str | os.PathLike[str] | None,
    snapshots: Callable[[], list[SnapshotInfo]],
    scorer: Scorer,
    evaluate: Callable[..., Any],
) -> SweepResult:
    """The sweep of [`sweep()`][emakit.posthoc.synthesis.sweep.sweep] and
    [`PostHocEMA.sweep()`][emakit.PostHocEMA.sweep]: check the arguments, list the snapshots
    (``snapshots()``), plan every length at one step, then ``scorer()`` gives the function
    that scores a reconstruction and the keywords of its passes (see
    [`region_args()`][emakit.posthoc.synthesis.plan.region_args]); each pass reads every
    snapshot once for ``lengths_per_pass`` lengths. Each score must be a real number; the
    error for one that is not names ``evaluate`` (the user's function)."""
    if isinstance(sigma_rels, str):
        sigma_rels = sweep_lengths(sigma_rels)
    if isinstance(sigma_rels, bytes) or not isinstance(sigma_rels, Sequence):
        raise EMATypeError(f"sigma_rels must be a sequence of numbers, got {sigma_rels=!r}")
    if not sigma_rels:
        raise EMAValueError(f"sigma_rels must hold at least one length, got {sigma_rels=!r}")
    if mode not in ("min", "max"):
        raise EMAValueError(f"mode must be 'min' (lower is better) or 'max', got {mode=!r}")
    srs = [check_sigma_rel(s, "sigma_rels") for s in sigma_rels]
    per_pass = integer("lengths_per_pass", lengths_per_pass, low=1)
    if plot is not None:
        check_output("plot", plot, folder)  # before any work: never over a snapshot
    snaps = snapshots()
    plans = [plan_synthesis(folder, sigma_rel=s, step=step, snapshots=snaps) for s in srs]
    score, shape = scorer()
    name = _function_name(evaluate)
    scores: list[float] = []
    for start in range(0, len(plans), per_pass):
        batch = plans[start : start + per_pass]
        states = weighted_sums(batch[0].snapshots, batch, **shape)
        for i in range(len(states)):
            state, states[i] = states[i], {}  # each length dropped once scored
            scores.append(_score(score(state), name))
            del state
    tracked = tuple(sorted({round(s.sigma_rel, 12) for s in plans[0].snapshots}))
    result = SweepResult(tuple(zip(srs, scores, strict=True)), plans[0].step, tracked, mode)
    if plot is not None:
        result.plot(plot)
    return result


def sweep(
    folder: str | os.PathLike[str],
    evaluate: Callable[[dict[str, Tensor]], Any],
    sigma_rels: Sequence[float] | str,
    *,
    step: int | None = None,
    mode: Literal["min", "max"] = "min",
    lengths_per_pass: int = 8,
    run: str | None = None,
    legacy: LegacyProfiles | None = None,
    plot: str | os.PathLike[str] | None = None,
) -> SweepResult:
    """Synthesize the EMA at each of ``sigma_rels`` from a snapshot folder and score it.

    ``evaluate(state_dict) -> float`` receives each reconstruction as a state dict (whole
    tensors, float32; a folder of a sharded run is reassembled), loadable straight into
    the model class; no training object is needed.

    Args:
        folder: the snapshot folder (one process's files, or every rank's).
        evaluate: scores one reconstruction; called once per length, in order.
        sigma_rels: the lengths to try, each in ``(0, SIGMA_REL_MAX]``, or a spec:
            ``"A:B:N"`` for ``N`` evenly spaced lengths from ``A`` to ``B``, ``"A,B,C"``
            (see [`sweep_lengths()`][emakit.posthoc.synthesis.sweep.sweep_lengths]).
        step: the step to synthesize at. Default None: the latest snapshot's.
        mode: ``"min"`` if lower scores are better (a loss, FID), ``"max"`` otherwise.
            Default ``"min"``.
        lengths_per_pass: lengths synthesized per pass over the snapshots (each holds one
            float32 model in memory meanwhile). Default 8.
        run: the run to use (see [`plan_synthesis()`][emakit.posthoc.plan_synthesis]).
        legacy: the profiles of ema-pytorch files in the folder.
        plot: write the plot here (see [`SweepResult.plot()`][emakit.posthoc.synthesis.sweep.SweepResult.plot]). Default None: no plot.

    Returns:
        A [`SweepResult`][emakit.posthoc.synthesis.sweep.SweepResult]: the ``(sigma_rel, score)`` pairs in order, and ``.best``.

    Raises:
        EMAValueError: a bad length, mode or ``lengths_per_pass``; no snapshots.

    Example:
        >>> def evaluate(state):  # doctest: +SKIP
        ...     net = Net(); net.load_state_dict(state); return validation_loss(net)
        >>> result = sweep("ckpts", evaluate, sigma_rels="0.05:0.2:4")  # doctest: +SKIP
        >>> result.best  # doctest: +SKIP
        (0.1, 0.0123)
    """
    return run_sweep(
        folder,
        sigma_rels,
        step=step,
        mode=mode,
        lengths_per_pass=lengths_per_pass,
        plot=plot,
        snapshots=lambda: pick_snapshots(folder, legacy, run),
        scorer=lambda: (evaluate, {}),
        evaluate=evaluate,
    )
