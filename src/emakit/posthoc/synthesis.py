"""Post-hoc EMA synthesis: rebuild the EMA of any length from a folder of snapshots.

Karras et al. 2024 (arXiv:2312.02696, §3 and Appendix C): the EMA of *any* length at
any saved step is a weighted sum of the snapshots, the weights coming from a float64
least-squares fit of the profiles (Algorithm 3, :func:`~emakit.posthoc.math.solve_weights`).

* :func:`plan_synthesis`: choose the snapshots and solve the weights, from the snapshot
  headers alone (a :class:`SynthesisPlan`).
* :meth:`SynthesisPlan.run` / :func:`synthesize_state_dict`: stream the snapshots into
  the reconstructed state dict.
* :func:`open_snapshot`: read one snapshot, emakit's (safetensors) or ema-pytorch's
  (``<index>.<step>.pt``, given its profiles as a
  :class:`~emakit.posthoc.snapshots.LegacyProfiles`).

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from .._files.reading import open_regular, refusal_reason
from .._files.safetensors_file import SafetensorsFile
from ..errors import EMAStateError, EMATypeError, EMAValueError
from .karras import resolve_profile
from .math import PostHocWarning, WeightSolution, gamma_to_sigma_rel, solve_weights
from .runs import pick_run
from .snapshots import LegacyProfiles, SnapshotInfo, list_legacy_files, list_snapshots

__all__ = [
    "SnapshotReader",
    "SynthesisPlan",
    "load_legacy_tensors",
    "open_snapshot",
    "plan_synthesis",
    "restore_exact",
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


# -- reading one snapshot -------------------------------------------------------------------


def load_legacy_tensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The EMA model's tensors in an ema-pytorch snapshot, as stored (names without the
    ``ema_model.`` prefix; ``initted`` and ``step`` left out).

    Loaded with ``torch.load(weights_only=True)``: a file holding anything but tensors
    (e.g. a pickled object with code) is refused, never executed.

    Raises:
        EMAFileNotFoundError: the file does not exist.
        EMAValueError: it is not a regular file (a FIFO...).
        EMAStateError: the file cannot be loaded that way, or is not a ``KarrasEMA`` state.
    """
    with open_regular(path, "ema-pytorch snapshot") as f:
        return _legacy_tensors(f, Path(path))


def _legacy_tensors(f: Any, p: Path) -> dict[str, Tensor]:
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EMAStateError(
            f"{p} could not be loaded as an ema-pytorch snapshot: torch.load(weights_only="
            f"True) refused it ({refusal_reason(e)}). emakit reads .pt snapshots with "
            f"weights_only=True and never runs pickled code; move the file out of the "
            f"snapshot folder if it is not one of ema-pytorch's snapshots"
        ) from e
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()
    ):
        raise EMAStateError(
            f"{p} holds a {type(obj).__name__} that is not an ema-pytorch KarrasEMA state dict "
            f"(names -> tensors); move it out of the snapshot folder"
        )
    prefix = "ema_model."
    stray = sorted(k for k in obj if not k.startswith(prefix) and k not in ("initted", "step"))
    out = {k[len(prefix) :]: v for k, v in obj.items() if k.startswith(prefix)}
    if stray or not out:
        raise EMAStateError(
            f"{p} is not an ema-pytorch KarrasEMA state dict: expected initted, step and "
            f"ema_model.* keys, got {sorted(obj)[:10]}; move it out of the snapshot folder"
        )
    return out


def restore_exact(info: SnapshotInfo, name: str, value: Tensor) -> Tensor | None:
    """``value`` of ``name`` from ``info``'s file in its exact dtype (rounded), for
    ema-pytorch files that stored integer and bool tensors as floats; unchanged otherwise.

    Returns:
        The tensor, or None when the float copy overflowed (inf/NaN: the value is lost).
    """
    dtype = dict(info.exact_dtypes).get(name)
    if dtype is None or value.dtype == dtype:
        return value
    if value.is_floating_point():
        if not bool(torch.isfinite(value).all()):
            return None
        value = value.round()
    return value.to(dtype)


class SnapshotReader(Protocol):
    """The tensors of one open snapshot (:func:`open_snapshot`)."""

    def keys(self) -> list[str]:
        """The tensor names."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype."""
        ...

    def get(self, name: str) -> Tensor:
        """A tensor, as stored."""
        ...


class _TensorsReader:
    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self._t = tensors

    def keys(self) -> list[str]:
        return list(self._t)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._t[name].dtype

    def get(self, name: str) -> Tensor:
        return self._t[name]


def _changed(info: SnapshotInfo, identity: tuple[int, int, int, int], digest: str) -> None:
    if (info.identity is not None and identity != info.identity) or (
        info.header_digest and digest != info.header_digest
    ):
        raise EMAStateError(
            f"snapshot {info.path} changed after the synthesis was planned (it was replaced "
            f"or rewritten: another process is writing to the folder?); plan the synthesis "
            f"again once the folder is no longer written to"
        )


