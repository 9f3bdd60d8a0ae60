"""Post-hoc EMA synthesis: choose the snapshots, solve the weights, run the sum.

Karras et al. 2024 (arXiv:2312.02696, §3 and Appendix C): the EMA of *any* length at
any saved step is a weighted sum of the snapshots, the weights coming from a float64
least-squares fit of the profiles (Algorithm 3, [`solve_weights()`][emakit.posthoc.math.solve_weights]).

* [`plan_synthesis()`][emakit.posthoc.synthesis.plan.plan_synthesis]: choose the snapshots and solve the weights, from the snapshot
  headers alone (a [`SynthesisPlan`][emakit.posthoc.synthesis.plan.SynthesisPlan]).
* [`SynthesisPlan.run()`][emakit.posthoc.synthesis.plan.SynthesisPlan.run] / [`synthesize()`][emakit.posthoc.synthesis.plan.synthesize]: stream the snapshots into
  the reconstructed state dict; `synthesize_into()`: into a model's tensors, whole or
  this rank's blocks of a sharded one.

Synthesis streams the snapshots: one file is open at a time and its tensors are added,
one by one, into a float32 accumulator, so memory stays at about one model however many
snapshots there are. Each snapshot is read through one open file, and a snapshot replaced
or changed since the plan read its header is refused when it is read. A folder holding the
snapshots of more than one run is refused unless a run is picked (``run=``).
Buffers (BatchNorm statistics, counters) and other non-averaged
tensors are not summed (a weighted sum with negative weights can make a variance
negative); they come from the latest snapshot at or before the target step.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..._dist.collectives import dist_ready
from ..._dist.dtensor import local_tensor
from ..._validate import optional_integer
from ...errors import EMAStateError, EMAValueError
from ..karras import resolve_profile
from ..math import (
    PostHocWarning,
    WeightSolution,
    gamma_to_sigma_rel,
    solve_weights,
    solve_weights_stepwise,
)
from ..snapshots.folder import list_legacy_files, list_snapshots, pick_run, skipped_files
from ..snapshots.format import SnapshotInfo, open_snapshot
from ..snapshots.legacy import LegacyProfiles
from ..snapshots.shards import is_sharded, model_blocks
from .weighted_sum import weighted_sums

__all__ = [
    "SynthesisPlan",
    "load_into",
    "pick_snapshots",
    "plan_synthesis",
    "region_args",
    "synthesize",
    "synthesize_state_dict",
]

#: A reconstruction whose profile misses the target by more than this (relative L2) warns.
RESIDUAL_WARN = 0.1


@dataclass(frozen=True)
class SynthesisPlan:
    """What a synthesis will combine, decided from the snapshot headers alone.

    Attributes:
        sigma_rel: the target relative EMA length.
        gamma: the target exponent.
        step: the target step.
        snapshots: the snapshots used (all taken at or before ``step``), in order.
        solution: the float64 weights, one per snapshot (sum 1), with the fit's residual.
        buffers_from: the snapshot that buffers and other non-averaged tensors come from:
            the latest at or before ``step`` (of those, the one with the closest gamma).
    """

    sigma_rel: float
    gamma: float
    step: int
    snapshots: tuple[SnapshotInfo, ...]
    solution: WeightSolution
    buffers_from: SnapshotInfo

    @property
    def weights(self) -> tuple[float, ...]:
        return self.solution.weights

    def run(
        self,
        *,
        dtype: torch.dtype | None = torch.float32,
        progress: Callable[[int, int], None] | None = None,
        **where: Any,
    ) -> dict[str, Tensor]:
        """Stream the snapshots into the reconstructed state dict (see
        `emakit.posthoc.synthesis.weighted_sum.weighted_sums()`).

        .. math:: \\hat\\theta_r = \\sum_i w_i\\,\\hat\\theta_i

        accumulated in float32 (complex64 for complex tensors), one snapshot file open and
        one tensor loaded at a time.

        Args:
            dtype: dtype of the averaged tensors returned; None keeps the snapshots'
                dtype. Default ``torch.float32``. Copied tensors keep their stored dtype.
            progress: called as ``progress(done, total)`` after each snapshot.
            **where: keyword-only; what part of which model to build (`region_args()`
                gives them for a model): ``fill``, values for integer tensors an
                ema-pytorch file lost (its float16 copy overflowed to inf), used with a
                [`PostHocWarning`][emakit.posthoc.math.PostHocWarning] (default None:
                such a tensor raises); ``regions``, name -> the block of each tensor to
                build (a rank's shard, see [`Block`][emakit.posthoc.snapshots.shards.Block];
                default None: whole tensors); ``rank``, the caller's rank, whose files of a
                sharded snapshot are read first; ``shapes``, the model's global shapes of
                the tensors in ``regions``, checked.

        Returns:
            name -> tensor (on CPU), loadable with ``model.load_state_dict``. Integer and
            bool tensors of ema-pytorch files come back in their exact dtype (rounded).

        Raises:
            EMAStateError: the snapshots disagree on tensor names or shapes; an
                ema-pytorch file cannot be loaded with ``weights_only=True``; an integer
                tensor was lost (see ``fill``).
        """
        return weighted_sums(self.snapshots, [self], dtype=dtype, progress=progress, **where)[0]


def pick_snapshots(
    folder: str | os.PathLike[str], legacy: LegacyProfiles | None, run: str | None
) -> list[SnapshotInfo]:
    """The snapshots of ``folder`` that a synthesis uses: those of the run picked
    ([`pick_run()`][emakit.posthoc.snapshots.folder.pick_run]), ema-pytorch's read with ``legacy``.

    Raises:
        EMAStateError: ema-pytorch files and no ``legacy``; several runs and no ``run``;
            files that look like snapshots but were all skipped (unreadable, or their side
            files missing or damaged: the message names them).
    """
    snaps = pick_run(list_snapshots(folder, legacy=legacy), run, folder)
    if not snaps and (skipped := skipped_files(folder)):  # files there, none readable: why
        raise EMAStateError(
            f"no usable post-hoc EMA snapshots in {str(folder)!r}: {len(skipped)} file(s) "
            f"were skipped: {'; '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}"
        )
    if legacy is None and (stray := list_legacy_files(folder)):
        raise EMAStateError(
            f"{str(folder)!r} holds {len(stray)} ema-pytorch snapshot file(s) "
            f"({', '.join(f.path.name for f in stray[:4])}{', ...' if len(stray) > 4 else ''}), "
            f"which do not record their gamma; pass legacy=LegacyProfiles(gammas=...) with the "
            f"ema-pytorch run's profiles in order (PostHocEMA.synthesize_ema_model does; on the "
            f"command line: --legacy-sigma-rels S,S, the sigma_rels of the ema-pytorch "
            f"PostHocEMA in its order, or --legacy-gammas G,G, with --legacy-update-every N), "
            f"or move them out of the folder"
        )
    return snaps


def plan_synthesis(
    folder: str | os.PathLike[str],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    legacy: LegacyProfiles | None = None,
    run: str | None = None,
    snapshots: list[SnapshotInfo] | None = None,
) -> SynthesisPlan:
    """Choose the snapshots and solve the weights for one target EMA (from the snapshot
    headers and names; only an ema-pytorch file chosen for the buffers is loaded, to
    check its dtype).

    Args:
        folder: the snapshot folder.
        sigma_rel: the target relative EMA length, in ``(0, SIGMA_REL_MAX]`` (~0.30028;
            above ``1/sqrt(12)`` gamma < 0: more weight on early iterates). Give this or
            ``gamma``.
        gamma: the target exponent, ``>= GAMMA_MIN`` (~ -0.382).
        step: the target step, from the first snapshot's step to the last's (after the
            last snapshot the EMA was never recorded: refused); only snapshots taken at or
            before it are used. Default None: the latest snapshot's step.
        legacy: the profiles of ema-pytorch's ``<index>.<step>.pt`` files in the folder,
            which are then used with emakit's snapshots. Default None: the folder must
            hold none.
        run: the run whose snapshots to use (see [`emakit.posthoc.snapshots.folder`][emakit.posthoc.snapshots.folder]; ``""`` for
            snapshots written before run ids). Default None: the folder must hold the
            snapshots of one run.
        snapshots: the folder's snapshots, already listed and picked
            (`pick_snapshots()`), to plan several targets from one listing. Default
            None: list the folder.

    Returns:
        A [`SynthesisPlan`][emakit.posthoc.synthesis.plan.SynthesisPlan]; call [`SynthesisPlan.run()`][emakit.posthoc.synthesis.plan.SynthesisPlan.run] to build the weights.

    Raises:
        EMAValueError: bad target, missing folder, a folder with no snapshots, or a
            ``step`` before the first snapshot or after the last; a ``run`` with no
            snapshots; a target after step 1 from ema-pytorch files that have averaged
            nothing yet (its ``update_every`` is larger than their steps).
        EMAStateError: ema-pytorch files in the folder and no ``legacy``, or one whose
            profile index ``legacy`` does not cover; snapshots of several runs and no
            ``run``; snapshot files that were all skipped (see `pick_snapshots()`).

    Warns:
        PostHocWarning: the fit is poor (relative profile error above 0.1, e.g. a target
            step far between two snapshots), the weights amplify the snapshots'
            rounding noticeably, or the solve fell back to least squares. With
            ema-pytorch's files (solved from the weights they really hold,
            [`solve_weights_stepwise()`][emakit.posthoc.math.solve_weights_stepwise]): a
            poor fit, with how much of the files sits on the weights of step 1.
    """
    sigma_rel, gamma = resolve_profile(sigma_rel, gamma)
    step = optional_integer("step", step, low=1)
    snaps = snapshots if snapshots is not None else pick_snapshots(folder, legacy, run)
    if not snaps:
        raise EMAValueError(
            f"no post-hoc EMA snapshots in {str(folder)!r} (files named step-*.safetensors "
            f"written by PostHocEMA); train with PostHocEMA and call checkpoint() first"
        )
    first, last = min(s.step for s in snaps), max(s.step for s in snaps)
    if step is None:
        step = last
    if not first <= step <= last:
        # After the last snapshot the EMA was never recorded: refused, however close.
        where = f"before the first snapshot (step {first})"
        if step > last:
            where = f"after the last snapshot (step {last}), after which the EMA was not recorded"
        raise EMAValueError(
            f"step={step} is {where} in {str(folder)!r}; pass a step in [{first}, {last}], "
            f"or none for the last snapshot's step"
        )
    usable = tuple(s for s in snaps if s.step <= step)
    theirs = any(s.is_legacy for s in usable)
    if theirs:
        _refuse_unaveraged(usable, step, folder)
        usable = _distinct(usable)
    last = max(s.step for s in usable)
    buffers_from = min(
        (s for s in usable if s.step == last),
        key=lambda s: (_profile_distance(s.gamma, gamma), s.path.name),
    )
    if theirs:
        solution = _solve_theirs(usable, step, sigma_rel, gamma, buffers_from)
        return SynthesisPlan(sigma_rel, gamma, step, usable, solution, buffers_from)
    try:
        solution = solve_weights([s.t for s in usable], [s.gamma for s in usable], step, gamma)
    except EMAValueError as e:
        if step == last:
            raise
        raise EMAValueError(
            f"step={step}: {e}; the last snapshot at or before it is at step {last}: pick a "
            f"step that has a snapshot"
        ) from e
    if solution.residual > RESIDUAL_WARN:
        warnings.warn(
            f"post-hoc EMA: the snapshots at or before step {step} reconstruct the "
            f"sigma_rel={sigma_rel:.4g} profile only roughly (relative profile error "
            f"{solution.residual:.2g}): {_poor_fit_reason(usable, step, sigma_rel, gamma)}",
            PostHocWarning,
            stacklevel=2,
        )
    noise = solution.amplification * _stored_roundoff(buffers_from)
    if noise > 1e-2:
        warnings.warn(
            f"post-hoc EMA: the weights (sum |w| = {solution.amplification:.3g}) amplify the "
            f"snapshots' rounding to about {noise:.2g} relative; store snapshots in float32 "
            f"(checkpoint_dtype=torch.float32) or use fewer, farther-apart snapshots",
            PostHocWarning,
            stacklevel=2,
        )
    return SynthesisPlan(sigma_rel, gamma, step, usable, solution, buffers_from)


def _distinct(usable: tuple[SnapshotInfo, ...]) -> tuple[SnapshotInfo, ...]:
    """``usable`` without ema-pytorch files that repeat an earlier one: with
    ``update_every > checkpoint_every_num_steps`` several files of a profile are written
    between two averaging updates and hold the same weights (same profile index and
    ``t``); the latest of them is kept."""
    latest = {(s.profile, s.t): s for s in usable if s.is_legacy}
    return tuple(s for s in usable if not s.is_legacy or latest[s.profile, s.t] is s)


def _refuse_unaveraged(usable: tuple[SnapshotInfo, ...], step: int, folder: object) -> None:
    """Refuse a target after step 1 when every snapshot is an ema-pytorch file that has
    averaged nothing yet (its first update copied the weights of step 1, the next comes
    ``update_every`` calls later)."""
    if step == 1 or any(s.t > 1 or not s.is_legacy for s in usable):
        return
    k = usable[0].update_every
    names = ", ".join(s.path.name for s in usable[:4]) + (", ..." if len(usable) > 4 else "")
    raise EMAValueError(
        f"the ema-pytorch snapshots at or before step {step} in {str(folder)!r} ({names}, "
        f"written at steps {usable[0].step}..{usable[-1].step}) have averaged nothing: "
        f"ema-pytorch's KarrasEMA copies the weights at its first update() and, with its "
        f"update_every={k}, averages next at update() call {k + 1}, so every file up to step "
        f"{k} holds the weights of step 1, not an EMA, and no combination of them is the EMA "
        f"at step {step} (ema-pytorch's synthesize_ema_model returns those step-1 weights, "
        f"rescaled). Synthesize at a step of {k + 1} or later that has files, or train with "
        f"update_every=1 (emakit's PostHocEMA keeps the exact profile for any update_every)"
    )


def _solve_theirs(
    usable: tuple[SnapshotInfo, ...],
    step: int,
    sigma_rel: float,
    gamma: float,
    buffers_from: SnapshotInfo,
) -> WeightSolution:
    """The weights for snapshots that include ema-pytorch files, from the weights those
    really hold ([`solve_weights_stepwise()`][emakit.posthoc.math.solve_weights_stepwise]),
    with the rounding of their stored dtype; a poor fit warns with its numbers."""
    theirs = [s for s in usable if s.is_legacy]
    roundoff = max(_stored_roundoff(s) for s in {buffers_from, theirs[-1]})
    solution = solve_weights_stepwise(
        [s.t for s in usable],
        [s.gamma for s in usable],
        step,
        gamma,
        update_every=[s.update_every if s.is_legacy else None for s in usable],
        roundoff=roundoff,
    )
    if solution.residual <= RESIDUAL_WARN:
        return solution
    k = theirs[0].update_every
    starts = [w for s, w in zip(usable, solution.start_weights, strict=False) if s.is_legacy]
    steps = sorted({s.step for s in usable})
    why = []
    if max(starts) > 0.01:
        why.append(
            f"ema-pytorch's KarrasEMA (update_every={k}) leaves {min(starts):.0%} to "
            f"{max(starts):.0%} of each of these snapshots on the weights of step 1 (its first "
            f"update copies them, and each later update, every {k} calls, decays them only by "
            f"(c/(c+1))^(gamma+1)); the best combination keeps {solution.start_weights[-1]:.2g} "
            f"on them"
        )
    why.append(
        f"{len(usable)} snapshot(s) at {len(steps)} step(s) ({steps[0]}..{steps[-1]}) are too "
        f"few for it; snapshots stored with unit roundoff {roundoff:.2g} limit how far they "
        f"can be combined. Save snapshots more often, in float32, with update_every=1 (or "
        f"train on with emakit's PostHocEMA, exact for any update_every)"
    )
    warnings.warn(
        f"post-hoc EMA: the snapshots at or before step {step} reconstruct the "
        f"sigma_rel={sigma_rel:.4g} EMA only roughly: its cumulative profile is "
        f"{solution.residual:.2g} times as far from the target's as the raw weights' at step "
        f"{step} (1: no closer than the raw weights): " + "; ".join(why),
        PostHocWarning,
        stacklevel=3,
    )
    return solution


def _poor_fit_reason(
    usable: tuple[SnapshotInfo, ...], step: int, sigma_rel: float, gamma: float
) -> str:
    """Why the fit is poor, and what to change: the target step lies after the last
    snapshot at or before it (between two snapshots), the target length lies outside the
    tracked ones, or the snapshots are too few (too far apart) for the profile; each
    checked, not assumed."""
    steps = sorted({s.step for s in usable})
    last = steps[-1]
    reasons = []
    if step > last:
        # Would the same snapshots fit at the last snapshot's step? Then the gap is the cause.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            there = solve_weights([s.t for s in usable], [s.gamma for s in usable], last, gamma)
        gap = (
            f"the last usable snapshot is at step {last}, {step - last} step(s) before the "
            f"target step {step}"
        )
        if there.residual <= RESIDUAL_WARN:
            return (
                f"{gap}, and an EMA keeps changing after its last snapshot; at step {last} the "
                f"error would be {there.residual:.2g}: pick a step that has a snapshot"
            )
        reasons.append(gap)
    low, high = min(s.sigma_rel for s in usable), max(s.sigma_rel for s in usable)
    if not low <= sigma_rel <= high:
        reasons.append(
            f"sigma_rel={sigma_rel:.4g} lies outside the tracked profiles "
            f"({', '.join(f'{x:.4g}' for x in sorted({s.sigma_rel for s in usable}))}), so the "
            f"synthesis extrapolates; track a profile closer to it (PostHocEMA(sigma_rels=...))"
        )
    # With fewer than ~8 snapshot steps even a length between the tracked ones fits only
    # roughly (4 evenly spaced steps: error ~0.1; 8: ~0.04), so that is named alongside.
    if not reasons or len(steps) < 8:
        reasons.append(
            f"{len(usable)} snapshot(s) at {len(steps)} step(s) ({steps[0]}..{last}) are too "
            f"few and too far apart to represent this profile; save snapshots more often "
            f"(checkpoint_every_num_steps) or train longer before synthesizing"
        )
    return "; ".join(reasons)


def _stored_roundoff(snap: SnapshotInfo) -> float:
    """Unit roundoff (half the machine epsilon) of the dtype the averaged tensors are in."""
    with open_snapshot(snap) as f:
        for name in f.keys():  # noqa: SIM118 - a reader is not a dict
            if name not in snap.copied:
                dtype = f.dtype(name)
                return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0
    return 0.0


def _profile_distance(a: float, b: float) -> float:
    # how far apart two profiles are: by gamma's ratio, or (a gamma <= 0, sigma_rel above
    # 1/sqrt(12)) by sigma_rel's
    if a > 0 and b > 0:
        return abs(math.log(a / b))
    return abs(math.log(gamma_to_sigma_rel(a) / gamma_to_sigma_rel(b)))


def synthesize(
    folder: str | os.PathLike[str],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    legacy: LegacyProfiles | None = None,
    run: str | None = None,
) -> dict[str, Tensor]:
    """Reconstruct the EMA with ``sigma_rel`` (or ``gamma``) at ``step`` from a snapshot
    folder, without the model: ``plan_synthesis(...).run(...)``.

    Args:
        folder: the snapshot folder (one process's files, or every rank's: a sharded run
            is reassembled into whole tensors).
        sigma_rel: the target relative EMA length. Give this or ``gamma``.
        gamma: the target exponent.
        step: the target step. Default None: the latest snapshot's.
        dtype: dtype of the averaged tensors. Default ``torch.float32``.
        progress: called as ``progress(done, total)`` after each snapshot.
        legacy: the profiles of ema-pytorch's snapshot files in the folder (see
            [`plan_synthesis()`][emakit.posthoc.synthesis.plan.plan_synthesis]). Default None.
        run: the run to use (see [`plan_synthesis()`][emakit.posthoc.synthesis.plan.plan_synthesis]). Default None: the only one.

    Returns:
        name -> tensor, loadable straight into the model class with ``load_state_dict``.

    Example:
        >>> sd = synthesize("./post-hoc-ema-checkpoints", sigma_rel=0.15)  # doctest: +SKIP
        >>> net.load_state_dict(sd)  # doctest: +SKIP
    """
    plan = plan_synthesis(
        folder, sigma_rel=sigma_rel, gamma=gamma, step=step, legacy=legacy, run=run
    )
    return plan.run(dtype=dtype, progress=progress)


def synthesize_state_dict(folder: str | os.PathLike[str], **kwargs: Any) -> dict[str, Tensor]:
    """Alias of [`synthesize()`][emakit.posthoc.synthesis.plan.synthesize] (same keywords),
    kept for code written before emakit named the synthesis from a folder ``synthesize``."""
    return synthesize(folder, **kwargs)


def region_args(model: nn.Module) -> dict[str, Any]:
    """The keywords of [`SynthesisPlan.run()`][emakit.posthoc.synthesis.plan.SynthesisPlan.run]
    (and of a sweep's pass) that build ``model``'s tensors: the block of every tensor this
    rank holds ([`model_blocks()`][emakit.posthoc.snapshots.shards.model_blocks]: whole
    tensors, a DTensor's shard under FSDP2, HSDP or FSDP with tensor parallelism, the flat
    range of a DeepSpeed ZeRO-3 partition), their global shapes (checked against the
    snapshots') and the rank; for a model held whole, also its state as ``fill`` (for the
    integer tensors an ema-pytorch file lost)."""
    _, regions, shapes = model_blocks(model, empty=True)
    rank = torch.distributed.get_rank() if dist_ready() else None
    fill = None if is_sharded(model) else model.state_dict()
    return {"regions": regions, "shapes": shapes, "rank": rank, "fill": fill}


def load_into(model: nn.Module, out: Mapping[str, Tensor]) -> None:
    """Copy a synthesized state (this rank's blocks of every tensor, see `region_args()`)
    into ``model``'s tensors, in place."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in out.items():
            local = local_tensor(state[name])
            if local.numel():
                local.copy_(value.reshape(local.shape))
