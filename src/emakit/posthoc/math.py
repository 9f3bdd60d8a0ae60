"""Post-hoc EMA math: pure float64 functions, after Karras et al. 2024 (arXiv:2312.02696).

Every function here is a pure function of Python floats (the linear algebra of
[`solve_weights()`][emakit.posthoc.math.solve_weights] runs on float64 CPU tensors); nothing touches a model. The
references are to arXiv:2312.02696 (EDM2): §3 introduces the power-function EMA and the
post-hoc reconstruction, Appendix C derives them, Algorithm 2 turns ``sigma_rel`` into
``gamma`` and Algorithm 3 solves the reconstruction weights. The code is written from
those formulas, not taken from any implementation.

Notation (the paper's): training time ``t`` counts optimizer steps, ``theta(t)`` are the
weights after step ``t``, and an EMA with exponent ``gamma`` averages them with the
power-function profile

.. math:: p_{t,\\gamma}(\\tau) = \\frac{\\gamma + 1}{t^{\\gamma + 1}}\\,\\tau^{\\gamma}
   \\quad (0 < \\tau \\le t), \\qquad 0 \\text{ elsewhere},

whose width relative to ``t`` is ``sigma_rel``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _validate as check
from ..errors import EMAValueError

__all__ = [
    "COND_LIMIT",
    "GAMMA_MIN",
    "SIGMA_REL_MAX",
    "SIGMA_REL_UNIFORM",
    "PostHocWarning",
    "WeightSolution",
    "check_gamma",
    "check_sigma_rel",
    "gamma_to_sigma_rel",
    "power_function_beta",
    "power_function_profile",
    "power_function_sample_weights",
    "profile_inner_product",
    "sigma_rel_to_gamma",
    "solve_weights",
    "solve_weights_stepwise",
]

#: Where ``sigma_rel(gamma)`` peaks: ``(sqrt(5) - 3) / 2 ~ -0.382`` (its derivative's root
#: ``gamma^2 + 3 gamma + 1 = 0``). Above it ``sigma_rel`` falls as ``gamma`` grows, so each
#: ``sigma_rel`` has one ``gamma >= GAMMA_MIN``: the largest real root of the paper's cubic,
#: which ema-pytorch takes. Any two such gammas sum above -1, so the post-hoc inner
#: products (integrals of ``tau^(gamma_i + gamma_j)``) stay finite.
GAMMA_MIN = (math.sqrt(5.0) - 3.0) / 2.0

#: The largest relative width a power-function profile has, ``sigma_rel(GAMMA_MIN)`` ~
#: 0.30028; valid values lie in ``(0, SIGMA_REL_MAX]``. Values above ``1/sqrt(12)`` (the
#: uniform average, ``gamma = 0``) have ``gamma < 0``: more weight on early iterates than
#: on the latest ones.
SIGMA_REL_MAX = math.sqrt((GAMMA_MIN + 1.0) / ((GAMMA_MIN + 2.0) ** 2 * (GAMMA_MIN + 3.0)))

#: ``sigma_rel`` of ``gamma = 0`` (the uniform average over all training).
SIGMA_REL_UNIFORM = 1.0 / math.sqrt(12.0)

#: Condition number of the Gram matrix above which `solve_weights()` switches from an
#: exact solve to least squares. float64 keeps about ``16 - log10(cond)`` digits of the
#: weights; 1e12 still leaves four, far below what snapshots in float16/32 resolve.
COND_LIMIT = 1e12


class PostHocWarning(UserWarning):
    """A post-hoc reconstruction that runs but deserves attention (e.g. least squares)."""


def check_sigma_rel(sigma_rel: object, name: str = "sigma_rel") -> float:
    """``sigma_rel`` as a float in ``(0, SIGMA_REL_MAX]``; anything else raises.

    Raises:
        EMATypeError: not a real number.
        EMAValueError: NaN, infinite, ``<= 0``, or above `SIGMA_REL_MAX` (~0.30028,
            the widest power-function profile: no gamma has a larger one).
    """
    return check.real(
        name,
        sigma_rel,
        low=0.0,
        high=SIGMA_REL_MAX,
        low_open=True,
        hint=f"{SIGMA_REL_MAX:.6f} is the largest relative width a power-function EMA has "
        f"(at gamma={GAMMA_MIN:.4f}); typical values 0.05 to 0.2",
    )


def check_gamma(gamma: object, name: str = "gamma") -> float:
    """``gamma`` as a finite float ``>= GAMMA_MIN`` (~ -0.382); anything else raises.

    Raises:
        EMATypeError: not a real number.
        EMAValueError: NaN, infinite or below [`GAMMA_MIN`][emakit.posthoc.math.GAMMA_MIN] (a profile that another,
            larger gamma has the same width as; post-hoc sums of two could diverge).
    """
    return check.real(
        name,
        gamma,
        low=GAMMA_MIN,
        hint=f"gamma={GAMMA_MIN:.4f} is the widest profile (sigma_rel={SIGMA_REL_MAX:.5f}); "
        f"e.g. 6.94 for sigma_rel=0.1",
    )


def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative standard deviation of the power-function profile (§3, Appendix C).

    .. math:: \\sigma_{rel} = \\sqrt{\\frac{\\gamma + 1}{(\\gamma + 2)^2 (\\gamma + 3)}}

    Args:
        gamma: the exponent, finite and ``>= GAMMA_MIN`` (~ -0.382).

    Returns:
        ``sigma_rel`` in ``(0, SIGMA_REL_MAX]``.

    Example:
        >>> round(gamma_to_sigma_rel(6.94), 4)
        0.1
    """
    g = check_gamma(gamma)
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent ``gamma`` whose profile has relative width ``sigma_rel`` (Algorithm 2).

    Squaring [`gamma_to_sigma_rel()`][emakit.posthoc.math.gamma_to_sigma_rel] and clearing denominators gives the paper's cubic

    .. math:: \\gamma^3 + 7\\gamma^2 + (16 - \\sigma_{rel}^{-2})\\,\\gamma
       + (12 - \\sigma_{rel}^{-2}) = 0 .

    Its largest real root is the ``gamma`` returned, as ema-pytorch's ``np.roots(...).max()``
    (the same root; ema-pytorch's may differ in the last bits). For
    ``0 < sigma_rel < 1/sqrt(12)`` that is the one positive root (one sign change in the
    coefficients), and the cubic is convex there with ``f(0) < 0``, so Newton's method
    started to the right of the root descends to it monotonically; it stops when the
    iterate no longer decreases, i.e. at the float64 root. For
    ``1/sqrt(12) <= sigma_rel <= SIGMA_REL_MAX`` the root is in ``[GAMMA_MIN, 0]``, where
    ``f(GAMMA_MIN) <= 0 <= f(0)``; bisection finds it. Such profiles (``gamma < 0``) weigh
    early iterates more than the latest ones.

    Args:
        sigma_rel: the relative EMA length, in ``(0, SIGMA_REL_MAX]`` (~0.30028).

    Returns:
        ``gamma >= GAMMA_MIN``; ``> 0`` for ``sigma_rel < 1/sqrt(12)``.

    Raises:
        EMAValueError: ``sigma_rel`` NaN, ``<= 0`` or above `SIGMA_REL_MAX` (no gamma).

    Example:
        >>> round(sigma_rel_to_gamma(0.05), 2), round(sigma_rel_to_gamma(0.1), 2)
        (16.97, 6.94)
        >>> round(sigma_rel_to_gamma(0.3), 6)  # ema-pytorch's README example
        -0.333333
    """
    s = check_sigma_rel(sigma_rel) ** -2.0
    c1, c0 = 16.0 - s, 12.0 - s

    def f(g: float) -> float:
        return ((g + 7.0) * g + c1) * g + c0

    def df(g: float) -> float:
        return (3.0 * g + 14.0) * g + c1

    if c0 >= 0.0:  # sigma_rel >= 1/sqrt(12): the root is in [GAMMA_MIN, 0]
        lo, hi = GAMMA_MIN, 0.0
        while True:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                return hi if abs(f(hi)) <= abs(f(lo)) else lo
            if f(mid) > 0.0:
                hi = mid
            else:
                lo = mid
    # gamma ~ sqrt(s) - 3 for large s; start a little right of the root, where f > 0.
    g = math.sqrt(s) + 1.0
    if f(g) <= 0.0:
        g = s  # f(s) = s^3 + 6 s^2 + 15 s + 12 > 0
    for _ in range(200):
        step = f(g) / df(g)
        nxt = g - step
        if not nxt < g:
            break
        g = nxt
    return g


def power_function_profile(tau: float, t: float, gamma: float) -> float:
    """The power-function EMA profile ``p_{t,gamma}(tau)`` (§3, Appendix C).

    .. math:: p_{t,\\gamma}(\\tau) = \\frac{\\gamma + 1}{t}\\Big(\\frac{\\tau}{t}\\Big)^{\\gamma}
       \\quad (0 < \\tau \\le t), \\qquad 0 \\text{ elsewhere}.

    It integrates to 1 over ``(0, t]``.
    """
    if not 0.0 < tau <= t:
        return 0.0
    return (gamma + 1.0) / t * (tau / t) ** gamma


def power_function_beta(t: float, dt: float, gamma: float) -> float:
    """The decay of a power-function EMA update at step ``t``, ``dt`` steps after the last.

    §3 gives the per-step recursion with ``beta(t) = (1 - 1/t)^(gamma + 1)``. When the EMA
    is updated only every ``dt`` steps, the weights in between are not seen; giving the
    new sample the profile mass of the whole gap ``(t - dt, t]`` keeps the profile exact:

    .. math:: \\beta = \\Big(1 - \\frac{\\Delta t}{t}\\Big)^{\\gamma + 1},\\qquad
       \\hat\\theta(t) = \\beta\\,\\hat\\theta(t - \\Delta t) + (1 - \\beta)\\,\\theta(t).

    Unrolled, sample ``theta(t_j)`` ends up with weight
    ``(t_j^(gamma+1) - t_(j-1)^(gamma+1)) / t^(gamma+1)``, the integral of
    [`power_function_profile()`][emakit.posthoc.math.power_function_profile] over ``(t_(j-1), t_j]`` (see
    `power_function_sample_weights()`).

    Args:
        t: the current step, ``> 0``.
        dt: steps since the previous update, ``>= 0``; ``dt >= t`` gives 0 (a copy).
        gamma: the exponent.

    Example:
        >>> power_function_beta(100, 10, 1.0)  # (1 - 10/100)^2
        0.81
    """
    if dt <= 0:
        return 1.0
    if dt >= t:
        return 0.0
    return (1.0 - dt / t) ** (gamma + 1.0)


def power_function_sample_weights(sample_steps: Sequence[float], gamma: float) -> list[float]:
    """The weight each sample has in a power-function EMA updated at ``sample_steps``.

    For an EMA initialized at ``sample_steps[0]`` and updated with
    [`power_function_beta()`][emakit.posthoc.math.power_function_beta] at each later step, sample ``j`` carries

    .. math:: w_j = \\frac{t_j^{\\gamma + 1} - t_{j-1}^{\\gamma + 1}}{t_n^{\\gamma + 1}}
       = \\int_{t_{j-1}}^{t_j} p_{t_n,\\gamma}(\\tau)\\,d\\tau, \\qquad t_{-1} = 0,

    which sum to 1. Computed as differences of ``(t_j / t_n)^(gamma + 1)`` to stay in range.

    Args:
        sample_steps: strictly increasing steps ``t_0 < t_1 < ... < t_n``, ``t_0 > 0``.
        gamma: the exponent.
    """
    if not sample_steps:
        return []
    last = float(sample_steps[-1])
    out, prev = [], 0.0
    for t in sample_steps:
        cur = (float(t) / last) ** (gamma + 1.0)
        out.append(cur - prev)
        prev = cur
    return out


def profile_inner_product(t_a: float, gamma_a: float, t_b: float, gamma_b: float) -> float:
    """``<p_a, p_b>``, the L2 inner product of two power-function profiles (Algorithm 3).

    With ``m = min(t_a, t_b)`` the integral of the product over ``(0, m]`` is

    .. math:: \\langle p_{t_a,\\gamma_a}, p_{t_b,\\gamma_b}\\rangle
       = \\frac{(\\gamma_a + 1)(\\gamma_b + 1)}{(\\gamma_a + \\gamma_b + 1)\\,t_{max}}
         \\Big(\\frac{t_{min}}{t_{max}}\\Big)^{\\gamma_{max}}

    where ``gamma_max`` is the exponent of the profile with the later ``t`` (the ratio form
    avoids overflowing ``t^gamma``).
    """
    if t_a <= t_b:
        t_min, t_max, g_late = t_a, t_b, gamma_b
    else:
        t_min, t_max, g_late = t_b, t_a, gamma_a
    num = (gamma_a + 1.0) * (gamma_b + 1.0) * (t_min / t_max) ** g_late
    return num / ((gamma_a + gamma_b + 1.0) * t_max)


@dataclass(frozen=True)
class WeightSolution:
    """The result of [`solve_weights()`][emakit.posthoc.math.solve_weights].

    Attributes:
        weights: one weight per snapshot, summing to 1.
        raw_sum: the sum of the weights before normalization (1 for an exact fit).
        residual: ``||sum_i w_i p_i - p_r|| / ||p_r||``, the relative L2 error of the
            reconstructed profile (0 when the target is one of the snapshots); from
            `solve_weights_stepwise()`, the error of the cumulative profile relative to the
            raw weights' (1: no closer than the raw weights).
        method: ``"solve"`` (exact linear solve) or ``"lstsq"`` (least-squares fallback).
        cond: the 2-norm condition number of the Gram matrix.
        start_weights: from [`solve_weights_stepwise()`][emakit.posthoc.math.solve_weights_stepwise]:
            the weight each snapshot holds on the weights of step 1 (ema-pytorch's first
            update copies them), and last, the combination's; empty from `solve_weights()`.
    """

    weights: tuple[float, ...]
    raw_sum: float
    residual: float
    method: str
    cond: float
    start_weights: tuple[float, ...] = ()

    @property
    def amplification(self) -> float:
        """``sum |w_i|``: how much the snapshots' rounding error can grow in the sum."""
        return sum(abs(w) for w in self.weights)


def solve_weights(
    ts: Sequence[float],
    gammas: Sequence[float],
    t_r: float,
    gamma_r: float,
    *,
    cond_limit: float = COND_LIMIT,
) -> WeightSolution:
    """Weights that combine snapshot EMAs into the EMA with exponent ``gamma_r`` at ``t_r``.

    Algorithm 3: snapshot ``i`` holds the EMA with profile ``p_i = p_{t_i, gamma_i}``; the
    combination ``sum_i x_i theta_hat_i`` has profile ``sum_i x_i p_i``, and the ``x``
    minimizing ``||sum_i x_i p_i - p_r||_2`` solves the normal equations

    .. math:: A x = b, \\qquad A_{ij} = \\langle p_i, p_j \\rangle,\\quad
       b_i = \\langle p_i, p_r \\rangle .

    Two changes from the paper's listing, both deliberate:

    * **Normalization.** Every profile has unit mass, so an exact fit has ``sum x = 1``;
      dividing by the sum makes a constant parameter come back unchanged instead of scaled
      by the fit error.
    * **Degenerate sets.** Duplicate snapshots (same ``t`` and ``gamma``) make ``A``
      singular and near-duplicates make it ill-conditioned (``cond(A) > cond_limit``);
      these fall back to minimum-norm least squares (SVD, ``gelsd``) with a
      [`PostHocWarning`][emakit.posthoc.math.PostHocWarning].

    Times are divided by ``t_r`` first: ``A`` and ``b`` then scale together, which leaves
    ``x`` unchanged and keeps the entries near 1.

    Args:
        ts: snapshot times (optimizer steps), each in ``(0, t_r]``: only snapshots taken at
            or before the target can be used (a later one averages weights from after it).
        gammas: snapshot exponents, one per time, each ``>= GAMMA_MIN``.
        t_r: the target time, ``> 0``.
        gamma_r: the target exponent, ``>= GAMMA_MIN``.
        cond_limit: condition number above which least squares is used. Default 1e12.

    Returns:
        A [`WeightSolution`][emakit.posthoc.math.WeightSolution]; ``weights[i]`` multiplies snapshot ``i``.

    Raises:
        EMAValueError: empty or mismatched inputs, a time after ``t_r``, a non-positive
            time or exponent, or a set whose fit captures no mass of the target (weights
            summing to about 0: the snapshots cannot represent it).

    Example:
        >>> sol = solve_weights([500, 500, 1000, 1000], [6.94, 16.97] * 2, 1000, 16.97)
        >>> [round(w, 6) + 0.0 for w in sol.weights]  # the tracked profile itself
        [0.0, 0.0, 0.0, 1.0]
        >>> sol = solve_weights([500, 500, 1000, 1000], [6.94, 16.97] * 2, 1000, 10.0)
        >>> round(sum(sol.weights), 12), sol.method
        (1.0, 'solve')
    """
    if len(ts) != len(gammas):
        raise EMAValueError(
            f"ts and gammas must pair one to one, got {len(ts)=} and {len(gammas)=}"
        )
    if not ts:
        raise EMAValueError("no snapshots to combine: ts is empty; save snapshots first")
    t_r = check.real("t_r", t_r, low=0.0, low_open=True)
    gamma_r = check_gamma(gamma_r, "gamma_r")
    times = [check.real("ts", t) / t_r for t in ts]
    exps = [check_gamma(g, "gammas") for g in gammas]
    bad = [t for t in ts if not 0.0 < float(t) <= t_r]
    if bad:
        raise EMAValueError(
            f"every snapshot time must be in (0, t_r={t_r:g}], got {bad[:5]}; drop snapshots "
            f"taken after the target step (they average weights from after it)"
        )

    n = len(times)
    a = torch.empty(n, n, dtype=torch.float64)
    b = torch.empty(n, 1, dtype=torch.float64)
    for i in range(n):
        b[i, 0] = profile_inner_product(times[i], exps[i], 1.0, gamma_r)
        for j in range(i, n):
            a[i, j] = a[j, i] = profile_inner_product(times[i], exps[i], times[j], exps[j])

    cond = float(torch.linalg.cond(a)) if n > 1 else 1.0
    pairs = list(zip(times, exps, strict=True))
    duplicates = n - len(set(pairs))
    if duplicates or not cond < cond_limit:
        why = (
            f"{duplicates} duplicate snapshot(s) (same step and gamma)"
            if duplicates
            else f"an ill-conditioned snapshot set (cond={cond:.3g} > {cond_limit:.3g})"
        )
        warnings.warn(
            f"post-hoc EMA: {why}; solving by least squares (minimum-norm) instead of exactly",
            PostHocWarning,
            stacklevel=2,
        )
        x = torch.linalg.lstsq(a, b, rcond=n * 2.2e-16, driver="gelsd").solution
        method = "lstsq"
    else:
        x = torch.linalg.solve(a, b)
        method = "solve"

    raw_sum = float(x.sum())
    if not (math.isfinite(raw_sum) and raw_sum > 1e-6 * float(x.abs().sum()) and raw_sum > 1e-9):
        raise EMAValueError(
            f"the snapshots at or before t_r={t_r:g} cannot represent the target profile "
            f"(gamma_r={gamma_r:g}): its least-squares weights sum to {raw_sum:.3g} instead of "
            f"about 1; pick a target step closer to the snapshots or a longer EMA"
        )
    x = x / raw_sum
    # Relative L2 error of the normalized fit: ||p_r||^2 - 2 x.b + x.A.x over ||p_r||^2.
    prr = profile_inner_product(1.0, gamma_r, 1.0, gamma_r)
    err2 = prr - 2.0 * float((x * b).sum()) + float((x.T @ a @ x).sum())
    residual = math.sqrt(max(err2, 0.0) / prr)
    return WeightSolution(
        weights=tuple(float(w) for w in x[:, 0]),
        raw_sum=raw_sum,
        residual=residual,
        method=method,
        cond=cond,
    )


# -- profiles as the per-step weights a snapshot really holds --------------------------------


def _log_prefix(terms: Tensor) -> Tensor:
    """``out[m] = log sum_{s < m} exp(terms[s])`` for ``m = 0..len(terms)`` (``-inf`` at 0)."""
    return torch.cat([terms.new_full((1,), -math.inf), torch.logcumsumexp(terms, 0)])


def solve_weights_stepwise(
    ts: Sequence[int],
    gammas: Sequence[float],
    t_r: int,
    gamma_r: float,
    *,
    update_every: Sequence[int | None],
    roundoff: float = 0.0,
) -> WeightSolution:
    """Synthesis weights from the weights each snapshot really holds, step by step.

    [`solve_weights()`][emakit.posthoc.math.solve_weights] takes every snapshot to hold the
    power-function profile ``p_{t,gamma}``. ema-pytorch 0.8.3's ``KarrasEMA`` does not: it
    averages on the calls ``c_j = 1 + j k`` (``k = update_every``), the first copying the
    weights, each later one with decay ``beta_j = (c_j / (c_j + 1))^(gamma + 1)``, whatever
    ``k`` is. After its ``n``-th later update it holds ``sum_j w_j theta(c_j)`` with

    .. math:: w_0 = \\prod_{l=1}^{n} \\beta_l, \\qquad
       w_j = (1 - \\beta_j) \\prod_{l=j+1}^{n} \\beta_l ,

    whose cumulative weight up to step ``s`` is ``F(s) = exp(L_n - L_j(s))``, with
    ``L_j = sum_{l <= j} log beta_l`` and ``j(s)`` the last update at or before ``s``.
    For ``k = 1`` that is the power profile one step late; for ``k > 1`` a much longer
    one (exponent about ``(gamma + 1) / k - 1``) plus the atom ``w_0`` on the weights of
    step 1. emakit's own snapshots hold ``F(s) = min(s / t, 1)^(gamma + 1)`` and so does
    the target, the per-step power EMA at ``t_r`` (see `power_function_sample_weights()`).

    The criterion compares cumulative profiles. A combination with weights ``d_s`` on the
    trajectory (the difference from the target's, summing to 0) is off by
    ``sum_s d_s theta(s) = -sum_{s < t_r} D(s) (theta(s+1) - theta(s))`` with
    ``D(s) = sum_{s' <= s} d_s'``, so for weights that move by independent increments
    (a random walk) its expected squared error is proportional to ``sum_s D(s)^2``: an
    atom on step 1 costs in proportion to how far training has moved since. The weights
    minimize that, plus the snapshots' rounding:

    .. math:: \\min_{\\sum_i x_i = 1}\\;\\frac{1}{t_r}\\sum_{s=1}^{t_r}
       \\Big(\\sum_i x_i F_i(s) - F_r(s)\\Big)^2 + \\lambda^2 \\lVert x\\rVert^2,
       \\qquad \\lambda = \\max(\\texttt{roundoff}, 2^{-24}),

    i.e. ``x = M^{-1} 1 / (1^T M^{-1} 1)`` with ``M_ij = <F_i - F_r, F_j - F_r> +
    lambda^2 delta_ij``. The ``lambda`` term is the rounding of snapshots stored with unit
    roundoff ``roundoff`` (summed in float32: ``2^-24`` at least) for weights that move
    by about their own norm over training; without it the atom is cancelled by weights
    of 1e4 to 1e5 that a float16 snapshot turns into noise. The sums run over every step
    in float64 (``torch.logcumsumexp``), exact for any ``t_r``: time and memory are
    ``O(t_r)`` per pair of profiles (8 bytes per step) plus ``O(len(ts)^2)``.

    Args:
        ts: the step each snapshot's averaging ends at: for ema-pytorch's, its last
            update call ``c_n`` (``1 + k * ((step - 1) // k)``); each in ``[1, t_r]``.
        gammas: each snapshot's exponent.
        t_r: the target step, ``>= 1``.
        gamma_r: the target exponent.
        update_every: keyword-only; per snapshot, ema-pytorch's ``update_every`` for a
            file ema-pytorch wrote, or None for a power-function profile (emakit's).
        roundoff: keyword-only; unit roundoff of the stored snapshots (float16: 2^-11).
            Default 0.

    Returns:
        A [`WeightSolution`][emakit.posthoc.math.WeightSolution] (``method`` ``"stepwise"``,
        ``raw_sum`` 1) whose ``residual`` is the distance of the combination's cumulative
        profile from the target's relative to that of the raw weights at ``t_r`` (1: no
        better than the raw weights, under the random-walk model), and whose
        ``start_weights`` give each snapshot's weight on step 1, then the combination's.

    Raises:
        EMAValueError: mismatched or empty inputs, a ``t`` outside ``[1, t_r]``, a bad
            exponent or ``update_every``.

    Example:
        >>> sol = solve_weights_stepwise([901, 901, 1901, 1901], [16.97, 0.17] * 2, 2000, 6.94,
        ...                              update_every=[100] * 4)
        >>> round(sum(sol.weights), 12), [round(w, 2) for w in sol.start_weights]
        (1.0, [0.6, 0.97, 0.53, 0.96, -0.03])
    """
    n = len(ts)
    if not n or len(gammas) != n or len(update_every) != n:
        raise EMAValueError(
            f"ts, gammas and update_every must pair one to one and not be empty, got "
            f"{len(ts)=}, {len(gammas)=}, {len(update_every)=}"
        )
    t_r = check.integer("t_r", t_r, low=1)
    gamma_r = check_gamma(gamma_r, "gamma_r")
    exps = [check_gamma(g, "gammas") for g in gammas]
    cuts = [check.integer("ts", t, low=1, high=t_r) for t in ts]
    steps = torch.arange(1, t_r + 1, dtype=torch.float64)
    bases: dict[tuple[float, int | None], Tensor] = {}  # log of F's shape, step by step
    decays: dict[tuple[float, int], Tensor] = {}  # L_j of ema-pytorch's profiles
    profiles: list[
        tuple[tuple[float, int | None], float, int]
    ] = []  # (base, log alpha, cut): F(s) = alpha exp(base(s)) for s < cut, else 1
    for t, g, k in [*zip(cuts, exps, update_every, strict=True), (t_r, gamma_r, None)]:
        if k is None:
            if (g, None) not in bases:
                bases[g, None] = (g + 1.0) * torch.log(steps)
            profiles.append(((g, None), -(g + 1.0) * math.log(t), t))
            continue
        k = check.integer("update_every", k, low=1)
        if (g, k) not in decays:
            calls = 1.0 + k * torch.arange(1, (t_r - 1) // k + 1, dtype=torch.float64)
            log_beta = (g + 1.0) * torch.log1p(-1.0 / (calls + 1.0))
            decays[g, k] = torch.cat([log_beta.new_zeros(1), torch.cumsum(log_beta, 0)])
            bases[g, k] = -decays[g, k][torch.div(steps - 1, k, rounding_mode="floor").long()]
        profiles.append(((g, k), float(decays[g, k][(t - 1) // k]), t))

    # <F_p, F_q> for every pair at once, by pairs of bases. With c = min(cut_p, cut_q):
    # alpha_p alpha_q sum_{s<c} e^(base_p + base_q), plus the later one's own mass up to its
    # cut, plus the steps where both are 1; each sum a log-prefix looked up at the cut.
    cut = torch.tensor([c for _, _, c in profiles])
    log_alpha = torch.tensor([al for _, al, _ in profiles], dtype=torch.float64)
    keys = list(bases)
    group = torch.tensor([keys.index(bk) for bk, _, _ in profiles])
    single = torch.stack([_log_prefix(bases[key]) for key in keys])  # (bases, t_r + 1)
    own = torch.exp(log_alpha + single[group, cut - 1])  # alpha sum_{s<cut} e^base
    inner = torch.empty(n + 1, n + 1, dtype=torch.float64)
    for u, ku in enumerate(keys):
        for v, kv in enumerate(keys[u:], start=u):
            ps, qs = torch.nonzero(group == u)[:, 0], torch.nonzero(group == v)[:, 0]
            if not len(ps) or not len(qs):
                continue
            both = _log_prefix(bases[ku] + bases[kv])
            lo = torch.minimum(cut[ps, None], cut[None, qs])
            q_later = cut[None, qs] >= cut[ps, None]
            later = torch.where(
                q_later,
                own[None, qs] - torch.exp(log_alpha[None, qs] + single[v][lo - 1]),
                own[ps, None] - torch.exp(log_alpha[ps, None] + single[u][lo - 1]),
            )
            block = torch.exp(log_alpha[ps, None] + log_alpha[None, qs] + both[lo - 1])
            block = (block + later + (t_r + 1 - torch.maximum(cut[ps, None], cut[None, qs]))) / t_r
            inner[ps[:, None], qs[None, :]] = block
            inner[qs[:, None], ps[None, :]] = block.T
    a, b, rho = inner[:n, :n], inner[:n, n], float(inner[n, n])
    gram = a - b[:, None] - b[None, :] + rho  # <F_i - F_r, F_j - F_r>
    lam = max(float(roundoff), 2.0**-24)
    m = gram + lam**2 * torch.eye(n, dtype=torch.float64)
    ones = torch.ones(n, 1, dtype=torch.float64)
    y = torch.linalg.lstsq(m, ones, driver="gelsd").solution
    x = (y / y.sum())[:, 0]
    err2 = max(float(x @ gram @ x), 0.0)
    raw2 = rho - 1.0 / t_r  # the raw weights at t_r: F = 0 before t_r
    starts = [1.0 if c <= 1 else math.exp(al + float(bases[bk][0])) for bk, al, c in profiles]
    return WeightSolution(
        weights=tuple(float(w) for w in x),
        raw_sum=1.0,
        residual=math.sqrt(err2 / raw2) if raw2 > 0 else 0.0,
        method="stepwise",
        cond=float(torch.linalg.cond(m)) if n > 1 else 1.0,
        start_weights=(
            *starts[:-1],
            math.fsum(float(w) * s for w, s in zip(x, starts[:-1], strict=True)),
        ),
    )
