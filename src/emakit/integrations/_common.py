"""Helpers shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

from .._dist.deepspeed import zero3_params
from ..bema import BEMA
from ..ema import EMA
from ..errors import EMATypeError

#: Where ``EMACallback`` puts the EMA in a Lightning checkpoint (``emakit inspect`` reads it).
LIGHTNING_CHECKPOINT_KEY = "emakit_ema"
#: The EMA file ``EMATrainerCallback`` writes into every ``checkpoint-N`` folder.
TRAINER_WEIGHTS_NAME = "ema.safetensors"


def refuse_zero3(model: object, owner: str) -> None:
    """Refuse a DeepSpeed ZeRO-3 model in an integration that saves from one process.

    Raises:
        EMATypeError: ``model`` has ZeRO-3 parameters (the message says the alternative).
    """
    if zero3_params(model):
        raise EMATypeError(
            f"{owner} does not support DeepSpeed ZeRO-3: it writes the EMA from one process, "
            f"and under ZeRO-3 each process holds only its partitions of it; keep the EMA in "
            f"the training loop instead: ema = emakit.EMA(engine) and ema.update() on every "
            f"rank, engine.save_checkpoint(dir, client_state={{'ema': ema.state_dict()}}), "
            f"emakit.distributed.save_full_ema_weights(ema, path) (docs/distributed.md, "
            f"DeepSpeed); ZeRO-1 and 2 work here as they are"
        )


class EMAKeywords(TypedDict, total=False):
    """The keywords the callbacks pass on to [`EMA`][emakit.EMA] (or, with
    ``ema_class=BEMA``, to [`BEMA`][emakit.BEMA]), typed for IDEs and type checkers
    (``**ema_kwargs: Unpack[EMAKeywords]``, PEP 692). Each means what it means there, with
    its default; which ones a kind takes is checked when the callback is built, and
    ``tests/test_integration_lightning.py`` checks this list against both signatures."""

    ema_model: nn.Module | Callable[[], Any] | Any | None
    beta: float
    update_after_step: int
    update_every: int
    inv_gamma: float
    power: float
    min_value: float
    param_or_buffer_names_no_ema: Iterable[str]
    ignore_names: Iterable[str]
    ignore_startswith_names: Iterable[str]
    include_online_model: bool
    allow_different_devices: bool
    use_foreach: bool | None
    update_model_with_ema_every: int | None
    update_model_with_ema_beta: float
    forward_method_names: Sequence[str]
    move_ema_to_online_device: bool
    coerce_dtype: bool
    lazy_init_ema: bool
    ema_dtype: torch.dtype | None
    schedule: Callable[[int], float] | None
    decay_groups: Mapping[str, float | Callable[[int], float]] | None
    skip_nonfinite: bool
    partition: bool
    compile_update: bool
    device: torch.device | str | None
    async_update: bool | None
    stream: bool
    share_frozen: bool
    watch_model: bool
    # ema_class=BEMA: BEMA's own keywords (the others above apply to it as well)
    update_freq: int
    ema_power: float
    bias_power: float
    lag: float
    update_after: int
    multiplier: float
    min_ema_multiplier: float


def ema_metrics(ema: EMA, *, skips: bool = False) -> dict[str, float]:
    """What the framework callbacks log about an EMA, read without waiting for the device.

    * ``ema/decay``: the decay of the most recent update
      ([`get_current_decay()`][emakit.EMA.get_current_decay]; 0 during the warm-up copies);
    * ``ema/step``: the number of ``update()`` calls;
    * ``ema/bias_weight``: for a BEMA, ``alpha_t`` of its most recent update;
    * ``ema/num_skipped_nonfinite``: with ``skips=True`` and ``skip_nonfinite=True``, the
      updates skipped for NaN/Inf weights. Reading it waits for the pending update (one
      small read from the device), so the callbacks read it only when they log anyway.

    Args:
        ema: the EMA.
        skips: include the skip count. Default False.

    Returns:
        ``{name: value}``, plain floats.
    """
    values = {"ema/decay": float(ema.get_current_decay()), "ema/step": float(ema.step)}
    if isinstance(ema, BEMA):
        values["ema/bias_weight"] = ema.bias_weight
    if skips and ema.skip_nonfinite:
        values["ema/num_skipped_nonfinite"] = float(ema.num_skipped_nonfinite)
    return values


def ema_keywords(
    owner: str, ema_kwargs: Mapping[str, Any], ema_class: object = EMA
) -> dict[str, Any]:
    """The keywords an integration builds its EMA with, checked up front (not at fit time),
    ``include_online_model`` defaulting to False (the framework saves the model itself).

    Args:
        owner: the class or function receiving the keywords, for the messages.
        ema_kwargs: the keywords meant for ``ema_class``.
        ema_class: the EMA kind built from them, [`EMA`][emakit.EMA] or a subclass such as
            [`BEMA`][emakit.BEMA]. Default [`EMA`][emakit.EMA].

    Returns:
        A new dict: ``{"include_online_model": False, **ema_kwargs}``.

    Raises:
        EMATypeError: ``ema_class`` is not an EMA kind, a keyword is unknown to it, or a
            keyword is ``model`` (the integration supplies it).
    """
    if not (isinstance(ema_class, type) and issubclass(ema_class, EMA)):
        raise EMATypeError(
            f"{owner} ema_class must be emakit.EMA or a subclass such as emakit.BEMA, "
            f"got {ema_class=!r}"
        )
    if "model" in ema_kwargs:
        raise EMATypeError(
            f"{owner} passes the training model to EMA itself; drop model= from its keywords"
        )
    params = inspect.signature(ema_class.__init__).parameters
    unknown = sorted(set(ema_kwargs) - set(params) - {"self"})
    if unknown:
        known = [p for p in params if p not in ("self", "model")]
        name = ema_class.__name__
        raise EMATypeError(
            f"{owner} got keywords emakit.{name} does not take: {unknown}; {name} accepts {known}"
        )
    return {"include_online_model": False, **ema_kwargs}
