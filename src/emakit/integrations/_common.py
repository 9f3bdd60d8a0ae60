"""Helpers shared by the framework integrations (no framework imports here)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from .._dist.deepspeed import zero3_params
from .._dist.dtensor import is_dtensor
from ..ema import EMA
from ..errors import EMATypeError

__all__ = [
    "ZERO3_ALTERNATIVE",
    "check_ema_kwargs",
    "distribute_like",
    "gather_full",
    "refuse_zero3",
    "sharded_keys",
]

#: What to do instead of an integration under DeepSpeed ZeRO-3.
ZERO3_ALTERNATIVE = (
    "keep the EMA in the training loop instead: ema = emakit.EMA(engine) and ema.update() "
    "on every rank, engine.save_checkpoint(dir, client_state={'ema': ema.state_dict()}), "
    "emakit.distributed.save_full_ema_weights(ema, path) (docs/distributed.md, DeepSpeed); "
    "ZeRO-1 and 2 work here as they are"
)


def refuse_zero3(model: object, owner: str) -> None:
    """Refuse a DeepSpeed ZeRO-3 model in an integration that saves from one process.

    Raises:
        EMATypeError: ``model`` has ZeRO-3 parameters (the message says the alternative).
    """
    if zero3_params(model):
        raise EMATypeError(
            f"{owner} does not support DeepSpeed ZeRO-3: it writes the EMA from one process, "
            f"and under ZeRO-3 each process holds only its partitions of it; "
            f"{ZERO3_ALTERNATIVE}"
        )


def check_ema_kwargs(owner: str, ema_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse keywords :class:`~emakit.EMA` does not take, up front (not at fit time).

    Args:
        owner: the class or function receiving the keywords, for the message.
        ema_kwargs: the keywords meant for :class:`~emakit.EMA`.

    Returns:
        ``ema_kwargs`` unchanged.

    Raises:
        EMATypeError: a keyword is unknown, or is ``model`` (the integration supplies it).
    """
    if "model" in ema_kwargs:
        raise EMATypeError(
            f"{owner} passes the training model to EMA itself; drop model= from its keywords"
        )
    params = inspect.signature(EMA.__init__).parameters
    unknown = sorted(set(ema_kwargs) - set(params) - {"self"})
    if unknown:
        known = [p for p in params if p not in ("self", "model")]
        raise EMATypeError(
            f"{owner} got keywords emakit.EMA does not take: {unknown}; EMA accepts {known}"
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
