"""Spans: runs of tensors that sit next to each other in memory, viewed as one 1-D tensor.

A model re-homed by [`flatten_parameters()`][emakit._engine.flat.flatten_parameters] (and every EMA shadow,
which emakit lays out itself) keeps neighbouring tensors adjacent in one storage; the
engine then updates a whole run with one kernel instead of one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ALIGN", "adjacent", "aligned", "aligned_offsets", "gather_views", "span", "split_runs"]

#: Every tensor of a flat layout emakit makes (the EMA's storage, ``flatten_parameters``,
#: staging buffers) starts at a multiple of this many elements: at least 64 bytes for every
#: dtype (256 for float32), the boundary CPU kernels vectorize on, and the same element
#: layout for every dtype, so a float32 shadow and its bf16 model line up element for
#: element. The padding holds zeros.
ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of [`ALIGN`][emakit._engine.spans.ALIGN]."""
    return -(-n // ALIGN) * ALIGN


def aligned_offsets(sizes: Sequence[int]) -> list[int]:
    """Where tensors of ``sizes`` elements start in a flat layout, one after the other, each
    at a multiple of [`ALIGN`][emakit._engine.spans.ALIGN] elements (64 bytes or more)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(aligned(total))
        total = offsets[-1] + n
    return offsets


def adjacent(a: Tensor, b: Tensor) -> bool:
    """Whether contiguous ``b`` starts right where contiguous ``a`` ends in one storage, or
    at the first [`ALIGN`][emakit._engine.spans.ALIGN] boundary after it (the padding of an aligned layout)."""
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


def gather_views(
    buffer: Tensor, at: Sequence[int], tensors: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """``(views, spans)`` such that copying each span of ``tensors`` into its view of the
    1-D ``buffer`` puts ``tensors[i]`` at ``buffer[at[i]:]``: one pair per run of tensors
    spaced as ``at`` (a lone tensor keeps its shape)."""
    views, spans = [], []
    for run in split_runs([tensors], at):
        first, last = run[0], run[-1]
        v = buffer.narrow(0, at[first], at[last] + tensors[last].numel() - at[first])
        views.append(v.view(tensors[first].shape) if len(run) == 1 else v)
        spans.append(span([tensors[i] for i in run]))
    return views, spans
