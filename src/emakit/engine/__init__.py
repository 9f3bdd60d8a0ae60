"""The EMA update engine: a functional layer over tensor lists, and the plan that feeds it.

The layout mirrors ``torch.optim``: :func:`ema_lerp_` and :func:`ema_copy_` are the public
functional entry points and dispatch to one private kernel per implementation
(``"loop"``, the reference per-tensor loop; ``"foreach"``, one multi-tensor call; and
``"flat"``, the same call over coalesced contiguous spans). :class:`~emakit.engine.plan.Plan`
walks the model once and builds the tensor lists that the kernels consume on every update.
"""

from __future__ import annotations

from .kernels import IMPLS, ema_copy_, ema_lerp_
from .plan import Plan, TensorPair, build_plan

__all__ = ["IMPLS", "Plan", "TensorPair", "build_plan", "ema_copy_", "ema_lerp_"]
