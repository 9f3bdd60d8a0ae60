"""The decay rule: what one ``update()`` call does, as a pure function of the call count.

Every EMA kind (``EMA``, its decay groups, ``MultiEMA``, ``KarrasEMA``) asks one
[`DecayRule`][emakit.decay.DecayRule] what a call does:

.. math:: \\text{action}(s, \\ell) = \\begin{cases}
   \\text{skip} & s \\bmod \\text{update\\_every} \\ne 0 \\\\
   \\text{copy} & s \\le \\text{update\\_after\\_step} \\\\
   \\text{hold} & \\text{frozen} \\\\
   \\text{lerp}\\big(1 - d_g(s + 1, \\ell)\\big)_g & \\text{otherwise}
   \\end{cases}

where ``s`` is the number of calls before this one (ema-pytorch's ``step`` before its
increment), ``ℓ`` the call number of the last update that averaged (or of the first,
initializing copy), and ``d_g`` the decay of decay group ``g``. The first call of all is
always the initializing copy; the owner handles it before asking the rule.

An EMA's rule is a [`ScheduleRule`][emakit.decay.ScheduleRule]: each group follows a
``t -> decay`` schedule (see [`emakit.schedules`][emakit.schedules]; the inverse-gamma warm-up
is just the default schedule, and any other is checked by [`ScheduleDecay`][emakit.decay.ScheduleDecay]).
A plain [`DecayRule`][emakit.decay.DecayRule] takes decays ``(call, last) -> decay``, such as
[`PowerDecay`][emakit.decay.PowerDecay], the power-function decay of Karras et al.
(arXiv:2312.02696), which depends on the gap to the last averaging update.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

from . import _validate as check
from .errors import EMATypeError, EMAValueError
from .schedules import Schedule, describe, inverse_gamma

__all__ = [
    "COPY",
    "HOLD",
    "INIT",
    "SKIP",
    "Action",
    "BEMARule",
    "Decay",
    "DecayRule",
    "PowerDecay",
    "ScheduleDecay",
    "ScheduleRule",
    "bema_alpha",
    "bema_beta",
    "bema_rule",
    "ema_rule",
]


@dataclass(frozen=True, init=False)
class Action:
    """What one ``update()`` call does to the EMA weights.

    ``kind`` is ``"skip"`` (nothing), ``"init"`` (the first call: copy the model),
    ``"copy"`` (warm-up: copy the model), ``"hold"`` (an averaging call of a frozen EMA:
    nothing moves, but it counts as an averaging update) or ``"lerp"``
    (``shadow.lerp_(online, weights[group])``). ``call`` is the call number (1-based).
    ``guard`` (set by ``skip_nonfinite=True``) is a 0-dim bool tensor on the device: the
    copy or lerp happens only where it is true (see `emakit._engine.finite`).
    ``bias`` is BEMA's bias-correction weight ``alpha_t`` of a ``"lerp"`` (see
    [`BEMARule`][emakit.decay.BEMARule]; 0 for every other kind of EMA).
    """

    kind: Literal["skip", "init", "copy", "hold", "lerp"]
    weights: tuple[float, ...] = ()
    call: int = 0
    guard: Any = field(default=None, compare=False, repr=False)
    bias: float = 0.0

    def __init__(
        self,
        kind: Literal["skip", "init", "copy", "hold", "lerp"],
        weights: tuple[float, ...] = (),
        call: int = 0,
        guard: Any = None,
        bias: float = 0.0,
    ) -> None:
        # One dict update instead of a frozen dataclass's five object.__setattr__ calls:
        # an Action is made on every update (0.4 µs of a small one's host time).
        self.__dict__.update(kind=kind, weights=weights, call=call, guard=guard, bias=bias)

    @property
    def averages(self) -> bool:
        """Whether this is an averaging call (``"lerp"`` or ``"hold"``)."""
        return self.kind in ("lerp", "hold")


SKIP = Action("skip")
INIT = Action("init")
COPY = Action("copy")
HOLD = Action("hold")


class Decay(Protocol):
    """``(call, last) -> decay`` for an averaging update at 1-based ``call``, the last
    averaging (or initializing) update having been at ``last``."""

    def __call__(self, call: int, last: int, /) -> float: ...


class ScheduleDecay:
    """A user's ``t -> decay`` schedule, checked, as a decay group of a
    [`ScheduleRule`][emakit.decay.ScheduleRule].

    .. math:: d(t) = \\text{clamp}(\\text{schedule}(t), \\text{floor}, 1), \\quad d(t \\le 0) = 0

    A schedule with ``per_optimizer_step = True`` is raised to the power
    ``update_every``. A decay outside ``[0, 1]`` (or NaN), or a value that is not a real
    number, raises, naming the schedule and ``t``.

    Args:
        schedule: the ``t -> decay`` callable.
        update_every: calls between updates.
        floor: the lowest decay (``min_value``). Default 0.
    """

    def __init__(self, schedule: Schedule, *, update_every: int, floor: float = 0.0) -> None:
        self.schedule = schedule
        self.power = update_every if getattr(schedule, "per_optimizer_step", False) else 1
        self.floor = floor

    def __repr__(self) -> str:
        return describe(self.schedule)

    def __call__(self, t: int) -> float:
        if t <= 0:
            return 0.0
        value = self.schedule(t)
        try:  # a real number (a 0-dim tensor too); a string or a bool is a bug in the schedule
            if isinstance(value, (str, bytes, bool)):
                raise TypeError(type(value).__name__)
            decay = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise EMATypeError(
                f"the decay schedule {self.schedule!r} returned {value!r} "
                f"({type(value).__name__}) at t={t}; a schedule returns a float in [0, 1]"
            ) from None
        if not 0.0 <= decay <= 1.0:  # also catches NaN
            raise EMAValueError(
                f"the decay schedule {self.schedule!r} returned {decay!r} at t={t}; "
                f"a decay must be in [0, 1]"
            )
        return min(max(decay**self.power, self.floor), 1.0)


@dataclass(frozen=True, repr=False)
class PowerDecay:
    """The power-function decay (arXiv:2312.02696, Eq. 1 generalized to a gap ``dt``).

    .. math:: \\beta = \\Big(1 - \\frac{\\Delta t}{t}\\Big)^{\\gamma + 1},
       \\quad t = \\text{call},\\ \\Delta t = \\text{call} - \\text{last}

    Args:
        gamma: the profile exponent, > 0.
        beta: the function ``(t, dt, gamma) -> beta`` (see
            [`emakit.posthoc.math.power_function_beta()`][emakit.posthoc.math.power_function_beta]).
    """

    gamma: float
    beta: Callable[[float, float, float], float]

    def __repr__(self) -> str:
        return f"power_function(gamma={self.gamma!r})"

    def __call__(self, call: int, last: int) -> float:
        return self.beta(call, call - last, self.gamma)


class DecayRule:
    """The pure rule of an EMA: ``action(step, last)`` (see the module docstring).

    Args:
        decays: one [`Decay`][emakit.decay.Decay] per decay group (group 0 the default); ``None`` marks
            a frozen group (beta 1: its weight is 0).
        update_every: only calls with ``step % update_every == 0`` do work.
        update_after_step: calls with ``step <= update_after_step`` copy.
        frozen: the whole EMA is frozen (beta 1): averaging calls hold.
    """

    def __init__(
        self,
        decays: Sequence[Any],
        *,
        update_every: int,
        update_after_step: int,
        frozen: bool = False,
    ) -> None:
        self.decays = tuple(decays)
        self.update_every = update_every
        self.update_after_step = update_after_step
        self.frozen = frozen

    def action(self, step: int, last: int) -> Action:
        """What the call after ``step`` earlier calls does (``last``: see the module)."""
        if step % self.update_every:
            return SKIP
        if step <= self.update_after_step:
            return COPY
        if self.frozen:
            return Action("hold", call=step + 1)
        return Action("lerp", self.weights(step + 1, last), step + 1)

    def weights(self, call: int, last: int) -> tuple[float, ...]:
        """``1 - decay`` of every group for an averaging update at ``call``."""
        return tuple(0.0 if d is None else 1.0 - d(call, last) for d in self.decays)

    def decay(self, call: int, last: int = 0, group: int = 0) -> float:
        """The decay of ``group`` for an averaging update at ``call`` (1 when frozen)."""
        d = self.decays[group]
        return 1.0 if d is None else d(call, last)

    def settings(self) -> dict[str, str]:
        """The rule's settings as text, by name: what the ranks of a distributed job must
        agree on (see `emakit._dist.collectives.agree`). The ``decay`` entry lists every
        decay group's decay (``frozen`` for beta 1) with its parameters (beta, inv_gamma,
        power, min_value; a schedule by its description and floor)."""
        return {
            "update_every": str(self.update_every),
            "update_after_step": str(self.update_after_step),
            "decay (beta, inv_gamma, power, min_value, schedule, decay_groups)": "; ".join(
                map(_describe, self.decays)
            ),
        }


def _describe(decay: Any) -> str:
    if decay is None:
        return "frozen"
    if isinstance(decay, ScheduleDecay):
        return f"{decay!r} floored at {decay.floor!r}"
    return repr(decay)


class ScheduleRule(DecayRule):
    """The rule of an [`EMA`][emakit.EMA]: every decay group follows a ``t -> decay``
    schedule, ema-pytorch's way.

    .. math:: t = \\text{call} - \\text{update\\_after\\_step} - 1

    ``decays`` holds the schedules (``None`` for a frozen group): the default inverse-gamma
    warm-up is the [`inverse_gamma()`][emakit.schedules.inverse_gamma] schedule itself (0 for
    ``t <= 0``, float32 as in ema-pytorch), any other is a [`ScheduleDecay`][emakit.decay.ScheduleDecay].
    Built by [`ema_rule()`][emakit.decay.ema_rule].
    """

    def weights(self, call: int, last: int) -> tuple[float, ...]:
        t = call - self.update_after_step - 1
        weights = []
        for schedule in self.decays:  # a loop, not a generator: no Python call per group
            weights.append(0.0 if schedule is None else 1.0 - schedule(t))
        return tuple(weights)

    def decay(self, call: int, last: int = 0, group: int = 0) -> float:
        schedule = self.decays[group]
        return 1.0 if schedule is None else schedule(call - self.update_after_step - 1)


def ema_rule(
    *,
    beta: float,
    update_after_step: int,
    update_every: int,
    inv_gamma: float,
    power: float,
    min_value: float,
    schedule: Callable[[int], float] | None = None,
    decay_groups: Mapping[str, float | Callable[[int], float]] | None = None,
) -> ScheduleRule:
    """The rule of an [`EMA`][emakit.EMA] from its keywords, each validated here.

    Without ``schedule`` the default group follows the inverse-gamma warm-up
    ([`inverse_gamma()`][emakit.schedules.inverse_gamma] with ``beta``, ``inv_gamma``, ``power``,
    ``min_value``); with it, ``schedule`` floored at ``min_value``. Each value of
    ``decay_groups`` (name patterns to a beta or a schedule) is another decay group, in
    order: a beta (the same warm-up with that ceiling; 1 freezes the group) or a
    schedule. The EMA is frozen (averaging calls hold) when ``beta == 1`` without a
    schedule and every extra group is frozen too.

    Raises:
        EMAValueError, EMATypeError: a keyword out of range or of the wrong type.
    """
    update_after_step = check.integer("update_after_step", update_after_step, low=0)
    update_every = check.integer("update_every", update_every, low=1)
    if schedule is not None and not callable(schedule):
        raise EMATypeError(
            f"schedule must be a callable t -> decay (see emakit.schedules), got {schedule=!r}"
        )
    # inverse_gamma() checks beta, inv_gamma, power and min_value (<= beta, unless a
    # schedule replaces the warm-up)
    default = inverse_gamma(beta, inv_gamma, power, min_value if schedule is None else 0.0)
    min_value = check.real("min_value", min_value, low=0.0, high=1.0)

    def warmup(ceiling: float) -> Callable[[int], float]:
        return inverse_gamma(ceiling, inv_gamma, power, min(min_value, ceiling))

    def checked(schedule: Callable[[int], float]) -> Callable[[int], float]:
        return ScheduleDecay(schedule, update_every=update_every, floor=min_value)

    decays: list[Any] = [default if schedule is None else checked(schedule)]  # None: frozen
    if decay_groups is not None and not isinstance(decay_groups, Mapping):
        raise EMATypeError(
            f"decay_groups must map name patterns to a beta or a schedule, e.g. "
            f'{{"backbone.*": 0.999, "head.*": 0.99}}, got {type(decay_groups).__name__}'
        )
    for pattern, rule in (decay_groups or {}).items():
        if not isinstance(pattern, str):
            raise EMATypeError(f"decay_groups keys must be str patterns, got {pattern!r}")
        if callable(rule):
            decays.append(checked(rule))
        else:  # a frozen group (beta 1) is None: weight 0
            ceiling = check.real(f"decay_groups[{pattern!r}]", rule, low=0.0, high=1.0)
            decays.append(None if ceiling == 1.0 else warmup(ceiling))
    frozen = beta == 1.0 and schedule is None and all(d is None for d in decays[1:])
    return ScheduleRule(
        decays, update_every=update_every, update_after_step=update_after_step, frozen=frozen
    )


# -- BEMA ------------------------------------------------------------------------------------


def bema_beta(
    t: int, *, lag: float, multiplier: float, ema_power: float, min_ema_multiplier: float
) -> float:
    """BEMA's EMA weight at step ``t`` (TRL's ``BEMACallback._ema_beta``, to the same bits).

    .. math:: \\beta_t = \\max\\big((\\rho + \\gamma t)^{-\\kappa},\\ \\beta_{\\min}\\big)

    with ``rho = lag``, ``gamma = multiplier``, ``kappa = ema_power`` and
    ``beta_min = min_ema_multiplier``. The EMA moves as ``ema += beta_t * (theta_t - ema)``:
    ``beta_t`` is the weight of the *new* value (``1 - decay`` in ema-pytorch's terms).
    """
    return max((lag + multiplier * t) ** (-ema_power), min_ema_multiplier)


def bema_alpha(t: int, *, lag: float, multiplier: float, bias_power: float) -> float:
    """BEMA's bias-correction weight at step ``t`` (TRL's ``BEMACallback._bema_alpha``).

    .. math:: \\alpha_t = (\\rho + \\gamma t)^{-\\eta}, \\quad \\eta = \\text{bias\\_power}
    """
    return (lag + multiplier * t) ** (-bias_power)


@dataclass(repr=False, eq=False)
class BEMARule(DecayRule):
    """The rule of a BEMA (bias-corrected EMA, Block et al. 2025, arXiv:2508.00180), with
    TRL's ``BEMACallback`` timing: ``t`` is the 1-based call number (the Trainer's
    ``global_step`` after the optimizer step), ``tau = update_after``, ``phi = update_freq``.

    .. math:: \\text{action}(t) = \\begin{cases}
       \\text{skip} & t < \\tau \\\\
       \\text{copy} & t = \\tau \\quad (\\theta_0 \\leftarrow \\theta_t,\\ \\text{ema} \\leftarrow \\theta_t) \\\\
       \\text{lerp}(\\beta_t;\\ \\alpha_t) & t > \\tau,\\ (t - \\tau) \\bmod \\phi = 0 \\\\
       \\text{skip} & \\text{otherwise}
       \\end{cases}

    A ``"lerp"`` carries ``weights=(beta_t,)`` and ``bias=alpha_t`` (see [`bema_beta`][emakit.decay.bema_beta]
    and [`bema_alpha`][emakit.decay.bema_alpha]). Build it with [`bema_rule`][emakit.decay.bema_rule],
    which validates the numbers; its settings are its fields.
    """

    update_freq: int
    ema_power: float
    bias_power: float
    lag: float
    update_after: int
    multiplier: float
    min_ema_multiplier: float

    def __post_init__(self) -> None:
        super().__init__([None], update_every=1, update_after_step=0)

    def __repr__(self) -> str:
        settings = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"bema({settings})"

    def beta(self, t: int) -> float:
        """``beta_t`` (see [`bema_beta`][emakit.decay.bema_beta])."""
        return bema_beta(
            t,
            lag=self.lag,
            multiplier=self.multiplier,
            ema_power=self.ema_power,
            min_ema_multiplier=self.min_ema_multiplier,
        )

    def alpha(self, t: int) -> float:
        """``alpha_t`` (see [`bema_alpha`][emakit.decay.bema_alpha])."""
        return bema_alpha(t, lag=self.lag, multiplier=self.multiplier, bias_power=self.bias_power)

    def last_update(self, step: int) -> int:
        """The call ``t <= step`` of the most recent averaging (``"lerp"``) update, 0 if
        none yet: ``tau + phi * floor((step - tau) / phi)`` once ``step >= tau + phi``."""
        since = step - self.update_after
        return step - since % self.update_freq if since >= self.update_freq else 0

    def action(self, step: int, last: int) -> Action:
        """What call ``t = step + 1`` does (see the class docstring)."""
        t = step + 1
        if t < self.update_after:
            return SKIP
        if t == self.update_after:
            return Action("copy", call=t)
        if (t - self.update_after) % self.update_freq:
            return SKIP
        return Action("lerp", (self.beta(t),), t, bias=self.alpha(t))

    def weights(self, call: int, last: int) -> tuple[float, ...]:
        """``(beta_t,)`` at ``call``."""
        return (self.beta(call),)

    def decay(self, call: int, last: int = 0, group: int = 0) -> float:
        """``1 - beta_t`` at ``call`` (the fraction of the old EMA kept)."""
        return 1.0 - self.beta(call)

    def settings(self) -> dict[str, str]:
        """BEMA's settings (its fields) as text, by name."""
        return {f.name: repr(getattr(self, f.name)) for f in fields(self)}


