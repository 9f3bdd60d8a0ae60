"""DTensor and FSDP2 detection without importing ``torch.distributed`` (a leaf module).

A process that never created a DTensor or an FSDP2 module pays one dictionary lookup per
check: the classes are looked up in ``sys.modules``, never imported from here.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn

__all__ = [
    "dist_ready",
    "dtensor_type",
    "fsdp_module_type",
    "fsdp_modules",
    "is_dtensor",
    "is_rank_zero",
    "local_tensor",
    "reshard",
]


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` if it has been imported, else None."""
    module = sys.modules.get("torch.distributed.tensor._api")
    return getattr(module, "DTensor", None)


def fsdp_module_type() -> type | None:
    """FSDP2's ``FSDPModule`` if ``fully_shard`` has been imported, else None."""
    module = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    return getattr(module, "FSDPModule", None)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: Tensor) -> Tensor:
    """The shard of a DTensor this rank holds; any other tensor is returned as is.

    For an FSDP2 parameter this is the very tensor FSDP2 all-gathers from (a view of its
    padded shard storage), so in-place updates of it are seen by the next forward.

    Example:
        >>> local_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def fsdp_modules(model: object) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (``[]`` without FSDP2)."""
    cls = fsdp_module_type()
    if cls is None or not isinstance(model, nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def reshard(modules: list[nn.Module]) -> None:
    """Free the all-gathered weights of FSDP2 modules, so the next forward gathers anew.

    A root with ``reshard_after_forward=False`` keeps its gathered weights after a no-grad
    forward; the next forward would reuse them instead of the shards that changed since.
    """
    for m in modules:
        m.reshard()  # type: ignore[operator]


def dist_ready() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_zero() -> bool:
    """True on rank 0 of the default process group, and in a non-distributed process.

    Guard single-writer outputs with it (snapshots, logs). Collective exports such as
    :func:`~emakit.distributed.save_full_ema_weights` must be called on every rank.
    """
    return not dist_ready() or torch.distributed.get_rank() == 0
