"""Helpers shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .._dist.dtensor import is_dtensor
from ..ema import EMA
from ..errors import EMATypeError

__all__ = ["check_ema_class", "check_ema_kwargs", "distribute_like", "gather_full", "sharded_keys"]


def check_ema_class(owner: str, ema_class: object) -> type[EMA]:
    """``ema_class`` (the EMA kind an integration builds: [`EMA`][emakit.EMA],
    [`BEMA`][emakit.BEMA] ...), checked to be an [`EMA`][emakit.EMA] subclass."""
    if not (isinstance(ema_class, type) and issubclass(ema_class, EMA)):
        raise EMATypeError(
            f"{owner} ema_class must be emakit.EMA or a subclass such as emakit.BEMA, "
            f"got {ema_class=!r}"
        )
    return ema_class


def check_ema_kwargs(
    owner: str, ema_kwargs: dict[str, Any], ema_class: type[EMA] = EMA
) -> dict[str, Any]:
    """Refuse keywords ``ema_class`` does not take, up front (not at fit time).

    Args:
        owner: the class or function receiving the keywords, for the message.
        ema_kwargs: the keywords meant for ``ema_class``.
        ema_class: the EMA kind built from them. Default [`EMA`][emakit.EMA].

    Returns:
        ``ema_kwargs`` unchanged.

    Raises:
        EMATypeError: a keyword is unknown, or is ``model`` (the integration supplies it).
    """
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
    return ema_kwargs


# -- sharded (FSDP2) EMAs in framework checkpoints ------------------------------------------


def sharded_keys(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state`` whose values are DTensors (an FSDP2 EMA's shards)."""
    return [k for k, v in state.items() if is_dtensor(v)]


def gather_full(ema: EMA, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` (``ema.state_dict()``) with every DTensor replaced by the full tensor, on
    the CPU of the first rank; the other ranks get the plain entries only.

    A collective (one gather per tensor): call it on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(ema.ema_model, options=options)
    out = {k: v for k, v in state.items() if not is_dtensor(v)}
    for key in sharded_keys(state):
        name = key.removeprefix("ema_model.")
        if name in full:
            out[key] = full[name]
    return out


def distribute_like(values: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each full tensor whose ``live`` counterpart is a DTensor cut into
    this rank's shard of that DTensor's layout (``distribute_tensor``: rank 0's values are
    scattered, one collective per tensor; call it on every rank). Without DTensors in
    ``live``, ``values`` as they are."""
    out = dict(values)
    for key in sharded_keys(live):
        value, like = out.get(key), live[key]
        if isinstance(value, Tensor) and not is_dtensor(value):
            from torch.distributed.tensor import distribute_tensor

            out[key] = distribute_tensor(
                value.to(like.device, like.dtype), like.device_mesh, like.placements
            )
    return out
