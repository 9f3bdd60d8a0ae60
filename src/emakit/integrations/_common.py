"""Helpers shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import inspect
from typing import Any

from ..ema import EMA
from ..errors import EMATypeError

__all__ = ["check_ema_kwargs"]


def check_ema_kwargs(owner: str, ema_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse keywords :class:`~emakit.EMA` does not take, up front (not at fit time).

    Args:
        owner: the class or function receiving the keywords, for the message.
        ema_kwargs: the keywords meant for :class:`~emakit.EMA`.

    Returns:
        ``ema_kwargs`` unchanged.

    Raises:
        EMATypeError: a keyword is unknown, or is ``model`` (the integration supplies it).
    """
    if "model" in ema_kwargs:
        raise EMATypeError(
            f"{owner} passes the training model to EMA itself; drop model= from its keywords"
        )
    params = inspect.signature(EMA.__init__).parameters
    unknown = sorted(set(ema_kwargs) - set(params) - {"self"})
    if unknown:
        known = [p for p in params if p not in ("self", "model")]
        raise EMATypeError(
            f"{owner} got keywords emakit.EMA does not take: {unknown}; EMA accepts {known}"
        )
    return ema_kwargs
