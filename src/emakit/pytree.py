"""``EMAPytree``: an EMA of a tensor, or of a nested dict/list/tuple of tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._core.tree import tree_copy
from .ema import EMA

__all__ = ["EMAPytree", "EMATensor", "pytree_copy"]

#: A deep copy of a pytree whose tensors are detached clones.
pytree_copy = tree_copy


class EMAPytree(EMA):
    """An EMA of a tensor or of a nested dict/list/tuple of tensors (a pytree).

    ``EMA(pytree)`` builds the same thing; this class has ema-pytorch's ``EMAPytree``
    signature and names. The same update rules as [`EMA`][emakit.EMA]
    (``update_after_step``, ``update_every``, warm-up, ``beta == 1`` frozen). Floating
    leaves are averaged, integer and bool leaves copied, non-tensor leaves left alone.
    Leaves are paired by their path (``"a.0.b"`` for ``{"a": [{"b": t}]}``), and the EMA
    leaves are saved in `state_dict()` under ``ema.<path>``.

    The online leaves are bound when the EMA is built, as an optimizer binds its
    parameters: update them in place (``optimizer.step()``, ``copy_``, ``mul_`` ...).

    Args:
        pytree: the online tensor or nested container of tensors.
        ema_pytree: a container with the same structure to hold the EMA, or a
            zero-argument factory. Default None: a copy of ``pytree``.
        beta: the decay ceiling, as for [`EMA`][emakit.EMA]. Default 0.9999.
        update_after_step: plain copies until this step. Default 100.
        update_every: only every ``update_every``-th call does work. Default 10.
        inv_gamma: warm-up scale. Default 1.0.
        power: warm-up exponent. Default 2/3.
        min_value: decay floor. Default 0.0.
        allow_different_devices: allow EMA leaves on another device. Default False.
        coerce_dtype: cast online leaves to the EMA's dtype when they differ. Default False.
        use_foreach: keyword-only; engine path as for [`EMA`][emakit.EMA]. Default None.
        ema_dtype: keyword-only; dtype of the floating EMA leaves. Default None.
        schedule: keyword-only; a ``step -> decay`` callable. Default None.
        skip_nonfinite: keyword-only; skip updates with NaN/Inf leaves. Default False.
        device: keyword-only; where the EMA leaves live. Default None.
        async_update: keyword-only; average on a background thread. Default None.

    Example:
        >>> w = torch.zeros(3)
        >>> ema = EMAPytree(w, update_after_step=0, update_every=1, schedule=lambda t: 0.5)
        >>> ema.update(); _ = w.fill_(1.0); ema.update()
        >>> ema.ema_pytree
        tensor([0.5000, 0.5000, 0.5000])
    """

    def __init__(
        self,
        pytree: Any,
        ema_pytree: Any | Callable[[], Any] | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        allow_different_devices: bool = False,
        coerce_dtype: bool = False,
        *,
        use_foreach: bool | None = None,
        ema_dtype: torch.dtype | None = None,
        schedule: Callable[[int], float] | None = None,
        skip_nonfinite: bool = False,
        device: torch.device | str | None = None,
        async_update: bool | None = None,
    ) -> None:
        super().__init__(
            pytree,
            ema_model=ema_pytree,
            beta=beta,
            update_after_step=update_after_step,
            update_every=update_every,
            inv_gamma=inv_gamma,
            power=power,
            min_value=min_value,
            allow_different_devices=allow_different_devices,
            coerce_dtype=coerce_dtype,
            use_foreach=use_foreach,
            ema_dtype=ema_dtype,
            schedule=schedule,
            skip_nonfinite=skip_nonfinite,
            device=device,
            async_update=async_update,
        )

    @property
    def online_pytree(self) -> list[Any]:
        """``[pytree]``: ema-pytorch's attribute (a one-element list)."""
        return [self.pytree]

    def update_moving_average(  # type: ignore[override]
        self, ma_pytree: Any, current_pytree: Any, current_decay: float | None = None
    ) -> None:
        """``ma_pytree <- decay * ma_pytree + (1 - decay) * current_pytree``, leaf by leaf
        (ema-pytorch's ``EMAPytree`` method, with its argument names; floating leaves
        averaged, others copied; see [`EMA.update_moving_average()`][emakit.EMA.update_moving_average])."""
        super().update_moving_average(ma_pytree, current_pytree, current_decay)


EMATensor = EMAPytree
