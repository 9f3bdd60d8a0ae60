"""Argument checks shared by the public constructors. Each raises an EMAError naming the
argument, echoing the value, and saying what would be accepted."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import EMAStateError, EMATypeError, EMAValueError


def few(items: list[str], n: int = 10) -> str:
    """The first ``n`` of ``items`` and how many there are, for messages (``none`` when empty)."""
    return f"{items[:n]}{' ...' if len(items) > n else ''} ({len(items)})" if items else "none"


def _plain(value: object) -> object:
    """A 0-dim real tensor as its Python number (one read, when an argument is checked);
    anything else unchanged. A bool tensor gives a bool, which the callers refuse."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        return value.item()
    return value


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
    emakit (EMA keywords, schedules, post-hoc profiles) is checked here. Any
    ``numbers.Real`` (numpy's floats and integers included) and a 0-dim real tensor are
    taken, as the peers take them, and returned as a Python float.

    Booleans, NaN and infinities are refused; an infinite bound is always open, so the
    message shows the interval actually accepted, e.g. ``(0.0, inf)``. ``hint`` is
    appended to the message (what the values mean, typical values).
    """
    number = _plain(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise EMATypeError(
            f"{name} must be a real number, got {name}={value!r} ({type(value).__name__})"
        )
    v = float(number)
    low_open = low_open or math.isinf(low)
    high_open = high_open or math.isinf(high)
    above = low < v if low_open else low <= v
    below = v < high if high_open else v <= high
    if not (math.isfinite(v) and above and below):
        lb, hb = "(" if low_open else "[", ")" if high_open else "]"
        raise EMAValueError(
            f"{name} must be a finite number in {lb}{low:g}, {high:g}{hb}, got {name}={value!r}"
            + (f"; {hint}" if hint else "")
        )
    return v


#: The largest count an EMA keeps: its counters (``step`` ...) are int64 tensors.
INT64_MAX = 2**63 - 1


def integer(name: str, value: object, *, low: int, high: int = INT64_MAX) -> int:
    """``value`` as an int in ``[low, high]`` (booleans are refused); ``high`` defaults to
    [`INT64_MAX`][emakit._validate.INT64_MAX], the range of the int64 counters every count ends up in.
    Any ``numbers.Integral`` (numpy's integers) and a 0-dim integer tensor are taken, as an int."""
    number = _plain(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise EMATypeError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    value = int(number)
    if value < low:
        raise EMAValueError(f"{name} must be >= {low}, got {name}={value!r}")
    if value > high:
        raise EMAValueError(
            f"{name} must be <= {high}, got {name}={value!r}"
            + ("; emakit's counters are int64" if high == INT64_MAX else "")
        )
    return value


def count(name: str, value: object) -> int:
    """A count >= 0 given as an int or a 1-element integer tensor (``ema.step += 1``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise EMATypeError(
                f"{name} must be an int or a 1-element integer tensor, got {name}={value!r}"
            )
        value = int(value)
    return integer(name, value, low=0)


def optional_integer(name: str, value: object, *, low: int) -> int | None:
    """``value`` as an int >= ``low``, or None."""
    return None if value is None else integer(name, value, low=low)


def boolean(name: str, value: object) -> bool:
    """``value`` if it is a bool (0/1 and other truthy values are refused)."""
    if not isinstance(value, bool):
        raise EMATypeError(
            f"{name} must be True or False, got {name}={value!r} ({type(value).__name__})"
        )
    return value


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


def device(name: str, value: object) -> torch.device | None:
    """``value`` as a ``torch.device`` (a str naming one, or a device; None stays None)."""
    if value is None or isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise EMATypeError(f"{name} must be a str or torch.device, got {name}={value!r}")
    try:
        return torch.device(value)
    except RuntimeError as e:
        raise EMAValueError(
            f"{name} must name a torch device such as 'cpu', got {name}={value!r}"
        ) from e


def floating_dtype(name: str, value: object) -> torch.dtype | None:
    """``value`` if it is a floating ``torch.dtype`` or None."""
    if value is None:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise EMATypeError(
            f"{name} must be a floating torch.dtype such as torch.float32, got {name}={value!r}"
        )
    return value


#: Largest counter (step, update count, layout version) accepted from a file or a state:
#: 2**53, the largest integer every float64 schedule computation represents exactly.
MAX_COUNT = 2**53


def _stored_number(value: object) -> object:
    """A 1-element tensor as its Python number; anything else unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"a tensor of shape {tuple(value.shape)}, not a single number")
    return value.item()  # a bool or complex tensor gives a bool or complex: refused below


def _count_value(value: object, text: bool) -> int:
    value = _stored_number(value)
    if isinstance(value, str):
        digits = value.strip()
        if not (text and digits.lstrip("+-").isdigit() and len(digits) <= 40):
            raise ValueError("not a whole number" if text else "text, not a number")
        return int(digits)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, bool) and hasattr(value, "__index__"):  # an int, numpy's too
        return operator.index(value)
    raise ValueError(f"a {type(value).__name__}, not a whole number")


def _stored(source: str, field: str, value: object, what: str, parse: Callable[[], Any]) -> Any:
    """``parse()``, or an [`EMAStateError`][emakit.errors.EMAStateError] naming ``source``,
    ``field``, what it must be, the value and why (the error ``parse`` raised)."""
    try:
        return parse()
    except (ValueError, TypeError, RuntimeError, OverflowError) as e:
        text = repr(value)
        text = text if len(text) <= 80 else text[:77] + "..."
        raise EMAStateError(
            f"{source}: {field} must be {what}, got {field}={text} ({e}); the file or state "
            f"is corrupt or was not written by an EMA library"
        ) from None


def stored_count(
    source: str, field: str, value: object, *, low: int = 0, text: bool = False
) -> int:
    """A counter read from a file or a state (a step, an update count, a version), checked.

    Accepted: an int, a float or a 1-element tensor holding a whole number, and with
    ``text`` a string of decimal digits (safetensors header entries); in
    ``[low, MAX_COUNT]``.

    Args:
        source: what it was read from, for the message (a file name, ``"state_dict"``).
        field: the field's name.
        value: the value read.
        low: the smallest value accepted. Default 0.
        text: also accept a string of digits (a header entry). Default False.

    Raises:
        EMAStateError: anything else (negative, huge, fractional, NaN, a vector, a bool,
            text), naming ``source``, ``field`` and the value.
    """

    def parse() -> int:
        count = _count_value(value, text)
        if not low <= count <= MAX_COUNT:
            raise ValueError(f"outside [{low}, 2**53]")
        return count

    return _stored(source, field, value, f"a whole number in [{low}, 2**53]", parse)  # type: ignore[no-any-return]


def stored_real(source: str, field: str, value: object) -> float:
    """A real number read from a file or a state (e.g. a gamma), finite; or an
    [`EMAStateError`][emakit.errors.EMAStateError] naming ``source`` and ``field``."""

    def parse() -> float:
        number = _stored_number(value)
        if isinstance(number, (bool, str)) or not isinstance(number, (int, float)):
            raise ValueError(f"a {type(number).__name__}, not a number")
        if not math.isfinite(number):
            raise ValueError("not finite")
        return float(number)

    return _stored(source, field, value, "a finite number", parse)  # type: ignore[no-any-return]


def stored_flag(source: str, field: str, value: object) -> bool:
    """A flag read from a file or a state (``initted``): a bool, or 0/1 as a number or a
    1-element tensor; or an [`EMAStateError`][emakit.errors.EMAStateError] naming ``source`` and ``field``."""

    def parse() -> bool:
        number = _stored_number(value)
        if isinstance(number, (bool, int, float)) and number in (0, 1):
            return bool(number)
        raise ValueError("not True/False or 0/1")

    return _stored(source, field, value, "True or False", parse)  # type: ignore[no-any-return]


def not_newer(what: str, field: str, version: object, supported: int) -> None:
    """Refuse a state, file or snapshot written in a newer layout than this emakit reads.

    Args:
        what: what holds it, for the message (``"state_dict"``, a file name).
        field: the version field's name (``"version"``, ``"format_version"``).
        version: the value found (None or absent: an old, unversioned layout, accepted).
        supported: the newest version this emakit reads.

    Raises:
        EMAStateError: the version is newer than ``supported``, or malformed (not a whole
            number >= 0: text, a fraction, a vector, a bool), naming ``what`` and ``field``.
    """
    if version is None:
        return
    found = stored_count(what, field, version, text=True)
    if found > supported:
        raise EMAStateError(
            f"{what} has {field}={found}, newer than this emakit's {supported}; "
            f"upgrade emakit to read it"
        )
