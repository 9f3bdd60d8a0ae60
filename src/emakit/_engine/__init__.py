"""The EMA update engine: a functional layer over tensor lists, the plan that feeds it, and
the runners that execute it.

The layout mirrors ``torch.optim``: `emakit._engine.kernels` holds the public functional
entry points, [`ema_lerp_()`][emakit._engine.kernels.ema_lerp_] and
[`ema_copy_()`][emakit._engine.kernels.ema_copy_] (re-exported by `emakit.engine`), which
dispatch to one kernel per implementation (``"loop"``, the reference per-tensor loop;
``"foreach"``, one multi-tensor call; and ``"flat"``, the same call over coalesced
contiguous spans). [`Plan`][emakit._engine.plan.Plan] pairs the tensors once (`pairs`),
watches them for replacement (`guards`) and builds the lists the kernels consume on every
update (`paths`); `runners` run it inline, on a thread or on a CUDA stream.
"""