def bema_rule(
    update_freq: int = 400,
    ema_power: float = 0.5,
    bias_power: float = 0.2,
    lag: float = 10,
    update_after: int = 0,
    multiplier: float = 1.0,
    min_ema_multiplier: float = 0.0,
) -> BEMARule:
    """A [`BEMARule`][emakit.decay.BEMARule] from TRL's keywords (TRL's defaults), each
    validated here.

    Raises:
        EMAValueError, EMATypeError: a keyword out of range or of the wrong type, or a
            ``lag`` and ``multiplier`` with ``lag + multiplier * t < 1`` at the first
            averaging update ``t = update_after + update_freq`` while a power is positive
            (``beta_t`` or ``alpha_t`` would exceed 1, up to inf: every accepted setting
            gives weights in [0, 1] at every step).
    """
    update_freq = check.integer("update_freq", update_freq, low=1)
    update_after = check.integer("update_after", update_after, low=0)
    ema_power = check.real("ema_power", ema_power, low=0.0)
    bias_power = check.real("bias_power", bias_power, low=0.0)
    lag = check.real("lag", lag, low=0.0)
    multiplier = check.real("multiplier", multiplier, low=0.0, low_open=True)
    min_ema_multiplier = check.real("min_ema_multiplier", min_ema_multiplier, low=0.0, high=1.0)
    # Both weights are powers of x_t = lag + multiplier * t, which grows with t from the
    # first averaging update t = update_after + update_freq: beta_t <= 1 and alpha_t <= 1
    # (so finite, and the EMA a convex average) for every t exactly when x_t >= 1 there;
    # below 1 a positive power makes a weight above 1, and up to inf as x_t nears 0.
    # With both powers 0 the weights are 1 whatever x_t is.
    first = update_after + update_freq
    x = lag + multiplier * first  # int64 counts: finite, or inf (then weights 0 or 1)
    if (ema_power > 0 or bias_power > 0) and not x >= 1.0:
        positive = {"ema_power": ema_power, "bias_power": bias_power}
        powers = " and ".join(f"{k}={v}" for k, v in positive.items() if v > 0)
        raise EMAValueError(
            f"lag + multiplier * t must be >= 1 at the first BEMA update (t={first}) so that "
            f"beta_t = x ** -ema_power and alpha_t = x ** -bias_power (x = lag + multiplier "
            f"* t) stay <= 1 with {powers}, got {lag=} and {multiplier=} (x = {x:g}); raise "
            f"lag (TRL's default is 10) or multiplier"
        )
    lag = int(lag) if lag.is_integer() else lag  # as TRL shows it: 10, not 10.0
    return BEMARule(
        update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
    )