@contextmanager
def open_snapshot(info: SnapshotInfo) -> Iterator[SnapshotReader]:
    """Open one snapshot for reading through one open file: an emakit file lazily
    (its header, then one tensor at a time), an ema-pytorch file loaded whole
    (``torch.load(weights_only=True)``).

    Raises:
        EMAStateError: the file changed since ``info`` was read (another file at the path,
            or another header); an ema-pytorch file that cannot be loaded safely; a
            damaged file.
    """
    if info.is_legacy:
        with open_regular(info.path, "ema-pytorch snapshot") as fh:
            st = os.fstat(fh.fileno())
            _changed(info, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), "")
            tensors = _legacy_tensors(fh, info.path)
        yield _TensorsReader(tensors)
        return
    with SafetensorsFile(info.path, "snapshot") as f:
        _changed(info, f.identity, f.header_digest)
        yield f


# -- planning and running -------------------------------------------------------------------


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
        fill: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Stream the snapshots into the reconstructed state dict.

        .. math:: \\hat\\theta_r = \\sum_i w_i\\,\\hat\\theta_i

        accumulated in float32 (complex64 for complex tensors), one snapshot file open and
        one tensor loaded at a time.

        Args:
            dtype: dtype of the averaged tensors returned; None keeps the snapshots'
                dtype. Default ``torch.float32``. Copied tensors keep their stored dtype.
            progress: called as ``progress(done, total)`` after each snapshot.
            fill: values for integer tensors an ema-pytorch file lost (its float16 copy
                overflowed to inf), used with a :class:`PostHocWarning`. Default None:
                such a tensor raises.

        Returns:
            name -> tensor (on CPU), loadable with ``model.load_state_dict``. Integer and
            bool tensors of ema-pytorch files come back in their exact dtype (rounded).

        Raises:
            EMAStateError: the snapshots disagree on tensor names or shapes; an
                ema-pytorch file cannot be loaded with ``weights_only=True``; an integer
                tensor was lost (see ``fill``); a snapshot used holds inf or NaN in an
                averaged tensor (the message names the snapshots).
        """
        base = self.buffers_from
        with open_snapshot(base) as f:
            names = f.keys()
            shapes = {n: f.shape(n) for n in names}
            copied = {n: _exact(base, n, f.get(n), fill) for n in names if n in base.copied}
        averaged = [n for n in names if n not in base.copied]
        stored: dict[str, torch.dtype] = {}
        acc: dict[str, Tensor] = {}
        nonfinite: dict[str, list[str]] = {}  # tensor -> snapshots holding inf/NaN for it
        total = len(self.snapshots)
        for i, (snap, w) in enumerate(zip(self.snapshots, self.weights, strict=True)):
            with open_snapshot(snap) as f:
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
                    x = f.get(name)
                    if tuple(x.shape) != shapes[name]:
                        raise EMAStateError(
                            f"tensor {name!r} has shape {tuple(x.shape)} in {snap.path} but "
                            f"{shapes[name]} in {base.path}; keep only snapshots of one model"
                        )
                    stored.setdefault(name, x.dtype)
                    if w != 0.0 and not bool(torch.isfinite(x).all()):
                        nonfinite.setdefault(name, []).append(snap.path.name)
                    if name not in acc:
                        wide = torch.complex64 if x.is_complex() else torch.float32
                        acc[name] = torch.zeros(x.shape, dtype=wide)
                    acc[name].add_(x, alpha=w)  # fp16 -> fp32 inside the kernel, no temp
                    del x
            if progress is not None:
                progress(i + 1, total)
        if nonfinite:
            name, files = next(iter(nonfinite.items()))
            raise EMAStateError(
                f"the reconstruction is not finite: {len(files)} snapshot(s) hold inf or NaN "
                f"in {name!r} (and {len(nonfinite) - 1} other tensor(s)): {files[:5]} in "
                f"{str(base.path.parent)!r}. float16 snapshots overflow above 65504: snapshot "
                f"in float32 or bfloat16 (PostHocEMA(checkpoint_dtype=...)); or synthesize at "
                f"a step before the first such snapshot"
            )
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
    legacy: LegacyProfiles | None = None,
    run: str | None = None,
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
        step: the target step; only snapshots taken at or before it are used. Default
            None: the latest snapshot's step.
        legacy: the profiles of ema-pytorch's ``<index>.<step>.pt`` files in the folder,
            which are then used with emakit's snapshots. Default None: the folder must
            hold none.
        run: the run whose snapshots to use (see :mod:`emakit.posthoc.runs`; ``""`` for
            snapshots written before run ids). Default None: the folder must hold the
            snapshots of one run.

    Returns:
        A :class:`SynthesisPlan`; call :meth:`SynthesisPlan.run` to build the weights.

    Raises:
        EMAValueError: bad target, missing folder, a folder with no snapshots, or a
            ``step`` before the first snapshot; a ``run`` with no snapshots.
        EMAStateError: ema-pytorch files in the folder and no ``legacy``, or one whose
            profile index ``legacy`` does not cover; snapshots of several runs and no
            ``run``.

    Warns:
        PostHocWarning: the fit is poor (relative profile error above 0.1, e.g. a target
            step far after the last snapshot), the weights amplify the snapshots'
            rounding noticeably, or the solve fell back to least squares.
    """
    sigma_rel, gamma = resolve_profile(sigma_rel, gamma)
    step = _check_step(step)
    snaps = pick_run(list_snapshots(folder, legacy=legacy), run, folder)
    if legacy is None and (stray := list_legacy_files(folder)):
        raise EMAStateError(
            f"{str(folder)!r} holds {len(stray)} ema-pytorch snapshot file(s) "
            f"({', '.join(f.path.name for f in stray[:4])}{', ...' if len(stray) > 4 else ''}), "
            f"which do not record their gamma; pass legacy=LegacyProfiles(gammas=...) with the "
            f"ema-pytorch run's profiles in order (PostHocEMA.synthesize_ema_model does), or "
            f"move them out of the folder"
        )
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
    coarse = [s for s in usable if s.is_legacy and s.update_every > 1]
    if coarse:
        warnings.warn(
            f"post-hoc EMA: {len(coarse)} ema-pytorch snapshot(s) come from a run with "
            f"update_every={coarse[0].update_every}; ema-pytorch's decay ignores update_every, "
            f"so their profiles are much longer than their gammas say and the reconstruction "
            f"is only approximate",
            PostHocWarning,
            stacklevel=2,
        )
    solution = solve_weights([s.t for s in usable], [s.gamma for s in usable], step, gamma)
    last = max(s.step for s in usable)
    buffers_from = min(
        (s for s in usable if s.step == last),
        key=lambda s: (_profile_distance(s.gamma, gamma), s.path.name),
    )
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
    return SynthesisPlan(
        sigma_rel=sigma_rel,
        gamma=gamma,
        step=step,
        snapshots=usable,
        solution=solution,
        buffers_from=buffers_from,
    )


