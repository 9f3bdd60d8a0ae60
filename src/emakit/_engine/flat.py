"""Flat layouts: tensors side by side in one buffer, and spans over them.

A model re-homed by [`flatten_parameters()`][emakit._engine.flat.flatten_parameters] (and every
EMA shadow, which emakit lays out itself, see `rehome_()`) keeps each tensor's identity (a
``Parameter`` stays the same Python object, so optimizers that hold it keep working) but
its ``.data`` is a view into one flat buffer per (device, dtype), each tensor starting on a
64-byte boundary ([`ALIGN`][emakit._engine.flat.ALIGN] elements, the padding zero).
Neighbouring tensors are then adjacent in memory, and the engine updates a whole run of
them, viewed as one 1-D *span*, with a single kernel instead of one per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .._dist.dtensor import is_dtensor
from ..errors import EMATypeError, EMAValueError

#: Every tensor of a flat layout emakit makes (the EMA's storage, ``flatten_parameters``,
#: staging buffers) starts at a multiple of this many elements: at least 64 bytes for every
#: dtype (256 for float32), the boundary CPU kernels vectorize on, and the same element
#: layout for every dtype, so a float32 shadow and its bf16 model line up element for
#: element. The padding holds zeros.
ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of [`ALIGN`][emakit._engine.flat.ALIGN]."""
    return -(-n // ALIGN) * ALIGN


def aligned_offsets(sizes: Sequence[int]) -> list[int]:
    """Where tensors of ``sizes`` elements start in a flat layout, one after the other, each
    at a multiple of [`ALIGN`][emakit._engine.flat.ALIGN] elements (64 bytes or more)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(aligned(total))
        total = offsets[-1] + n
    return offsets


def adjacent(a: Tensor, b: Tensor) -> bool:
    """Whether contiguous ``b`` starts right where contiguous ``a`` ends in one storage, or
    at the first [`ALIGN`][emakit._engine.flat.ALIGN] boundary after it (the padding of an aligned layout)."""
    if not (
        a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ):
        return False
    end, start = int(a.storage_offset()) + a.numel(), int(b.storage_offset())
    return start == end or (start > end and start == aligned(end) and start % ALIGN == 0)


def memory_order(t: Tensor) -> tuple[str, str, int, int]:
    """A sort key that puts tensors in the order they sit in memory, by device and dtype."""
    return str(t.device), str(t.dtype), t.untyped_storage().data_ptr(), int(t.storage_offset())


def span(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D view covering adjacent contiguous tensors, padding included (the tensor
    itself if alone)."""
    if len(tensors) == 1:
        return tensors[0]
    first, last = tensors[0].detach(), tensors[-1]
    size = int(last.storage_offset()) + last.numel() - int(first.storage_offset())
    return torch.as_strided(first, (size,), (1,), first.storage_offset())


def split_runs(
    lists: Sequence[Sequence[Tensor]], offsets: Sequence[int] | None = None
) -> list[list[int]]:
    """Indices cut into maximal runs whose tensors are memory-adjacent in every one of
    ``lists`` at once and spaced alike in all of them (and as ``offsets`` are, when given:
    a run then maps onto a buffer laid out by them), so their spans have one length."""
    runs: list[list[int]] = []
    for i in range(len(lists[0])):
        if runs:
            j = runs[-1][-1]
            gaps = {int(ts[i].storage_offset()) - int(ts[j].storage_offset()) for ts in lists}
            if offsets is not None:
                gaps.add(offsets[i] - offsets[j])
            if len(gaps) == 1 and all(adjacent(ts[j], ts[i]) for ts in lists):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _view_like(flat: Tensor, offset: int, like: Tensor) -> Tensor:
    """A view of ``flat[offset : offset + like.numel()]`` with ``like``'s shape, and its
    strides when it is channels-last, so re-homing never changes the memory format a
    model's kernels see."""
    view = flat.narrow(0, offset, like.numel())
    if like.is_contiguous(memory_format=torch.channels_last) or like.is_contiguous(
        memory_format=torch.channels_last_3d
    ):
        return torch.as_strided(view, like.shape, like.stride())
    return view.view(like.shape)


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
        raise EMATypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; "
            f"flatten_parameters re-homes a module's parameters"
        )
    tensors: list[Tensor] = list(model.parameters())
    if buffers:
        tensors += list(model.buffers())
    sharded = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if is_dtensor(t)]
    if sharded:
        raise EMAValueError(
            f"flatten_parameters got a sharded model (DTensor parameters, e.g. after "
            f"fully_shard: {sharded[:3]}); a DTensor cannot be re-homed into a flat buffer. "
            f"Call flatten_parameters(model) before sharding it (FSDP2 keeps its own flat "
            f"shards)"
        )
    return rehome_(tensors)
