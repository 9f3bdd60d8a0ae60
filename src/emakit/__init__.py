"""emakit: exponential moving averages of PyTorch model weights.

>>> import torch
>>> from emakit import EMA
>>> net = torch.nn.Linear(4, 2)
>>> ema = EMA(net, beta=0.9999)
>>> ema.update()  # after every optimizer.step()
"""

from __future__ import annotations

from . import schedules
from ._version import __version__
from .averaging import interpolate, update_bn
from .checkpoint import load_ema_weights, save_ema_weights
from .ema import EMA, STATE_VERSION, unwrap_model
from .engine import ema_copy_, ema_lerp_
from .engine.flat import flatten_parameters
from .errors import (
    EMAError,
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)
from .foreign import load_foreign_state
from .multi import MultiEMA
from .posthoc import KarrasEMA, PostHocEMA, PostHocWarning
from .pytree import EMAPytree, EMATensor
from .wrapper import EMAModuleWrapper

__all__ = [
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
    "save_ema_weights",
    "schedules",
    "unwrap_model",
    "update_bn",
]
