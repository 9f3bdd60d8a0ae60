"""Argument checks shared by the public constructors. Each raises an EMAError naming the
argument, echoing the value, and saying what would be accepted."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .errors import EMAStateError, EMATypeError, EMAValueError


def real(
    name: str,
    value: object,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """``value`` as a finite float within the given bounds; every real-number argument of
    emakit (EMA keywords, schedules, post-hoc profiles) is checked here.

    Booleans, NaN and infinities are refused; an infinite bound is always open, so the
    message shows the interval actually accepted, e.g. ``(0.0, inf)``. ``hint`` is
    appended to the message (what the values mean, typical values).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EMATypeError(
            f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})"
        )
    v = float(value)
    low_open = low_open or math.isinf(low)
    high_open = high_open or math.isinf(high)
    bad = (
        not math.isfinite(v)
        or v < low
        or v > high
        or (low_open and v == low)
        or (high_open and v == high)
    )
    if bad:
        lb, hb = "(" if low_open else "[", ")" if high_open else "]"
        raise EMAValueError(
            f"{name} must be a finite number in {lb}{low:g}, {high:g}{hb}, got {name}={value!r}"
            + (f"; {hint}" if hint else "")
        )
    return v


def integer(name: str, value: object, *, low: int) -> int:
    """``value`` as an int >= ``low`` (booleans are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EMATypeError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if value < low:
        raise EMAValueError(f"{name} must be >= {low}, got {name}={value!r}")
    return value


def count(name: str, value: object) -> int:
    """A count >= 0 given as an int or a 1-element integer tensor (``ema.step += 1``)."""
    numel = getattr(value, "numel", None)
    if callable(numel):  # a tensor
        if numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:  # type: ignore[attr-defined]
            raise EMATypeError(
                f"{name} must be an int or a 1-element integer tensor, got {name}={value!r}"
            )
        value = int(value)  # type: ignore[call-overload]
    return integer(name, value, low=0)


def optional_integer(name: str, value: object, *, low: int) -> int | None:
    """``value`` as an int >= ``low``, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EMATypeError(
            f"{name} must be an int or None, got {name}={value!r} ({type(value).__name__})"
        )
    return integer(name, value, low=low)


def boolean(name: str, value: object) -> bool:
    """``value`` if it is a bool (0/1 and other truthy values are refused)."""
    if not isinstance(value, bool):
        raise EMATypeError(
            f"{name} must be True or False, got {name}={value!r} ({type(value).__name__})"
        )
    return value


def optional_boolean(name: str, value: object) -> bool | None:
    """``value`` if it is a bool or None."""
    return None if value is None else boolean(name, value)


def names(name: str, value: object) -> frozenset[str]:
    """A collection of tensor names. A bare string is refused: it would be read letter by letter."""
    if isinstance(value, str):
        raise EMATypeError(
            f"{name} must be a collection of names, got the single string {name}={value!r}; "
            f"wrap it: {name}=({value!r},)"
        )
    if not isinstance(value, Iterable):
        raise EMATypeError(f"{name} must be a set, list or tuple of str, got {name}={value!r}")
    items = list(value)
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise EMATypeError(f"{name} must contain only str, got {bad[:3]!r} in {name}")
    return frozenset(items)


def floating_dtype(name: str, value: object) -> torch.dtype | None:
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise EMATypeError(
            f"{name} must be a floating torch.dtype such as torch.float32, got {name}={value!r}"
        )
    return value


def not_newer(what: str, field: str, version: object, supported: int) -> None:
    """Refuse a state, file or snapshot written in a newer layout than this emakit reads.

    Args:
        what: what holds it, for the message (``"state_dict"``, a file name).
        field: the version field's name (``"version"``, ``"format_version"``).
        version: the value found (None or absent: an old, unversioned layout, accepted).
        supported: the newest version this emakit reads.
    """
    if version is not None and int(version) > supported:  # type: ignore[call-overload]
        raise EMAStateError(
            f"{what} has {field}={int(version)}, newer than this emakit's {supported}; "  # type: ignore[call-overload]
            f"upgrade emakit to read it"
        )
