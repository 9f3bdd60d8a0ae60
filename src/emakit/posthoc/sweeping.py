"""Choose the EMA length by a sweep: synthesize many lengths in one pass, score each.

How the EMA length of a diffusion model is chosen (Karras et al. 2024,
arXiv:2312.02696, Fig. 1 and §3): synthesize the EMA at a range of ``sigma_rel`` from the
snapshots of one training run, evaluate each (FID for them; any ``evaluate(model) ->
float`` here), and keep the best. [`sweep()`][emakit.posthoc.sweeping.sweep] does it from a snapshot folder alone
(``evaluate`` receives a state dict), `sweep()` from a training
run's objects (``evaluate`` receives the synthesized EMA model, sharded like the model),
and ``emakit sweep FOLDER --sigma-rel A:B:N --eval module:function`` from the shell.

Each snapshot is read **once** for a whole batch of lengths: its tensors are added, one at
a time, into the accumulator of every length of the batch
(`weighted_sums()`). Memory is one float32 model per length
of a batch (``lengths_per_pass``, default 8; more lengths take more passes) plus one
stored tensor; each length is evaluated, then dropped, before the next batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import Tensor, nn

from .._validate import integer
from ..errors import EMATypeError, EMAValueError
from .assemble import Target, weighted_sums
from .karras import resolve_profile
from .math import check_sigma_rel
from .shards import Block
from .snapshots import LegacyProfiles, SnapshotInfo
from .synthesis import SynthesisPlan, load_into, model_regions, pick_snapshots, plan_synthesis

__all__ = ["SweepResult", "run_sweep", "sweep", "sweep_lengths", "sweep_module"]


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
        """The ``(sigma_rel, score)`` with the best score (NaN scores never win)."""
        finite = [p for p in self.pairs if not math.isnan(p[1])] or list(self.pairs)
        pick = min if self.mode == "min" else max
        return pick(finite, key=lambda p: p[1])

    def table(self) -> str:
        """The scores as text, one line per length, the best marked."""
        best = self.best[0]
        lines = [
            f"sigma_rel  score  (step {self.step}, {'lower' if self.mode == 'min' else 'higher'} is better)"
        ]
        for s, v in self.pairs:
            lines.append(f"{s:9.4f}  {v:.6g}" + ("  <- best" if s == best else ""))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], *, ylabel: str = "score") -> Path:
        """Write the score against ``sigma_rel`` as a PNG, the tracked profiles marked
        (vertical lines) and the best length starred. Needs matplotlib (the ``demo``
        extra: ``pip install 'emakit[demo]'``).

        Returns:
            ``path`` as a `Path`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.figure import Figure
        except ImportError as e:  # pragma: no cover - matplotlib is in the test environment
            raise EMATypeError(
                "SweepResult.plot needs matplotlib: pip install 'emakit[demo]'"
            ) from e
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        xs, ys = zip(*self.pairs, strict=True) if self.pairs else ((), ())
        ax.plot(xs, ys, "o-", label="synthesized post-hoc EMA")
        for i, t in enumerate(self.tracked):
            ax.axvline(
                t, color="tab:green", alpha=0.4, label="tracked profiles" if i == 0 else None
            )
        bx, by = self.best
        ax.plot([bx], [by], "*", color="tab:red", markersize=14, label=f"best: sigma_rel={bx:.3g}")
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
    """``"A:B:N"`` -> ``N`` evenly spaced ``sigma_rel`` from ``A`` to ``B`` (inclusive);
    ``"A,B,C"`` -> those values.

    Raises:
        EMAValueError: a malformed spec or a value outside ``(0, 1/sqrt(12))``.
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


def _check(
    sigma_rels: Sequence[float], mode: str, lengths_per_pass: int
) -> tuple[list[float], int]:
    if isinstance(sigma_rels, (str, bytes)) or not isinstance(sigma_rels, Sequence):
        raise EMATypeError(f"sigma_rels must be a sequence of numbers, got {sigma_rels=!r}")
    if not sigma_rels:
        raise EMAValueError(f"sigma_rels must hold at least one length, got {sigma_rels=!r}")
    if mode not in ("min", "max"):
        raise EMAValueError(f"mode must be 'min' (lower is better) or 'max', got {mode=!r}")
    srs = [resolve_profile(check_sigma_rel(s, "sigma_rels"), None)[0] for s in sigma_rels]
    return srs, integer("lengths_per_pass", lengths_per_pass, low=1)


def run_sweep(
    plans: Sequence[SynthesisPlan],
    score: Callable[[dict[str, Tensor]], float],
    *,
    lengths_per_pass: int = 8,
    regions: Mapping[str, Block] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    rank: int | None = None,
    fill: Mapping[str, Tensor] | None = None,
) -> list[float]:
    """Score every plan's reconstruction, ``lengths_per_pass`` plans per pass over their
    snapshots (which must be the same snapshots: one step, one folder)."""
    scores: list[float] = []
    for start in range(0, len(plans), lengths_per_pass):
        batch = plans[start : start + lengths_per_pass]
        states = weighted_sums(
            batch[0].snapshots,
            [Target(p.weights, p.buffers_from) for p in batch],
            regions=regions,
            shapes=shapes,
            rank=rank,
            fill=fill,
        )
        for i in range(len(states)):
            state, states[i] = states[i], {}
            scores.append(float(score(state)))
            del state
    return scores


def plans_for(
    folder: str | os.PathLike[str],
    sigma_rels: Sequence[float],
    *,
    step: int | None,
    snaps: list[SnapshotInfo],
) -> list[SynthesisPlan]:
    """One plan per length, all at ``step`` (default: the latest snapshot's), from one
    listing of the folder."""
    return [plan_synthesis(folder, sigma_rel=s, step=step, snapshots=snaps) for s in sigma_rels]


def sweep(
    folder: str | os.PathLike[str],
    evaluate: Callable[[dict[str, Tensor]], Any],
    sigma_rels: Sequence[float],
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
        sigma_rels: the lengths to try, each in ``(0, 1/sqrt(12))`` (see
            [`sweep_lengths()`][emakit.posthoc.sweeping.sweep_lengths] for ``"A:B:N"``).
        step: the step to synthesize at. Default None: the latest snapshot's.
        mode: ``"min"`` if lower scores are better (a loss, FID), ``"max"`` otherwise.
            Default ``"min"``.
        lengths_per_pass: lengths synthesized per pass over the snapshots (each holds one
            float32 model in memory meanwhile). Default 8.
        run: the run to use (see [`plan_synthesis()`][emakit.posthoc.plan_synthesis]).
        legacy: the profiles of ema-pytorch files in the folder.
        plot: write the plot here (see [`SweepResult.plot()`][emakit.posthoc.sweeping.SweepResult.plot]). Default None: no plot.

    Returns:
        A [`SweepResult`][emakit.posthoc.sweeping.SweepResult]: the ``(sigma_rel, score)`` pairs in order, and ``.best``.

    Raises:
        EMAValueError: a bad length, mode or ``lengths_per_pass``; no snapshots.

    Example:
        >>> def evaluate(state):  # doctest: +SKIP
        ...     net = Net(); net.load_state_dict(state); return validation_loss(net)
        >>> result = sweep("ckpts", evaluate, sigma_rels=[0.05, 0.1, 0.15, 0.2])  # doctest: +SKIP
        >>> result.best  # doctest: +SKIP
        (0.1, 0.0123)
    """
    srs, per_pass = _check(sigma_rels, mode, lengths_per_pass)
    snaps = pick_snapshots(folder, legacy, run)
    plans = plans_for(folder, srs, step=step, snaps=snaps)
    scores = run_sweep(plans, evaluate, lengths_per_pass=per_pass)
    return _result(srs, scores, plans, mode, plot)


def _result(
    srs: Sequence[float],
    scores: Sequence[float],
    plans: Sequence[SynthesisPlan],
    mode: Literal["min", "max"],
    plot: str | os.PathLike[str] | None,
) -> SweepResult:
    tracked = tuple(sorted({round(s.sigma_rel, 12) for s in plans[0].snapshots}))
    result = SweepResult(tuple(zip(srs, scores, strict=True)), plans[0].step, tracked, mode)
    if plot is not None:
        result.plot(plot)
    return result


def sweep_module(
    folder: str | os.PathLike[str],
    evaluate: Callable[[Any], Any],
    sigma_rels: Sequence[float],
    *,
    build: Callable[[], tuple[nn.Module, Callable[[Callable[[Any], Any]], Any]]],
    step: int | None,
    mode: Literal["min", "max"],
    lengths_per_pass: int,
    snapshots: Callable[[], list[SnapshotInfo]],
    plot: str | os.PathLike[str] | None,
) -> SweepResult:
    """`sweep()`: ``build()`` makes the one EMA model every length is loaded into
    (sharded like the model) and ``call``, which runs ``evaluate`` on what computes with
    it (the EMA model in eval mode; for a ZeRO-3 EMA, the online model with the EMA
    partitions swapped in); ``snapshots()`` lists and picks the folder's snapshots."""
    srs, per_pass = _check(sigma_rels, mode, lengths_per_pass)
    snaps = snapshots()
    plans = plans_for(folder, srs, step=step, snaps=snaps)
    model, call = build()
    model.eval()
    regions, shapes, rank = model_regions(model)

    def score(out: dict[str, Tensor]) -> float:
        load_into(model, out, where=folder)
        return float(call(evaluate))

    scores = run_sweep(
        plans,
        score,
        lengths_per_pass=per_pass,
        regions=regions,
        shapes=shapes,
        rank=rank,
        fill=None if regions else model.state_dict(),
    )
    return _result(srs, scores, plans, mode, plot)