def _poor_fit_reason(
    usable: tuple[SnapshotInfo, ...], step: int, sigma_rel: float, gamma: float
) -> str:
    """Why the fit is poor, and what to change: the target step lies after the last
    snapshot, the target length lies outside the tracked ones, or the snapshots are too
    few (too far apart) for the profile; each checked, not assumed."""
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


def _exact(
    snap: SnapshotInfo, name: str, value: Tensor, fill: Mapping[str, Tensor] | None
) -> Tensor:
    out = restore_exact(snap, name, value)
    if out is not None:
        return out
    why = (
        f"ema-pytorch stored the integer tensor {name!r} in float16 (its checkpoint_dtype) and "
        f"it overflowed to inf in {snap.path}: its value is lost"
    )
    if fill is None or name not in fill:
        raise EMAStateError(
            f"{why}. Synthesize at a step whose latest snapshot is an emakit one, or with "
            f"PostHocEMA.synthesize_ema_model, which keeps the model's current value"
        )
    warnings.warn(f"{why}; keeping the model's current value", PostHocWarning, stacklevel=4)
    return fill[name].detach().to("cpu", copy=True)


def _profile_distance(a: float, b: float) -> float:
    # how far apart two profiles are: by gamma's ratio, or (a gamma <= 0, sigma_rel above
    # 1/sqrt(12)) by sigma_rel's
    if a > 0 and b > 0:
        return abs(math.log(a / b))
    return abs(math.log(gamma_to_sigma_rel(a) / gamma_to_sigma_rel(b)))


def synthesize_state_dict(
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
        folder: the snapshot folder.
        sigma_rel: the target relative EMA length. Give this or ``gamma``.
        gamma: the target exponent.
        step: the target step. Default None: the latest snapshot's.
        dtype: dtype of the averaged tensors. Default ``torch.float32``.
        progress: called as ``progress(done, total)`` after each snapshot.
        legacy: the profiles of ema-pytorch's snapshot files in the folder (see
            :func:`plan_synthesis`). Default None.
        run: the run to use (see :func:`plan_synthesis`). Default None: the only one.

    Returns:
        name -> tensor, loadable straight into the model class with ``load_state_dict``.

    Example:
        >>> sd = synthesize_state_dict("./post-hoc-ema-checkpoints", sigma_rel=0.15)  # doctest: +SKIP
        >>> net.load_state_dict(sd)  # doctest: +SKIP
    """
    plan = plan_synthesis(
        folder, sigma_rel=sigma_rel, gamma=gamma, step=step, legacy=legacy, run=run
    )
    return plan.run(dtype=dtype, progress=progress)
