"""The EMA update engine: a functional layer over tensor lists, the plan that feeds it, and
the runners that execute it.

The layout mirrors ``torch.optim``: [`ema_lerp_()`][emakit._engine.ema_lerp_] and [`ema_copy_()`][emakit._engine.ema_copy_] are the public
functional entry points and dispatch to one kernel per implementation (``"loop"``, the
reference per-tensor loop; ``"foreach"``, one multi-tensor call; and ``"flat"``, the same
call over coalesced contiguous spans). [`Plan`][emakit._engine.plan.Plan] pairs the tensors
once (`pairs`), watches them for replacement
(`guards`) and builds the lists the kernels consume on every update;
`runners` run it inline, on a thread or on a CUDA stream.
"""

from __future__ import annotations

from .kernels import IMPLS, ema_copy_, ema_lerp_
from .pairs import TensorPair
from .plan import Plan, build_plan

__all__ = ["IMPLS", "Plan", "TensorPair", "build_plan", "ema_copy_", "ema_lerp_"]
