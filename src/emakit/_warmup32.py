"""ema-pytorch's inverse-gamma warm-up decay, computed to the same float32 bits, fast.

ema-pytorch evaluates ``clamp(1 - (1 + t / inv_gamma) ** -power, min_value, beta)`` on a
0-dim float32 tensor: six torch ops, about 10 µs of dispatch per averaging update.
`decay_torch()` repeats those ops. `decay_emulated()` computes the same value
with Python floats, rounding to float32 after each step as torch's CPU kernels do for a
0-dim tensor: the division, addition and subtraction in float32 (exact: each is computed
in double and rounded once, which gives the correctly rounded float32 result), and the
power as torch does it, ``pow(double(base), double(exponent))`` rounded to float32, with
the same C library ``pow``. About 1.5 µs.

Because the second relies on how torch's kernels round, `decay()` uses it only after a
self-check on this machine and torch build: the first time a setting (beta, inv_gamma,
power, min_value) is used, both are compared over 128 steps (the warm-up and large
steps); any difference, or a default dtype other than float32, and every call for that
setting goes through torch.
"""

from __future__ import annotations

import math
import random
import struct

import torch

__all__ = ["decay", "decay_emulated", "decay_torch"]

_F32 = struct.Struct("<f")


def _f32(x: float) -> float:
    return _F32.unpack(_F32.pack(x))[0]


def decay_torch(t: int, beta: float, inv_gamma: float, power: float, min_value: float) -> float:
    """The decay at ``t > 0`` by ema-pytorch's own torch ops (in the default dtype)."""
    # ema-pytorch: an int64 step clamped with a float, i.e. the step in the default float
    # dtype; building that tensor directly gives the same value with one op fewer.
    epoch = torch.tensor(float(t))
    # 1 - (1 + epoch / inv_gamma) ** -power, op for op, without the Python-level wrappers
    # of the reflected operators
    value = torch.rsub(torch.pow(torch.add(torch.div(epoch, inv_gamma), 1), -power), 1)
    return value.clamp(min=min_value, max=beta).item()


def decay_emulated(t: int, beta: float, inv_gamma: float, power: float, min_value: float) -> float:
    """The same float32 value as `decay_torch()`, with Python floats (see the module).

    torch's CPU ``pow`` of a float tensor by a scalar specializes three exponents this
    formula can meet: -0.5 (``1 / sqrt``), -1 (reciprocal) and -2 (``1 / (x * x)``);
    any other is ``pow`` in double precision.
    """
    base = _f32(_f32(_f32(float(t)) / _f32(inv_gamma)) + 1.0)
    if power == 0.5:
        v = _f32(1.0 / _f32(math.sqrt(base)))
    elif power == 1.0:
        v = _f32(1.0 / base)
    elif power == 2.0:
        v = _f32(1.0 / _f32(base * base))
    else:
        v = _f32(math.pow(base, -power))
    v = _f32(1.0 - v)
    return min(max(v, _f32(min_value)), _f32(beta))


def _self_check(beta: float, inv_gamma: float, power: float, min_value: float) -> bool:
    """Whether the emulation gives torch's bits for these settings on this machine."""
    if torch.get_default_dtype() is not torch.float32:
        return False
    rng = random.Random(0)
    steps = [*range(1, 65), *(rng.randint(65, 1 << 26) for _ in range(64))]
    return all(
        decay_emulated(t, beta, inv_gamma, power, min_value)
        == decay_torch(t, beta, inv_gamma, power, min_value)
        for t in steps
    )


#: Settings already checked (see `_self_check()`), with the verdict.
_verified: dict[tuple[float, float, float, float], bool] = {}


def decay(t: int, beta: float, inv_gamma: float, power: float, min_value: float) -> float:
    """ema-pytorch's decay at ``t`` (0 for ``t <= 0``): emulated for settings whose
    self-check passed (see the module docstring), else by torch's own ops."""
    if t <= 0:
        return 0.0
    key = (beta, inv_gamma, power, min_value)
    ok = _verified.get(key)
    if ok is None:
        ok = _verified[key] = _self_check(*key)
    if ok and torch.get_default_dtype() is torch.float32:
        return decay_emulated(t, beta, inv_gamma, power, min_value)
    return decay_torch(t, beta, inv_gamma, power, min_value)
