"""DTensor and FSDP2 detection without importing ``torch.distributed`` (a leaf module).

A process that never created a DTensor or an FSDP2 module pays one dictionary lookup per
check: the classes are looked up in ``sys.modules`` under their public import paths
(``torch.distributed.tensor.DTensor``, ``torch.distributed.fsdp.FSDPModule``), never
imported from here.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import EMAStateError, EMATypeError

#: The oldest torch whose FSDP2 emakit supports: ``torch.distributed.fsdp.fully_shard``,
#: ``FSDPModule`` and ``register_fsdp_forward_method`` became public, and ``fully_shard``
#: took ``shard_placement_fn``, in 2.6 (before, FSDP2 lived in the private
#: ``torch.distributed._composable.fsdp``; ``ignored_params`` needs 2.7 and is only used
#: when the model was sharded with it).
FSDP2_MIN_TORCH = (2, 6)


def torch_version() -> tuple[int, int]:
    """The installed torch's ``(major, minor)``, e.g. ``(2, 14)``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def fsdp_module_type() -> type | None:
    """FSDP2's ``torch.distributed.fsdp.FSDPModule`` if it has been imported, else None."""
    return getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)


def check_fsdp2_torch(tensors: Iterable[object], modules: Iterable[object] = ()) -> None:
    """Refuse DTensors and FSDP2 modules on a torch older than `FSDP2_MIN_TORCH`.

    On such a torch the classes live under private paths that the checks here do not
    look at, so a sharded model would be treated as a plain one; this says so up front.
    The classes are recognized by name, which every torch version shares.

    Args:
        tensors: the model's parameters and buffers.
        modules: the model's modules.

    Raises:
        EMATypeError: a DTensor or FSDP module on an older torch (the message names both
            versions).
    """
    if torch_version() >= FSDP2_MIN_TORCH:
        return
    sharded = any(type(t).__name__ == "DTensor" for t in tensors) or any(
        c.__name__ == "FSDPModule" for m in modules for c in type(m).__mro__
    )
    if sharded:
        need = ".".join(map(str, FSDP2_MIN_TORCH))
        raise EMATypeError(
            f"the model is sharded (FSDP2 or DTensor parameters), which emakit supports on "
            f"torch>={need}; this is torch {torch.__version__}: upgrade torch "
            f"(pip install 'torch>={need}'), or use DDP on this version"
        )


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (e.g. an FSDP2 parameter)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def same_sharding(a: Tensor, b: Tensor) -> bool:
    """Whether two DTensors have the same device mesh and placements (False when either is
    a plain tensor)."""
    return (
        is_dtensor(a)
        and is_dtensor(b)
        and a.device_mesh == b.device_mesh  # type: ignore[attr-defined]
        and tuple(a.placements) == tuple(b.placements)  # type: ignore[attr-defined]
    )


def dtensor_like(local: Tensor, like: Tensor) -> Any:
    """A DTensor whose local shard is ``local``, with the mesh, placements, global shape
    and stride of the DTensor ``like`` (``DTensor.from_local`` without a check or any
    communication)."""
    from torch.distributed.tensor import DTensor

    d: Any = like
    return DTensor.from_local(
        local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride()
    )


def local_block(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where the local shard of the DTensor ``t`` lies in the full tensor: ``(offsets,
    sizes)``, one of each per dimension, as ``DTensor.__create_chunk_list__`` says (the
    protocol ``torch.distributed.checkpoint`` uses). The one place emakit learns where a
    shard goes, for sharded snapshots and for exports alike.

    It matches the data FSDP2 puts on each rank, with tensor parallelism
    (``_StridedShard``) over rows that do not divide evenly too (FSDP2 refuses such rows
    before torch 2.8). ``DTensor.full_tensor()`` does not: on torch 2.8 and 2.9 its
    reassembly of an uneven ``_StridedShard`` puts rows in the wrong places (rewritten
    after 2.9, pytorch#163843), so emakit never assembles a tensor with it.

    Raises:
        EMAStateError: the chunk is not the shape of the local shard (a layout emakit
            cannot place).
    """
    d: Any = t
    chunk = d.__create_chunk_list__()[0]
    offsets = tuple(int(x) for x in chunk.offsets)
    sizes = tuple(int(x) for x in chunk.sizes)
    local = tuple(d.to_local().shape)
    if local != sizes:
        raise EMAStateError(
            f"a DTensor's local shard has shape {local} but its chunk is {sizes} "
            f"(placements {d.placements}): emakit cannot place this shard in the full "
            f"tensor; save the EMA with emakit.distributed.save_sharded_ema instead"
        )
    return offsets, sizes


def stores_block(t: Tensor) -> bool:
    """Whether this rank is the one that stores the local shard of the DTensor ``t``
    where the shards are assembled or written once: the replica at coordinate 0 of every
    mesh dimension ``t`` is replicated over (HSDP's replicate dimension, a bias
    replicated over tensor-parallel ranks); every rank of a dimension that shards it.

    Raises:
        EMAStateError: ``t`` has a ``Partial`` placement (its shards are summands, not
            parts; an EMA's weights are never partial).
    """
    d: Any = t
    coordinate = d.device_mesh.get_coordinate() or []
    for placement in d.placements:
        if placement.is_partial():
            raise EMAStateError(
                f"a tensor with a Partial placement ({d.placements}) cannot be stored or "
                f"assembled: its shards are summands, not parts; an EMA's weights are "
                f"never partial"
            )
    return all(
        not p.is_replicate() or c == 0 for p, c in zip(d.placements, coordinate, strict=False)
    )


def local_tensor(t: Tensor) -> Tensor:
    """The shard of a DTensor this rank holds (``DTensor.to_local()``, without autograd);
    any other tensor is returned as is.

    The result aliases the DTensor's local storage, which for an FSDP2 parameter is the
    padded shard storage FSDP2 all-gathers from, so in-place writes to it are seen by the
    next forward. It may be a new view object on every call (torch returns a fresh view
    for ``nn.Parameter`` DTensors): compare shards with `shard_identity()`, not ``is``.

    Example:
        >>> local_tensor(torch.ones(2)).shape
        torch.Size([2])
    """
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()  # type: ignore[attr-defined,no-any-return]


#: Per DTensor class, a getter of its inner local tensor (see shard_identity).
_INNER: dict[type, Callable[[object], object]] = {}


def shard_identity_getter(t: Tensor) -> Callable[[object], object]:
    """A fast getter of `shard_identity()` for DTensors of ``t``'s class (for guards that
    check many shards on every update)."""
    cls = type(t)
    getter = _INNER.get(cls)
    if getter is None:
        name = t.__tensor_flatten__()[0][0]  # type: ignore[attr-defined]
        getter = _INNER[cls] = operator.attrgetter(name)
    return getter


def shard_identity(t: Tensor) -> object:
    """An object that is the same as long as the DTensor ``t`` keeps its local shard tensor.

    FSDP2 replaces a parameter's local tensor in place (same DTensor object) when the
    model is moved (``to()``, ``to_empty()``); the engine's guards compare this before
    every update. It has to be cheap and stable, which ``to_local()`` (a new view each
    call) is not. So this reads the inner tensor that the DTensor class names through the
    wrapper-subclass protocol (``__tensor_flatten__``, asked once per class), today its
    ``_local_tensor``. ``tests/test_fsdp_copy.py``
    (``test_torch_internals_emakit_reads_are_where_it_expects``) checks it.

    Args:
        t: a DTensor.

    Returns:
        The DTensor's inner local tensor object.
    """
    return shard_identity_getter(t)(t)


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
