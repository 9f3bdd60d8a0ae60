"""Post-hoc EMA synthesis: rebuild the EMA of any length from a folder of snapshots.

Karras et al. 2024 (arXiv:2312.02696, §3 and Appendix C): the EMA of *any* length at
any saved step is a weighted sum of the snapshots, the weights coming from a float64
least-squares fit of the profiles (Algorithm 3, :func:`~emakit.posthoc.math.solve_weights`).

* :func:`plan_synthesis`: choose the snapshots and solve the weights, from the snapshot
  headers alone (a :class:`SynthesisPlan`).
* :meth:`SynthesisPlan.run` / :func:`synthesize_state_dict`: stream the snapshots into
  the reconstructed state dict.

Synthesis streams the snapshots: one file is open at a time and its tensors are added,
one by one, into a float32 accumulator, so memory stays at about one model however many
snapshots there are. Buffers (BatchNorm statistics, counters) and other non-averaged
tensors are not summed (a weighted sum with negative weights can make a variance
negative); they come from the latest snapshot at or before the target step.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import EMAStateError, EMATypeError, EMAValueError
from .karras import resolve_profile
from .math import PostHocWarning, WeightSolution, solve_weights
from .snapshots import SnapshotInfo, list_snapshots

__all__ = [
    "SynthesisPlan",
    "plan_synthesis",
    "synthesize_state_dict",
]

#: A reconstruction whose profile misses the target by more than this (relative L2) warns.
RESIDUAL_WARN = 0.1


def _check_step(step: object) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int):
        raise EMATypeError(f"step must be an int or None, got {step=!r} ({type(step).__name__})")
    if step < 1:
        raise EMAValueError(f"step must be >= 1 (a training step), got {step=}")
    return step


# Unit roundoff (half the machine epsilon) of the floating safetensors dtype codes.
_ROUNDOFF = {
    "F64": 2.0**-53,
    "F32": 2.0**-24,
    "F16": 2.0**-11,
    "BF16": 2.0**-8,
    "F8_E4M3": 2.0**-4,
    "F8_E5M2": 2.0**-3,
}


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
    ) -> dict[str, Tensor]:
        """Stream the snapshots into the reconstructed state dict.

        .. math:: \\hat\\theta_r = \\sum_i w_i\\,\\hat\\theta_i

        accumulated in float32 (complex64 for complex tensors), one snapshot file open and
        one tensor loaded at a time.

        Args:
            dtype: dtype of the averaged tensors returned; None keeps the snapshots'
                dtype. Default ``torch.float32``. Copied tensors keep their stored dtype.
            progress: called as ``progress(done, total)`` after each snapshot.

        Returns:
            name -> tensor (on CPU), loadable with ``model.load_state_dict``.

        Raises:
            EMAStateError: the snapshots disagree on tensor names or shapes.
        """
        from safetensors import safe_open

        base = self.buffers_from
        with safe_open(str(base.path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
            copied = {n: f.get_tensor(n) for n in names if n in base.copied}
        averaged = [n for n in names if n not in base.copied]
        stored: dict[str, torch.dtype] = {}
        acc: dict[str, Tensor] = {}
        total = len(self.snapshots)
        for i, (snap, w) in enumerate(zip(self.snapshots, self.weights, strict=True)):
            with safe_open(str(snap.path), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                if keys != set(names) or snap.copied != base.copied:
                    missing, extra = sorted(set(names) - keys), sorted(keys - set(names))
                    raise EMAStateError(
                        f"snapshot {snap.path} does not hold the same tensors as {base.path}: "
                        f"missing {missing[:10]}, extra {extra[:10]}"
                        + ("" if missing or extra else ", and a different set of copied names")
                        + "; keep only snapshots of one model in the folder"
                    )
                for name in averaged:
                    x = f.get_tensor(name)
                    if tuple(x.shape) != shapes[name]:
                        raise EMAStateError(
                            f"tensor {name!r} has shape {tuple(x.shape)} in {snap.path} but "
                            f"{shapes[name]} in {base.path}; keep only snapshots of one model"
                        )
                    stored.setdefault(name, x.dtype)
                    if name not in acc:
                        wide = torch.complex64 if x.is_complex() else torch.float32
                        acc[name] = torch.zeros(x.shape, dtype=wide)
                    acc[name].add_(x, alpha=w)  # fp16 -> fp32 inside the kernel, no temp
                    del x
            if progress is not None:
                progress(i + 1, total)
        out: dict[str, Tensor] = {}
        for name in names:
            if name in copied:
                out[name] = copied[name]
            else:
                target = dtype if dtype is not None else stored[name]
                t = acc.pop(name)
                out[name] = t if (t.is_complex() or t.dtype == target) else t.to(target)
        return out


def plan_synthesis(
    folder: str | os.PathLike[str],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
) -> SynthesisPlan:
    """Choose the snapshots and solve the weights for one target EMA (no tensor is read).

    Args:
        folder: the snapshot folder.
        sigma_rel: the target relative EMA length, in ``(0, 1/sqrt(12))``. Give this or
            ``gamma``.
        gamma: the target exponent, ``> 0``.
        step: the target step; only snapshots taken at or before it are used. Default
            None: the latest snapshot's step.

    Returns:
        A :class:`SynthesisPlan`; call :meth:`SynthesisPlan.run` to build the weights.

    Raises:
        EMAValueError: bad target, missing folder, a folder with no snapshots, or a
            ``step`` before the first snapshot.

    Warns:
        PostHocWarning: the fit is poor (relative profile error above 0.1, e.g. a target
            step far after the last snapshot), the weights amplify the snapshots'
            rounding noticeably, or the solve fell back to least squares.
    """
    sigma_rel, gamma = resolve_profile(sigma_rel, gamma)
    step = _check_step(step)
    snaps = list_snapshots(folder)
    if not snaps:
        raise EMAValueError(
            f"no post-hoc EMA snapshots in {str(folder)!r} (files named step-*.safetensors "
            f"written by PostHocEMA); train with PostHocEMA and call checkpoint() first"
        )
    if step is None:
        step = snaps[-1].step
    usable = tuple(s for s in snaps if s.step <= step)
    if not usable:
        raise EMAValueError(
            f"step={step} is before the first snapshot (step {snaps[0].step}) in "
            f"{str(folder)!r}; pass a step in [{snaps[0].step}, {snaps[-1].step}]"
        )
    solution = solve_weights([s.t for s in usable], [s.gamma for s in usable], step, gamma)
    last = max(s.step for s in usable)
    buffers_from = min(
        (s for s in usable if s.step == last),
        key=lambda s: (abs(math.log(s.gamma / gamma)), s.path.name),
    )
    if solution.residual > RESIDUAL_WARN:
        warnings.warn(
            f"post-hoc EMA: the snapshots at or before step {step} reconstruct the "
            f"sigma_rel={sigma_rel:.4g} profile only roughly (relative profile error "
            f"{solution.residual:.2g}); the last usable snapshot is at step {last}. Pick a step "
            f"that has a snapshot, or save snapshots more often",
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
    return SynthesisPlan(
        sigma_rel=sigma_rel,
        gamma=gamma,
        step=step,
        snapshots=usable,
        solution=solution,
        buffers_from=buffers_from,
    )


def _stored_roundoff(snap: SnapshotInfo) -> float:
    from safetensors import safe_open

    with safe_open(str(snap.path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            if name not in snap.copied:
                return _ROUNDOFF.get(f.get_slice(name).get_dtype(), 0.0)
    return 0.0


def synthesize_state_dict(
    folder: str | os.PathLike[str],
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Tensor]:
    """Reconstruct the EMA with ``sigma_rel`` (or ``gamma``) at ``step`` from a snapshot
    folder, without the model: ``plan_synthesis(...).run(...)``.

    Args:
        folder: the snapshot folder.
        sigma_rel: the target relative EMA length. Give this or ``gamma``.
        gamma: the target exponent.
        step: the target step. Default None: the latest snapshot's.
        dtype: dtype of the averaged tensors. Default ``torch.float32``.
        progress: called as ``progress(done, total)`` after each snapshot.

    Returns:
        name -> tensor, loadable straight into the model class with ``load_state_dict``.

    Example:
        >>> sd = synthesize_state_dict("./post-hoc-ema-checkpoints", sigma_rel=0.15)  # doctest: +SKIP
        >>> net.load_state_dict(sd)  # doctest: +SKIP
    """
    return plan_synthesis(folder, sigma_rel=sigma_rel, gamma=gamma, step=step).run(
        dtype=dtype, progress=progress
    )
