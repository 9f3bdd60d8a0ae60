"""The public functional engine: one EMA step over tensor lists, and flat parameter storage.

[`ema_lerp_()`][emakit._engine.kernels.ema_lerp_] and [`ema_copy_()`][emakit._engine.kernels.ema_copy_] are what ``EMA.update()`` runs, for users who keep
their own tensor lists (an optimizer-like loop, a custom trainer). ``impl`` picks the
kernel, as ``torch.optim`` does: ``"loop"`` (the reference per-tensor loop), ``"foreach"``
(one multi-tensor call) or ``"flat"`` (the same call over coalesced contiguous spans).
[`flatten_parameters()`][emakit._engine.flat.flatten_parameters] re-homes a model's parameters into flat buffers, so the flat
kernel needs one call per buffer.

The plan, runners and guards behind ``EMA`` live in the private ``emakit._engine``
package; they are internals and may change in any release.
"""

from __future__ import annotations

from ._engine.flat import flatten_parameters
from ._engine.kernels import IMPLS, ema_copy_, ema_lerp_

__all__ = ["IMPLS", "ema_copy_", "ema_lerp_", "flatten_parameters"]
