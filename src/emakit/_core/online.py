"""The online model inside an EMA's state (``online_model.*``), as ema-pytorch saves it.

An EMA built with ``include_online_model=True`` (the default, as ema-pytorch) registers the
online model as its ``online_model`` child, so torch saves and loads it with the EMA.
emakit's own checkpoints leave it out ([`hidden`][emakit._core.online.hidden]), and a state without it loads into
such an EMA, strictly, leaving the model as it is ([`keep_online_model`][emakit._core.online.keep_online_model]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

__all__ = ["NAME", "has_online", "hidden", "keep_online_model", "left_out", "note_left_out"]

#: The child's name, as in ema-pytorch: keys ``online_model.<model's names>``.
NAME = "online_model"
_LEFT_OUT = "_online_left_out"


def has_online(state_dict: Mapping[str, Any], prefix: str = "") -> bool:
    """Whether ``state_dict`` holds any ``<prefix>online_model.*`` key."""
    start = prefix + NAME + "."
    return any(k.startswith(start) for k in state_dict)


@contextlib.contextmanager
def hidden(module: nn.Module) -> Iterator[None]:
    """Hide the ``online_model`` child from torch's walks over the children
    (``state_dict``) for the block; the children's order is kept."""
    modules = module._modules
    module.__dict__["_modules"] = {k: m for k, m in modules.items() if k != NAME}
    try:
        yield
    finally:
        module.__dict__["_modules"] = modules


def left_out(module: nn.Module, hide: bool) -> contextlib.AbstractContextManager[None]:
    """[`hidden`][emakit._core.online.hidden] when ``hide``, else a block that changes nothing."""
    return hidden(module) if hide else contextlib.nullcontext()


def note_left_out(module: nn.Module, state_dict: Mapping[str, Any], prefix: str) -> None:
    """Called from ``_load_from_state_dict``: remember that the state being loaded has no
    online model, for [`keep_online_model`][emakit._core.online.keep_online_model] after the children have loaded."""
    if NAME in module._modules and not has_online(state_dict, prefix):
        module.__dict__[_LEFT_OUT] = prefix


def keep_online_model(module: nn.Module, incompatible: Any) -> None:
    """A load-state-dict post-hook: a state without ``online_model.*`` (emakit's own
    checkpoints, ema-pytorch's with ``include_online_model=False``) is not missing keys;
    the online model is left as it is."""
    prefix = module.__dict__.pop(_LEFT_OUT, None)
    if prefix is not None:
        ours = prefix + NAME + "."
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if not k.startswith(ours)
        ]
