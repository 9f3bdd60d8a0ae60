"""The rest of ema-pytorch 0.8.3's public surface, for code written against it.

`EMAPytorchSurface` adds to [`EMA`][emakit.EMA] the members ema-pytorch clients
call that emakit's own design does not need: the name filters and iterators
(``parameter_names``, ``get_params_iter`` ...), the in-place helpers and a direct ``update_moving_average(ma_model, current_model)``.
Each is built on EMA's public methods; the hot path never goes through them. (EMA itself
has ``restore_ema_model_device``, ``online_model`` and the tensors ``step``/``initted``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ._core.tracker import Tracker

__all__ = ["EMAPytorchSurface"]


def _floating(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class EMAPytorchSurface:
    """ema-pytorch's helper members (mixed into [`EMA`][emakit.EMA])."""

    # provided by EMA
    allow_different_devices: bool
    coerce_dtype: bool

    @property
    def ema_model(self) -> Any:  # pragma: no cover - EMA's
        raise NotImplementedError

    @property
    def model(self) -> Any:  # pragma: no cover - EMA's
        raise NotImplementedError

    @property
    def is_frozen(self) -> bool:  # pragma: no cover - EMA's
        raise NotImplementedError

    def get_current_decay(self) -> float:  # pragma: no cover - EMA's
        raise NotImplementedError

    def copy_params_from_ema_to_model(self) -> None:  # pragma: no cover - EMA's
        raise NotImplementedError

    def update_model_with_ema(self, decay: float | None = None) -> None:  # pragma: no cover
        raise NotImplementedError

    @property
    def tracker(self) -> Tracker:  # pragma: no cover - EMA's
        raise NotImplementedError

    @property
    def kind(self) -> str:  # pragma: no cover - EMA's
        raise NotImplementedError

    @property
    def pytree(self) -> Any:
        """The online pytree (an EMA of a pytree; ema-pytorch's ``EMAPytree.pytree``)."""
        if self.kind != "pytree":
            raise AttributeError("pytree: this is an EMA of a module; see .model")
        return self.model

    @property
    def ema_pytree(self) -> Any:
        """The EMA pytree (an EMA of a pytree); waits for a background update first."""
        if self.kind != "pytree":
            raise AttributeError("ema_pytree: this is an EMA of a module; see .ema_model")
        return self.ema_model

    def copy_params_from_pytree_to_ema(self) -> None:
        """Copy every online leaf into the EMA (ema-pytorch's name for a pytree)."""
        self.copy_params_from_model_to_ema()

    def copy_params_from_model_to_ema(self) -> None:  # pragma: no cover - EMA's
        raise NotImplementedError

    @property
    def parameter_names(self) -> set[str]:
        """Names of the EMA model's floating (and complex) parameters."""
        return {n for n, p in self.ema_model.named_parameters() if _floating(p)}

    @property
    def buffer_names(self) -> set[str]:
        """Names of the EMA model's floating (and complex) buffers."""
        return {n for n, b in self.ema_model.named_buffers() if _floating(b)}

    def get_params_iter(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of ``model`` for the names in `parameter_names`."""
        names = self.parameter_names
        for name, param in model.named_parameters():
            if name in names:
                yield name, param

    def get_buffers_iter(self, model: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """``(name, buffer)`` of ``model`` for the names in `buffer_names`."""
        names = self.buffer_names
        for name, buffer in model.named_buffers():
            if name in names:
                yield name, buffer

    def _aligned(self, tgt: Tensor, src: Tensor) -> Tensor:
        if self.allow_different_devices:
            src = src.to(tgt.device)
        if self.coerce_dtype and src.dtype != tgt.dtype:
            src = src.to(tgt.dtype)
        return src

    @torch.no_grad()
    def inplace_copy(self, tgt: Tensor, src: Tensor) -> None:
        """``tgt.copy_(src)``, moving/casting ``src`` as ``allow_different_devices`` and
        ``coerce_dtype`` allow."""
        tgt.copy_(self._aligned(tgt, src))

    @torch.no_grad()
    def inplace_lerp(self, tgt: Tensor, src: Tensor, weight: float) -> None:
        """``tgt.lerp_(src, weight)``, moving/casting ``src`` as allowed."""
        tgt.lerp_(self._aligned(tgt, src), weight)

    @torch.no_grad()
    def update_moving_average(
        self, ma_model: Any, current_model: Any, current_decay: float | None = None
    ) -> None:
        """``ma_model <- decay * ma_model + (1 - decay) * current_model`` by name.

        ``(ema_model, model)`` averages the EMA (the default decay is
        `get_current_decay()`); ``(model, ema_model)`` pulls the model toward the EMA
        (as `update_model_with_ema()` does); other modules are averaged by name over
        the floating tensors they share. A frozen EMA (``beta == 1``) is left alone, as
        in ema-pytorch.
        """
        if self.is_frozen:
            return
        decay = self.get_current_decay() if current_decay is None else float(current_decay)
        if ma_model is self.ema_model and current_model is self.model:
            tracker = self.tracker
            tracker.runner.wait()
            plan = tracker.plan()
            if current_decay is None:  # every decay group its own current decay
                weights = list(tracker.rule.weights(tracker.step, tracker.last))
            else:
                weights = [1.0 - decay] * plan.num_decay_groups
            plan.lerp_shadow(weights)
            return
        if ma_model is self.model and current_model is self.ema_model:
            self.update_model_with_ema(decay)
            return
        current = dict((*current_model.named_parameters(), *current_model.named_buffers()))
        for name, tgt in (*ma_model.named_parameters(), *ma_model.named_buffers()):
            src = current.get(name)
            if src is None:
                continue
            if _floating(tgt):
                self.inplace_lerp(tgt.data, src.data, 1.0 - decay)
            else:
                self.inplace_copy(tgt.data, src.data)
