"""Decay schedules: pure functions of the step.

A schedule is any callable ``schedule(t) -> decay`` where ``t`` is the number of
optimizer steps (``update()`` calls) since averaging began,

.. math:: t = \\max(\\text{step} - \\text{update\\_after\\_step} - 1,\\ 0),

``step`` being the call counter after the current call, exactly as ema-pytorch counts.
The EMA then applies ``shadow.lerp_(online, 1 - decay)``, with the decay clamped to
``[min_value, 1]``.

A schedule whose decay is a rate *per optimizer step* (so that its time constant does
not depend on ``update_every``) sets the attribute ``per_optimizer_step = True``; the EMA
then raises it to the power ``update_every`` for each update it performs.

The EMA never asks a schedule for ``t == 0``: that update is a plain copy (decay 0), the
model that starts the average. So with ``update_after_step=0, update_every=1`` the
shadow after the update at ``t`` is an average of ``t + 1`` models, which is what the
exact forms of [`cumulative_average()`][emakit.schedules.cumulative_average] and [`power_function()`][emakit.schedules.power_function] rely on.

Every factory checks its arguments up front. All but [`inverse_gamma()`][emakit.schedules.inverse_gamma] (a plain
function, kept as it was) return a small picklable callable with a readable ``repr``
(``linear_warmup(beta=0.999, warmup=1000)``) that compares equal to another one built
from the same arguments:

============================  =================================================================
factory                       decay at ``t``
============================  =================================================================
[`constant()`][emakit.schedules.constant]              ``beta``
[`inverse_gamma()`][emakit.schedules.inverse_gamma]         ``1 - (1 + t / inv_gamma) ** -power``, in ``[min_value, beta]``
[`linear_warmup()`][emakit.schedules.linear_warmup]         ``min(beta, (1 + t) / (warmup + 1))``
[`torch_ema_warmup()`][emakit.schedules.torch_ema_warmup]      ``min(beta, (1 + t) / (10 + t))``
[`half_life()`][emakit.schedules.half_life]             ``0.5 ** (1 / steps)`` per optimizer step
[`linear_ramp()`][emakit.schedules.linear_ramp]           ``beta0 + (beta1 - beta0) * min(t / steps, 1)``
[`cosine_momentum()`][emakit.schedules.cosine_momentum]       ``beta1 - (beta1 - beta0) * (cos(pi * min(t, T) / T) + 1) / 2``
[`power_function()`][emakit.schedules.power_function]        ``(t / (t + update_every)) ** (gamma + 1)``
[`cumulative_average()`][emakit.schedules.cumulative_average]    ``t / (t + update_every)``
============================  =================================================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from . import _validate as check
from .errors import EMAValueError

__all__ = [
    "Schedule",
    "constant",
    "cosine_momentum",
    "cumulative_average",
    "describe",
    "half_life",
    "inverse_gamma",
    "inverse_gamma_float32",
    "linear_ramp",
    "linear_warmup",
    "power_function",
    "torch_ema_warmup",
]


@runtime_checkable
class Schedule(Protocol):
    """``t -> decay``: the decay to apply at ``t`` steps after averaging began."""

    def __call__(self, t: int, /) -> float: ...


def inverse_gamma_float32(
    t: int, *, beta: float, inv_gamma: float, power: float, min_value: float
) -> float:
    """The inverse-gamma warm-up decay computed in float32, bit-identical to ema-pytorch.

    .. math:: \\text{decay}(t) = \\text{clamp}\\big(1 - (1 + t/\\gamma^{-1})^{-p},\\ \\text{min\\_value},\\ \\beta\\big),
       \\qquad \\text{decay}(0) = 0

    The value of [`inverse_gamma()`][emakit.schedules.inverse_gamma]'s schedule at ``t``
    (unchecked arguments): ema-pytorch 0.8.3 evaluates this formula on float32 tensors, and
    so does emakit, on numpy scalars, so an emakit EMA and an ema-pytorch EMA fed the same
    weights agree exactly. No device is touched, so no host-device sync happens.
    """
    return _InverseGamma(beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value)(t)


def inverse_gamma(
    beta: float = 0.9999, inv_gamma: float = 1.0, power: float = 2 / 3, min_value: float = 0.0
) -> Callable[[int], float]:
    """Inverse-gamma warm-up, the default schedule (ema-pytorch, timm, diffusers).

    .. math:: \\text{decay}(t) = \\text{clamp}\\big(1 - (1 + t/\\gamma^{-1})^{-p},\\ \\text{min\\_value},\\ \\beta\\big)

    With ``inv_gamma=1``: ``power=2/3`` reaches 0.999 at about 31.6k steps and 0.9999 at
    about 1M; ``power=3/4`` reaches 0.999 at about 10k and 0.9999 at about 215k.

    Args:
        beta: the ceiling of the decay, in ``[0, 1]``. Default 0.9999.
        inv_gamma: inverse multiplicative factor of the warm-up, > 0. Default 1.0.
        power: exponent of the warm-up, > 0. Default 2/3.
        min_value: the floor of the decay, in ``[0, beta]``. Default 0.0.

    Example:
        >>> s = inverse_gamma(beta=0.999, power=3 / 4)
        >>> round(s(10_000), 4)
        0.999
    """
    beta = check.real("beta", beta, low=0.0, high=1.0)
    inv_gamma = check.real("inv_gamma", inv_gamma, low=0.0, low_open=True)
    power = check.real("power", power, low=0.0, low_open=True)
    min_value = check.real("min_value", min_value, low=0.0, high=1.0)
    if min_value > beta:
        raise EMAValueError(
            f"min_value must not exceed beta, got {min_value=} > {beta=}; lower min_value"
        )

    return _InverseGamma(beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value)


# -- the factories ------------------------------------------------------------------------
#
# Each schedule is a frozen dataclass: picklable (an EMA holding one can be saved), equal
# by value, and shown as the factory call that builds it. The factories (lowercase, the
# public names) validate; the classes only compute.


@dataclasses.dataclass(frozen=True, repr=False)
class _Schedule:
    _factory: ClassVar[str] = ""  # the factory's name, given as a class keyword
    per_optimizer_step: ClassVar[bool] = False

    def __init_subclass__(cls, factory: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._factory = factory

    def __repr__(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.repr]
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields)
        return f"{self._factory}({args})"


@dataclasses.dataclass(frozen=True, repr=False)
class _InverseGamma(_Schedule, factory="inverse_gamma"):
    beta: float
    inv_gamma: float
    power: float
    min_value: float
    # (inv_gamma, 1, min_value, beta) as numpy scalars of each dtype torch may default to,
    # made once: converting them on every call was half the cost of a call
    _consts: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        consts = {
            real: (real(self.inv_gamma), real(1), real(self.min_value), real(self.beta))
            for real in (np.float32, np.float64)
        }
        object.__setattr__(self, "_consts", consts)

    def __call__(self, t: int) -> float:
        # ema-pytorch: clamp(1 - (1 + epoch / inv_gamma) ** -power, min_value, beta).item()
        # on a 0-dim tensor of torch's default dtype (float32; float64 if set so), 0 for
        # epoch <= 0. The same operations on numpy scalars of that dtype give its bits (the
        # test suite compares them with ema-pytorch's own, bit for bit), 20 µs faster.
        if t <= 0:
            return 0.0
        real = np.float64 if torch.get_default_dtype() == torch.float64 else np.float32
        inv_gamma, one, min_value, beta = self._consts[real]
        base = real(t) / inv_gamma + one
        # torch's CPU pow by a scalar: 1 / sqrt, 1 / x and 1 / (x * x) for the exponents
        # -0.5, -1 and -2, any other std::pow(base, double(exponent)) rounded to the dtype
        if self.power == 0.5:
            value = one / np.sqrt(base)
        elif self.power == 1.0:
            value = one / base
        elif self.power == 2.0:
            value = one / (base * base)
        else:
            value = real(math.pow(base, -self.power))
        return float(min(max(one - value, min_value), beta))


def _between(value: float, a: float, b: float) -> float:
    # Rounding may step one ulp outside the interval the formula stays in; keep it inside.
    return min(max(value, min(a, b)), max(a, b))


@dataclasses.dataclass(frozen=True, repr=False)
class _Constant(_Schedule, factory="constant"):
    beta: float

    def __call__(self, t: int) -> float:
        return self.beta


@dataclasses.dataclass(frozen=True, repr=False)
class _LinearWarmup(_Schedule, factory="linear_warmup"):
    beta: float
    warmup: int

    def __call__(self, t: int) -> float:
        return min(self.beta, (1 + max(t, 0)) / (self.warmup + 1))


@dataclasses.dataclass(frozen=True, repr=False)
class _TorchEMAWarmup(_Schedule, factory="torch_ema_warmup"):
    beta: float

    def __call__(self, t: int) -> float:
        t = max(t, 0)
        return min(self.beta, (1 + t) / (10 + t))


@dataclasses.dataclass(frozen=True, repr=False)
class _HalfLife(_Schedule, factory="half_life"):
    per_optimizer_step: ClassVar[bool] = True
    steps: float

    def __call__(self, t: int) -> float:
        return 0.5 ** (1.0 / self.steps)


@dataclasses.dataclass(frozen=True, repr=False)
class _LinearRamp(_Schedule, factory="linear_ramp"):
    beta0: float
    beta1: float
    steps: int

    def __call__(self, t: int) -> float:
        if t >= self.steps:
            return self.beta1
        value = self.beta0 + (self.beta1 - self.beta0) * (max(t, 0) / self.steps)
        return _between(value, self.beta0, self.beta1)


@dataclasses.dataclass(frozen=True, repr=False)
class _CosineMomentum(_Schedule, factory="cosine_momentum"):
    beta0: float
    total_steps: int
    beta1: float = 1.0

    def __call__(self, t: int) -> float:
        if t >= self.total_steps:
            return self.beta1
        progress = max(t, 0) / self.total_steps
        value = self.beta1 - (self.beta1 - self.beta0) * (math.cos(math.pi * progress) + 1) / 2
        return _between(value, self.beta0, self.beta1)


@dataclasses.dataclass(frozen=True, repr=False)
class _PowerFunction(_Schedule, factory="power_function"):
    gamma: float
    update_every: int = 1

    def __call__(self, t: int) -> float:
        t = max(t, 0)
        return (t / (t + self.update_every)) ** (self.gamma + 1)


@dataclasses.dataclass(frozen=True, repr=False)
class _CumulativeAverage(_Schedule, factory="cumulative_average"):
    update_every: int = 1

    def __call__(self, t: int) -> float:
        t = max(t, 0)
        return t / (t + self.update_every)


def describe(schedule: object) -> str:
    """A one-line description of a decay schedule, for file headers and logs.

    emakit's schedules describe themselves as the factory call that builds them; ``None``
    is the default inverse-gamma warm-up; any other callable is named by its qualified
    name (its values cannot be known).

    Example:
        >>> describe(linear_warmup(beta=0.999, warmup=1000))
        'linear_warmup(beta=0.999, warmup=1000)'
        >>> describe(None)
        'inverse_gamma'
    """
    if schedule is None:
        return "inverse_gamma"
    if isinstance(schedule, _Schedule):
        return repr(schedule)
    return str(getattr(schedule, "__qualname__", None) or type(schedule).__name__)


def _beta(name: str, value: object) -> float:
    return check.real(name, value, low=0.0, high=1.0)


def _steps(name: str, value: object, *, low: int = 1) -> int:
    return check.integer(name, value, low=low)


def constant(beta: float) -> Callable[[int], float]:
    """The same decay at every step: a plain EMA, no warm-up.

    .. math:: \\text{decay}(t) = \\beta

    The weight of a model ``k`` updates old is ``(1 - beta) * beta ** k``, so the EMA
    averages over about ``1 / (1 - beta)`` updates. The first update is still a copy
    (the EMA never asks a schedule for ``t = 0``).

    Args:
        beta: the decay, in ``[0, 1]``; 1 freezes the EMA.

    Example:
        >>> s = constant(0.999)
        >>> s(0), s(10_000)
        (0.999, 0.999)
        >>> s
        constant(beta=0.999)
    """
    return _Constant(_beta("beta", beta))


def linear_warmup(beta: float, warmup: int) -> Callable[[int], float]:
    """A decay that rises linearly to ``beta`` (the warm-up of many hand-written EMAs).

    .. math:: \\text{decay}(t) = \\min\\big(\\beta,\\ (1 + t) / (\\text{warmup} + 1)\\big)

    The decay reaches ``beta`` at ``t = beta * (warmup + 1) - 1`` (just before
    ``t = warmup``) and stays there.

    Args:
        beta: the final decay, in ``[0, 1]``.
        warmup: the length of the ramp in optimizer steps, an int >= 0 (0: no warm-up).

    Example:
        >>> s = linear_warmup(beta=0.999, warmup=1000)
        >>> s(1), s(499), s(5000)
        (0.001998001998001998, 0.4995004995004995, 0.999)
    """
    return _LinearWarmup(_beta("beta", beta), _steps("warmup", warmup, low=0))


def torch_ema_warmup(beta: float) -> Callable[[int], float]:
    """The warm-up of torch_ema (``use_num_updates=True``) and of diffusers'
    ``EMAModel(use_ema_warmup=False)``.

    .. math:: \\text{decay}(t) = \\min\\big(\\beta,\\ (1 + t) / (10 + t)\\big)

    The decay reaches 0.999 at ``t = 8990`` and 0.9999 at ``t = 89990``. Which update
    gets which ``t``:

    * diffusers: its ``optimization_step`` ``k`` uses ``t = k - update_after_step - 1``,
      as emakit's call ``k`` does, so with the same ``update_after_step`` the decays are
      the same floats update for update.
    * torch_ema: its update ``n`` (counted from 1) uses ``t = n`` and already averages
      with the weights it was built with, where emakit's call ``n`` uses ``t = n - 1`` and
      its first call copies. Build ``EMA(model, schedule=torch_ema_warmup(beta),
      update_after_step=0, update_every=1)`` and call ``update()`` once right away: that
      call copies the starting weights (torch_ema's starting average), and every later
      call uses the decay of the matching torch_ema update, as the same float.

    The weights then agree to rounding, not bit for bit: torch_ema and diffusers (with
    its default ``foreach=False``) compute ``s - (1 - d) * (s - p)``, rounding three
    times, where emakit computes ``s.lerp_(p, 1 - d)``. Over 300 noisy-SGD steps of a
    small float32 model the largest difference was 3.0e-8, about one ulp of the largest
    weights (``tests/test_migration_peers.py`` holds every tensor within 4 float32
    epsilons of its largest weight).

    Args:
        beta: the ceiling of the decay, in ``[0, 1]``.

    Example:
        >>> s = torch_ema_warmup(beta=0.9999)
        >>> s(1), s(90)
        (0.18181818181818182, 0.91)
    """
    return _TorchEMAWarmup(_beta("beta", beta))


def half_life(steps: float) -> Callable[[int], float]:
    """A constant decay given as a half-life in *optimizer steps*, whatever ``update_every``.

    .. math:: \\text{decay}_\\text{step} = 0.5^{1/\\text{steps}},\\qquad
       \\text{decay}_\\text{update} = \\text{decay}_\\text{step}^{\\,\\text{update\\_every}}

    The returned schedule sets ``per_optimizer_step = True``, so the EMA raises the
    per-step decay to the power ``update_every`` on each update it performs: a model
    ``k`` optimizer steps old weighs ``0.5 ** (k / steps)`` relative to the newest, and a
    step change of the weights is half absorbed after ``steps`` optimizer steps (to
    within one update interval) for any ``update_every``. A half-life of ``h`` steps is
    ``beta ~ 1 - ln(2) / h``: 693 steps ~ 0.999, 6931 steps ~ 0.9999.

    Args:
        steps: the half-life in optimizer steps, a finite number > 0.

    Example:
        >>> s = half_life(693)
        >>> round(s(0), 7), s.per_optimizer_step
        (0.9990003, True)
    """
    return _HalfLife(check.real("steps", steps, low=0.0, low_open=True))  # finite: (0, inf)


def linear_ramp(beta0: float, beta1: float, steps: int) -> Callable[[int], float]:
    """A decay that moves linearly from ``beta0`` to ``beta1`` over ``steps`` steps.

    .. math:: \\text{decay}(t) = \\beta_0 + (\\beta_1 - \\beta_0)\\,\\min(t / \\text{steps},\\ 1)

    The "dynamic decay" recipe (e.g. 0.9 to 0.999 over the whole run); ``beta1`` holds
    after ``steps``.

    Args:
        beta0: the decay at ``t = 0``, in ``[0, 1]``.
        beta1: the decay from ``t = steps`` on, in ``[0, 1]``.
        steps: the length of the ramp in optimizer steps, an int >= 1.

    Example:
        >>> s = linear_ramp(0.9, 0.999, steps=10_000)
        >>> s(0), round(s(5_000), 4), s(20_000)
        (0.9, 0.9495, 0.999)
    """
    return _LinearRamp(_beta("beta0", beta0), _beta("beta1", beta1), _steps("steps", steps))


def cosine_momentum(beta0: float, total_steps: int, beta1: float = 1.0) -> Callable[[int], float]:
    """The BYOL / DINO teacher momentum: a half cosine from ``beta0`` up to ``beta1``.

    .. math:: \\text{decay}(t) = \\beta_1 - (\\beta_1 - \\beta_0)\\,
       \\frac{\\cos(\\pi \\min(t, T) / T) + 1}{2}, \\qquad T = \\text{total\\_steps}

    Starts at ``beta0`` and reaches ``beta1`` at ``t = total_steps`` with zero slope
    (BYOL: ``beta0=0.996``, DINO: ``0.996`` or ``0.9995``, ``beta1=1``). With
    ``update_after_step=0`` the last call of a run of ``total_steps`` optimizer steps sees
    ``t = total_steps - 1``.

    Args:
        beta0: the momentum at ``t = 0``, in ``[0, 1]``.
        total_steps: ``T``, the optimizer steps of the run, an int >= 1.
        beta1: the final momentum, in ``[0, 1]``. Default 1.0.

    Example:
        >>> s = cosine_momentum(0.996, total_steps=1000)
        >>> s(0), s(500), s(1000)
        (0.996, 0.998, 1.0)
    """
    return _CosineMomentum(
        _beta("beta0", beta0), _steps("total_steps", total_steps), _beta("beta1", beta1)
    )


def power_function(gamma: float, update_every: int = 1) -> Callable[[int], float]:
    """The power-function EMA of Karras et al. 2024 (arXiv:2312.02696, Eq. 2).

    .. math:: \\text{decay}(t) = \\Big(1 - \\frac{1}{n + 1}\\Big)^{\\gamma + 1}
       = \\Big(\\frac{t}{t + \\text{update\\_every}}\\Big)^{\\gamma + 1},
       \\qquad n = t / \\text{update\\_every}

    The paper writes ``beta(t) = (1 - 1/t) ** (gamma + 1)`` with ``t = 1`` the first model
    averaged (``beta = 0``, a copy). Here that first model is the copy the EMA makes at
    ``t = 0``, so after the update at ``t`` there are ``n + 1`` averaged models and the
    paper's ``t`` is ``n + 1``. The shadow is then a weighted average of the models seen
    with weights growing like ``k ** gamma`` (``k`` counts the averaged models), and
    ``gamma = 0`` is exactly [`cumulative_average()`][emakit.schedules.cumulative_average]. The per-update decay depends on
    the update count, so pass the EMA's ``update_every`` here (and keep
    ``update_after_step`` a multiple of it); ``sigma_rel`` 0.05 is ``gamma ~ 16.97``,
    0.10 is ``gamma ~ 6.94``.

    Args:
        gamma: the exponent of the averaging profile, a finite number > -1.
        update_every: the EMA's ``update_every``, an int >= 1. Default 1.

    Example:
        >>> s = power_function(gamma=0)
        >>> s(1), s(3)
        (0.5, 0.75)
    """
    gamma = check.real("gamma", gamma, low=-1.0, low_open=True)  # finite: (-1, inf)
    return _PowerFunction(gamma, _steps("update_every", update_every))


def cumulative_average(update_every: int = 1) -> Callable[[int], float]:
    """An equal-weight average of every model averaged so far (SWA).

    .. math:: \\text{decay}(t) = \\frac{n}{n + 1} = \\frac{t}{t + \\text{update\\_every}},
       \\qquad n = t / \\text{update\\_every}

    After the update at ``t`` the shadow has averaged ``n + 1`` models: the copy made
    when averaging began (at ``t = 0``) and the ``n`` updated in since, so giving the
    newest the weight ``1 / (n + 1)`` keeps the average exact. With
    ``EMA(model, schedule=cumulative_average(), update_after_step=0, update_every=1)``
    the EMA is the running mean of the weights at every ``update()`` call; with
    ``update_every=k`` pass ``cumulative_average(update_every=k)`` (and keep
    ``update_after_step`` a multiple of ``k``) to average the models at the updating
    calls. ``min_value`` would bend the average: leave it at 0.

    Args:
        update_every: the EMA's ``update_every``, an int >= 1. Default 1.

    Example:
        >>> s = cumulative_average()
        >>> s(1), s(3)
        (0.5, 0.75)
    """
    return _CumulativeAverage(_steps("update_every", update_every))
