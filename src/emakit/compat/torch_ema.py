"""torch_ema's ``ExponentialMovingAverage`` (torch_ema 0.3), on emakit.

Change ``from torch_ema import ExponentialMovingAverage`` to ``from emakit.compat.torch_ema
import ExponentialMovingAverage``: the same signature, methods and ``state_dict`` keys, so
states load both ways between the two classes. torch_ema is not imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor

from .. import _validate as check
from .._core.state import tensor_list_like
from ..ema import EMA
from ..errors import EMAStateError, EMATypeError, EMAValueError
from ..schedules import constant, torch_ema_warmup

__all__ = ["ExponentialMovingAverage"]


class ExponentialMovingAverage:
    """torch_ema's ``ExponentialMovingAverage``: an EMA of a list of parameters.

    Update ``n`` (counted from 1) uses

    .. math:: d_n = \\min\\Big(\\text{decay}, \\frac{1 + n}{10 + n}\\Big)
       \\quad (\\text{decay with } \\text{use\\_num\\_updates=False}),\\qquad
       s \\leftarrow s + (1 - d_n)(p - s)

    the same decay, as the same float, as torch_ema at every update, also after a state
    round trip (``num_updates`` is kept both ways). The shadow starts as a copy of the
    parameters, so the first update already averages. Parameters only: buffers (BatchNorm
    statistics) are not averaged, as in torch_ema.

    Args:
        parameters: the parameters to average (e.g. ``model.parameters()``), trained or not.
        decay: the ceiling of the decay, in [0, 1].
        use_num_updates: ramp the decay up with the number of updates (formula above).
            Default True.
        skip_nonfinite: keyword-only, emakit's: skip an update whose parameters hold NaN or
            Inf (decided on the device; see `emakit.EMA`). Default False.

    Attributes:
        decay: the ceiling of the decay.
        num_updates: updates so far (None without ``use_num_updates``).
        shadow_params: the averaged tensors, in the order of ``parameters``.
        collected_params: what `store()` saved (None before).

    Differences from torch_ema:

    * the update runs on emakit's engine (``s.lerp_(p, 1 - d)``, planned once, one
      multi-tensor call): the weights agree with torch_ema's ``s - (1 - d)(s - p)`` to
      float32 rounding (a few ulps over hundreds of updates), not bit for bit;
    * the parameters are held by reference (torch_ema keeps weak references, so it can
      outlive the model); ``update(parameters)`` with other tensors than the ones given at
      construction pairs with those from then on;
    * `load_state_dict` copies the values into the existing shadow tensors (their dtype and
      device stay; torch_ema casts to the parameters'), and raises `EMAStateError` for a
      malformed state where torch_ema asserts.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = ExponentialMovingAverage(net.parameters(), decay=0.99)
        >>> ema.update()  # after optimizer.step()
        >>> with ema.average_parameters():
        ...     y = net(torch.ones(1, 2))
        >>> sorted(ema.state_dict())
        ['collected_params', 'decay', 'num_updates', 'shadow_params']
    """

    def __init__(
        self,
        parameters: Iterable[Tensor],
        decay: float,
        use_num_updates: bool = True,
        *,
        skip_nonfinite: bool = False,
    ) -> None:
        self.decay = check.real("decay", decay, low=0.0, high=1.0)
        self._use_num_updates = check.boolean("use_num_updates", use_num_updates)
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        params = _tensor_list("parameters", parameters)
        self._build(params, [p.detach().clone() for p in params], step=1)
        self.collected_params: list[Tensor] | None = None

    def _build(self, params: list[Tensor], shadow: list[Tensor], step: int) -> None:
        """The engine EMA over ``params`` with ``shadow`` as its average, at ``step``
        (emakit's count: the update count plus the initializing copy)."""
        schedule = torch_ema_warmup(self.decay) if self._use_num_updates else constant(self.decay)
        self._ema = EMA(
            params,
            ema_model=shadow,
            schedule=schedule,
            update_after_step=0,
            update_every=1,
            allow_different_devices=True,  # .to() may move the shadow
            coerce_dtype=True,
            share_frozen=False,  # every parameter is averaged, trained or not
            skip_nonfinite=self.skip_nonfinite,
        )
        self._ema.tracker.reset(step)

    @property
    def _tracked(self) -> list[Tensor]:
        """The parameters the engine EMA averages."""
        return cast(list, self._ema.model)

    @property
    def num_updates(self) -> int | None:
        """``update()`` calls so far (None with ``use_num_updates=False``)."""
        return self._ema.tracker.step - 1 if self._use_num_updates else None

    @property
    def shadow_params(self) -> list[Tensor]:
        """The averaged tensors (references), in the order of the parameters."""
        return list(cast(list, self._ema.ema_model))

    def _parameters(self, parameters: Iterable[Tensor] | None) -> list[Tensor]:
        """The parameters given, or the ones the EMA tracks."""
        if parameters is None:
            return list(self._tracked)
        params = _tensor_list("parameters", parameters)
        if len(params) != len(self._tracked):
            raise EMAValueError(
                f"parameters has {len(params)} tensors but this EMA averages "
                f"{len(self._tracked)}; pass the same parameters it was built with"
            )
        return params

    def update(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Average the parameters in (call after every ``optimizer.step()``)."""
        if parameters is not None:
            params = self._parameters(parameters)
            if any(p is not q for p, q in zip(params, self._tracked, strict=True)):
                self._build(params, self.shadow_params, self._ema.tracker.step)
        self._ema.update()

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Copy the averages into the parameters."""
        for s, p in zip(self.shadow_params, self._parameters(parameters), strict=True):
            p.data.copy_(s)

    def store(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Save a copy of the parameters, for `restore()`."""
        self.collected_params = [p.detach().clone() for p in self._parameters(parameters)]

    @torch.no_grad()
    def restore(self, parameters: Iterable[Tensor] | None = None) -> None:
        """Copy what `store()` saved back into the parameters."""
        if self.collected_params is None:
            raise EMAStateError("restore() needs a store() first: nothing was stored")
        for c, p in zip(self.collected_params, self._parameters(parameters), strict=True):
            p.data.copy_(c)

    @contextlib.contextmanager
    def average_parameters(self, parameters: Iterable[Tensor] | None = None) -> Iterator[None]:
        """Inside the block the parameters hold the averages; afterwards their own values
        (`store()`, `copy_to()`, then `restore()`, also when the block raises)."""
        params = self._parameters(parameters)
        self.store(params)
        self.copy_to(params)
        try:
            yield
        finally:
            self.restore(params)

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Move the shadow (and stored) tensors to ``device``; floating ones to ``dtype``."""

        def moved(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

        self._build(
            list(self._tracked), [moved(s) for s in self.shadow_params], self._ema.tracker.step
        )
        if self.collected_params is not None:
            self.collected_params = [moved(c) for c in self.collected_params]

    def state_dict(self) -> dict[str, Any]:
        """torch_ema's state (references to the tensors, as torch_ema returns them)::

        {"decay": 0.999, "num_updates": 1234, "shadow_params": [...],
         "collected_params": None}
        """
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "shadow_params": self.shadow_params,
            "collected_params": self.collected_params,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state written by `state_dict()` or by torch_ema's ``state_dict()``.

        ``decay`` and ``num_updates`` are taken from the state (``num_updates=None``
        switches the warm-up off, as in torch_ema); the shadow values are copied into the
        existing shadow tensors. Nothing changes when the state does not fit.
        """
        source = "the torch_ema state"
        if not isinstance(state_dict, Mapping):
            raise EMATypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        missing = [k for k in ("decay", "num_updates", "shadow_params") if k not in state_dict]
        if missing:
            raise EMAStateError(f"{source} lacks {missing}; found {sorted(map(str, state_dict))}")
        decay = check.stored_real(source, "decay", state_dict["decay"])
        if not 0.0 <= decay <= 1.0:
            raise EMAStateError(f"{source}: decay must be in [0, 1], got {decay!r}")
        count = state_dict["num_updates"]
        count = None if count is None else check.stored_count(source, "num_updates", count)
        mine = self.shadow_params
        shadow = tensor_list_like(source, "shadow_params", state_dict["shadow_params"], mine)
        collected = state_dict.get("collected_params")
        if collected is not None:
            collected = tensor_list_like(source, "collected_params", collected, mine)
        for s, v in zip(mine, shadow, strict=True):
            s.copy_(v)
        self.decay, self._use_num_updates = decay, count is not None
        self._build(list(self._tracked), mine, 1 if count is None else count + 1)
        self.collected_params = None
        if collected is not None:
            params = list(self._tracked)
            self.collected_params = [
                c.to(device=p.device, dtype=p.dtype, copy=True)
                for c, p in zip(collected, params, strict=True)
            ]


def _tensor_list(name: str, values: Iterable[Tensor]) -> list[Tensor]:
    values = list(values)
    if not values or not all(isinstance(v, Tensor) for v in values):
        raise EMATypeError(
            f"{name} must be an iterable of tensors (e.g. model.parameters()), got "
            f"{[type(v).__name__ for v in values][:5] or 'nothing'}"
        )
    return values
