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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .errors import EMATypeError, EMAValueError

__all__ = ["Schedule", "inverse_gamma", "inverse_gamma_float32"]


@runtime_checkable
class Schedule(Protocol):
    """``t -> decay``: the decay to apply at ``t`` steps after averaging began."""

    def __call__(self, t: int, /) -> float: ...


def _check_real(
    name: str, value: object, *, low: float, high: float, low_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EMATypeError(
            f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})"
        )
    v = float(value)
    if not math.isfinite(v) or v < low or v > high or (low_open and v == low):
        bracket = "(" if low_open else "["
        raise EMAValueError(f"{name} must be in {bracket}{low}, {high}], got {name}={value!r}")
    return v


def inverse_gamma_float32(
    t: int, *, beta: float, inv_gamma: float, power: float, min_value: float
) -> float:
    """The inverse-gamma warm-up decay computed in float32, bit-identical to ema-pytorch.

    .. math:: \\text{decay}(t) = \\text{clamp}\\big(1 - (1 + t/\\gamma^{-1})^{-p},\\ \\text{min\\_value},\\ \\beta\\big),
       \\qquad \\text{decay}(0) = 0

    ema-pytorch 0.8.3 evaluates this formula on float32 tensors; repeating the same
    tensor operations here gives the same bits, so an emakit EMA and an ema-pytorch EMA
    fed the same weights agree exactly. The work is a handful of CPU scalar ops: no
    device is touched, so no host-device sync happens.
    """
    if t <= 0:
        return 0.0
    epoch = torch.tensor(t).clamp(min=0.0)
    value = 1 - (1 + epoch / inv_gamma) ** -power
    return value.clamp(min=min_value, max=beta).item()


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
    beta = _check_real("beta", beta, low=0.0, high=1.0)
    inv_gamma = _check_real("inv_gamma", inv_gamma, low=0.0, high=math.inf, low_open=True)
    power = _check_real("power", power, low=0.0, high=math.inf, low_open=True)
    min_value = _check_real("min_value", min_value, low=0.0, high=beta)

    def schedule(t: int) -> float:
        return inverse_gamma_float32(
            t, beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value
        )

    schedule.__doc__ = (
        f"inverse_gamma(beta={beta}, inv_gamma={inv_gamma}, power={power}, min_value={min_value})"
    )
    return schedule
