"""Re-homing tensors into one contiguous buffer per (device, dtype).

After re-homing, each tensor keeps its identity (a ``Parameter`` stays the same Python
object, so optimizers that hold it keep working) but its ``.data`` is a view into a shared
flat buffer. Neighbouring tensors are then adjacent in memory (each starting on a 64-byte
boundary, [`ALIGN`][emakit._engine.spans.ALIGN] elements, the padding zero), and the engine
updates a whole run of them with a single kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .._dist.dtensor import is_dtensor
from .spans import aligned_offsets

__all__ = ["dense_layout", "flatten_parameters", "rehome_"]


def dense_layout(t: Tensor) -> torch.memory_format | None:
    """The memory format under which ``t`` is dense, or ``None`` if it is not dense."""
    if t.is_contiguous():
        return torch.contiguous_format
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return None


def _view_like(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """A view of ``flat[offset : offset + like.numel()]`` with ``like``'s shape and strides.

    Keeps channels-last tensors channels-last, so re-homing never changes the memory
    format a model's kernels see.
    """
    fmt = dense_layout(like)
    span = flat.narrow(0, offset, like.numel())
    if fmt is None or fmt is torch.contiguous_format:
        return span.view(like.shape)
    return torch.as_strided(span, like.shape, like.stride())


def rehome_(
    tensors: Sequence[Tensor],
    *,
    sources: Sequence[Tensor] | None = None,
    dtype_for: Iterable[torch.dtype | None] | None = None,
    device: torch.device | None = None,
    pin_memory: bool = False,
) -> list[Tensor]:
    """Move each tensor's data into one flat buffer per (device, dtype), in the given order.

    Args:
        tensors: tensors (parameters or buffers) re-homed in place, through ``.data``.
            Duplicates (tied weights) are re-homed once.
        sources: optional tensors to take the values, shape and layout from, one per
            tensor (default: the tensors themselves). Lets a placeholder be filled.
        dtype_for: optional target dtype per tensor (``None`` keeps its dtype); used to
            give the EMA shadow a wider dtype than the model (``ema_dtype``).
        device: optional device for every buffer (default: each tensor's own), e.g. to
            keep an EMA shadow on the CPU.
        pin_memory: allocate CPU buffers in pinned memory (for non-blocking copies to and
            from an accelerator).

    Returns:
        The flat buffers, one per (device, dtype) group, in first-seen order.
    """
    srcs = list(sources) if sources is not None else list(tensors)
    dtypes = list(dtype_for) if dtype_for is not None else [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = {}
    seen: set[int] = set()
    for t, src, dt in zip(tensors, srcs, dtypes, strict=True):
        if id(t) in seen:
            continue
        seen.add(id(t))
        groups.setdefault((device or t.device, dt or t.dtype), []).append((t, src))
    flats = []
    with torch.no_grad():
        for (dev, dtype), members in groups.items():
            pin = pin_memory and dev.type == "cpu"
            offsets = aligned_offsets([s.numel() for _, s in members])
            total = offsets[-1] + members[-1][1].numel()
            # zeros: the alignment padding is read by span kernels and must stay finite
            flat = torch.zeros(total, device=dev, dtype=dtype, pin_memory=pin)
            for (t, src), offset in zip(members, offsets, strict=True):
                view = _view_like(flat, offset, src)
                view.copy_(src)
                t.data = view
            flats.append(flat)
    return flats


def flatten_parameters(model: torch.nn.Module, *, buffers: bool = True) -> list[Tensor]:
    """Re-home a model's parameters (and buffers) into one flat buffer per (device, dtype).

    Every ``Parameter`` stays the same Python object, so optimizers built before or after
    keep working; only its storage moves. Afterwards an EMA of the model updates each
    (device, dtype) group with a single ``lerp_`` over one span (see the ``"flat"`` path),
    which is what makes models with many small tensors cheap to average.

    Call it before building an EMA, and before sharding the model (``fully_shard``): a
    sharded model raises an ``EMAValueError``. Tensors are laid out in ``named_parameters()`` order,
    then ``named_buffers()`` order; channels-last tensors stay channels-last.

    Args:
        model: the module to re-home in place.
        buffers: also re-home buffers (float and integer). Default True.

    Returns:
        The flat buffers, one per (device, dtype).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        >>> [flat.numel() for flat in flatten_parameters(net)]  # each tensor 64-aligned
        [193]
    """
    if not isinstance(model, torch.nn.Module):
        from ..errors import EMATypeError

        raise EMATypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; "
            f"flatten_parameters re-homes a module's parameters"
        )
    tensors: list[Tensor] = list(model.parameters())
    if buffers:
        tensors += list(model.buffers())
    sharded = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_dtensor(t)]
    if sharded:
        from ..errors import EMAValueError

        raise EMAValueError(
            f"flatten_parameters got a sharded model (DTensor parameters, e.g. after "
            f"fully_shard: {sharded[:3]}); a DTensor cannot be re-homed into a flat buffer. "
            f"Call flatten_parameters(model) before sharding it (FSDP2 keeps its own flat "
            f"shards)"
        )
    return rehome_(tensors)
