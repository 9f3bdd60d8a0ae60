"""emakit: exponential moving averages of PyTorch model weights.

>>> import torch
>>> from emakit import EMA
>>> net = torch.nn.Linear(4, 2)
>>> ema = EMA(net, beta=0.9999)
>>> ema.update()  # after every optimizer.step()

The names below are imported on first use (PEP 562), so ``import emakit`` is cheap and the
``emakit`` command answers ``--help`` and ``--version`` without loading torch; the first
``from emakit import EMA`` imports torch as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_attributes
from ._version import __version__

if TYPE_CHECKING:
    from . import schedules
    from .averaging import interpolate, update_bn
    from .bema import BEMA
    from .checkpoint import load_ema_weights, save_checkpoint, save_ema_weights
    from .ema import EMA, STATE_VERSION, unwrap_model
    from .engine import ema_copy_, ema_lerp_, flatten_parameters
    from .errors import (
        EMAError,
        EMAFileNotFoundError,
        EMARuntimeError,
        EMAStateError,
        EMATypeError,
        EMAValueError,
        EMAWriteError,
    )
    from .foreign import load_foreign_state
    from .multi import MultiEMA
    from .posthoc import KarrasEMA, PostHocEMA, PostHocWarning
    from .pytree import EMAPytree, EMATensor
    from .wrapper import EMAModuleWrapper

#: Exported name -> the submodule that defines it ("" for a submodule itself).
_EXPORTS = {
    "EMA": "ema",
    "BEMA": "bema",
    "STATE_VERSION": "ema",
    "unwrap_model": "ema",
    "EMAError": "errors",
    "EMAFileNotFoundError": "errors",
    "EMARuntimeError": "errors",
    "EMAStateError": "errors",
    "EMATypeError": "errors",
    "EMAValueError": "errors",
    "EMAWriteError": "errors",
    "EMAModuleWrapper": "wrapper",
    "EMAPytree": "pytree",
    "EMATensor": "pytree",
    "KarrasEMA": "posthoc",
    "PostHocEMA": "posthoc",
    "PostHocWarning": "posthoc",
    "MultiEMA": "multi",
    "ema_copy_": "engine",
    "ema_lerp_": "engine",
    "flatten_parameters": "engine",
    "interpolate": "averaging",
    "update_bn": "averaging",
    "load_ema_weights": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_ema_weights": "checkpoint",
    "load_foreign_state": "foreign",
    "schedules": "",
}

if not TYPE_CHECKING:  # type checkers see the imports above, not a catch-all __getattr__
    __getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())

__all__ = [
    "BEMA",
    "EMA",
    "STATE_VERSION",
    "EMAError",
    "EMAFileNotFoundError",
    "EMAModuleWrapper",
    "EMAPytree",
    "EMARuntimeError",
    "EMAStateError",
    "EMATensor",
    "EMATypeError",
    "EMAValueError",
    "EMAWriteError",
    "KarrasEMA",
    "MultiEMA",
    "PostHocEMA",
    "PostHocWarning",
    "__version__",
    "ema_copy_",
    "ema_lerp_",
    "flatten_parameters",
    "interpolate",
    "load_ema_weights",
    "load_foreign_state",
    "save_checkpoint",
    "save_ema_weights",
    "schedules",
    "unwrap_model",
    "update_bn",
]
