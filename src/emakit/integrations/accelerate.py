"""Hugging Face Accelerate integration: [`prepare_ema()`][emakit.integrations.accelerate.prepare_ema].

Importing this module imports ``accelerate``; ``import emakit`` does not.

Example:
    >>> from accelerate import Accelerator
    >>> from emakit.integrations.accelerate import prepare_ema
    >>> accelerator = Accelerator(gradient_accumulation_steps=4)  # doctest: +SKIP
    >>> model, opt, loader = accelerator.prepare(model, opt, loader)  # doctest: +SKIP
    >>> ema = prepare_ema(accelerator, model, beta=0.999, update_every=1)  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     with accelerator.accumulate(model):
    ...         accelerator.backward(model(batch).loss)
    ...         opt.step()
    ...         opt.zero_grad()
    ...         ema.update()  # does nothing on accumulation micro-steps
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..bema import BEMA
from ..ema import EMA
from ..errors import EMATypeError
from ._common import ema_keywords, refuse_zero3

try:
    from accelerate import Accelerator
    from accelerate.state import GradientState
except ImportError as e:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "emakit.integrations.accelerate needs Accelerate: pip install accelerate (emakit's "
        "accelerate extra; in a clone of emakit: pip install -e '.[accelerate]')"
    ) from e

__all__ = ["AcceleratedBEMA", "AcceleratedEMA", "prepare_ema"]


class AcceleratedEMA(EMA):
    """An [`EMA`][emakit.EMA] whose `update()` counts only optimizer steps.

    Under ``accelerator.accumulate(model)``, ``update()`` returns at once on micro-steps
    (``accelerator.sync_gradients`` is False), so ``step``, ``update_every`` and
    ``update_after_step`` count optimizer steps, as they do without accumulation. The
    check is one attribute read on Accelerate's shared gradient state.

    Everything else is [`EMA`][emakit.EMA]: ``swap()``, ``ema(x)``, ``state_dict()``.
    Build it with [`prepare_ema()`][emakit.integrations.accelerate.prepare_ema].

    Args:
        model: the (unwrapped) training module.
        gradient_state: Accelerate's ``GradientState`` (``accelerator.gradient_state``).
        **ema_kwargs: keywords for [`EMA`][emakit.EMA].
    """

    def __init__(
        self, model: nn.Module, *, gradient_state: GradientState, **ema_kwargs: Any
    ) -> None:
        super().__init__(model, **ema_kwargs)
        self._gradient_state = gradient_state

    def update(self) -> None:
        """Advance the EMA when this call follows an optimizer step; see [`emakit.EMA.update()`][emakit.EMA.update]."""
        if self._gradient_state.sync_gradients:
            super().update()

    def __getstate__(self) -> dict:
        state: dict = super().__getstate__()
        state["_gradient_state"] = None  # process-wide singleton: re-attached on load
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._gradient_state = GradientState()


class AcceleratedBEMA(AcceleratedEMA, BEMA):
    """A [`BEMA`][emakit.BEMA] whose `update()` counts only optimizer steps (as
    [`AcceleratedEMA`][emakit.integrations.accelerate.AcceleratedEMA] does); built by
    ``prepare_ema(accelerator, model, ema_class=BEMA, ...)``."""


def prepare_ema(
    accelerator: Accelerator, model: nn.Module, *, ema_class: type[EMA] = EMA, **ema_kwargs: Any
) -> AcceleratedEMA | AcceleratedBEMA:
    """Build the EMA of a model prepared by ``accelerator`` and register it for checkpoints.

    Call it after ``accelerator.prepare(model, ...)``, so the EMA lives on the model's
    device. It

    1. unwraps the prepared model (``accelerator.unwrap_model``: DDP, ``torch.compile``,
       mixed-precision forward wrappers) and builds ``EMA(unwrapped, **ema_kwargs)``;
    2. registers the EMA with ``accelerator.register_for_checkpointing``, so
       ``accelerator.save_state(dir)`` writes it (``custom_checkpoint_<i>.pkl``, in
       registration order) and ``accelerator.load_state(dir)`` restores it, step included;
    3. returns an [`AcceleratedEMA`][emakit.integrations.accelerate.AcceleratedEMA], whose ``update()`` does nothing unless
       ``accelerator.sync_gradients`` (one update per optimizer step under gradient
       accumulation). Call ``ema.update()`` after ``optimizer.step()``, inside or after
       the ``accelerator.accumulate(model)`` block.

    Every process keeps its own EMA (identical under DDP, as the weights are). Sharded
    setups (FSDP, DeepSpeed ZeRO-3) are not supported: each process holds only a shard
    (ZeRO-3 is refused, naming the alternative: ``EMA(engine)`` in your own loop).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model as returned by ``accelerator.prepare`` (a plain module works too).
        ema_class: keyword-only; [`EMA`][emakit.EMA] (default) or [`BEMA`][emakit.BEMA]
            (then ``ema_kwargs`` are BEMA's: ``update_freq``, ``lag`` ...).
        **ema_kwargs: keywords for [`EMA`][emakit.EMA] (``beta``, ``update_every``,
            ``update_after_step``, ``ema_dtype``, ...). Its defaults apply, except
            ``include_online_model``, False here (``save_state`` saves the model once);
            the counts are in optimizer steps.

    Returns:
        The registered [`AcceleratedEMA`][emakit.integrations.accelerate.AcceleratedEMA].

    Raises:
        EMATypeError: ``accelerator`` is not an ``Accelerator``, or a keyword is not one
            of [`EMA`][emakit.EMA]'s.

    Example:
        >>> acc = Accelerator(cpu=True)  # doctest: +SKIP
        >>> net = acc.prepare(torch.nn.Linear(2, 2))  # doctest: +SKIP
        >>> ema = prepare_ema(acc, net, beta=0.99)  # doctest: +SKIP
    """
    if not isinstance(accelerator, Accelerator):
        raise EMATypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    # save_state writes the model itself: the EMA's checkpoint holds only the EMA.
    kwargs = ema_keywords("prepare_ema", ema_kwargs, ema_class)
    gated = {EMA: AcceleratedEMA, BEMA: AcceleratedBEMA}.get(ema_class)
    if gated is None:
        raise EMATypeError(
            f"prepare_ema builds an EMA or a BEMA, got ema_class={ema_class.__name__}; "
            f"build other kinds yourself and call update() when accelerator.sync_gradients"
        )
    # The default keep_fp32_wrapper=True matters: unwrapping without it would strip the
    # mixed-precision forward wrapper from the training model itself.
    unwrapped = accelerator.unwrap_model(model)
    refuse_zero3(unwrapped, "prepare_ema")
    ema = gated(unwrapped, gradient_state=accelerator.gradient_state, **kwargs)
    accelerator.register_for_checkpointing(ema)
    return ema
