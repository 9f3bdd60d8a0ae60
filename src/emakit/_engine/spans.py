"""Spans: runs of tensors that sit next to each other in memory, viewed as one 1-D tensor.

A model re-homed by [`flatten_parameters()`][emakit._engine.flat.flatten_parameters] (and every EMA shadow,
which emakit lays out itself) keeps neighbouring tensors adjacent in one storage; the
engine then updates a whole run with one kernel instead of one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "ALIGN",
    "adjacent",
    "aligned",
    "aligned_offsets",
    "extent",
    "runs_both",
    "span",
    "split_runs",
]

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


def extent(tensors: Sequence[Tensor]) -> int:
    """Elements from the start of the first of adjacent tensors to the end of the last."""
    first, last = tensors[0], tensors[-1]
    return int(last.storage_offset()) + last.numel() - int(first.storage_offset())


def span(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D view covering adjacent contiguous tensors, padding included (the tensor
    itself if alone)."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0].detach()
    return torch.as_strided(first, (extent(tensors),), (1,), first.storage_offset())


def split_runs(items: Sequence[Tensor], offsets: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of ``items`` cut into maximal runs of memory-adjacent tensors; with
    ``offsets``, also spaced as ``offsets`` are (so a run maps onto a buffer laid out by
    them)."""
    runs: list[list[int]] = []
    for i in range(len(items)):
        if runs and _follows(items, runs[-1][-1], i, offsets):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _follows(items: Sequence[Tensor], j: int, i: int, offsets: Sequence[int] | None) -> bool:
    if not adjacent(items[j], items[i]):
        return False
    gap = int(items[i].storage_offset()) - int(items[j].storage_offset())
    return offsets is None or gap == offsets[i] - offsets[j]


def runs_both(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> list[list[int]]:
    """Maximal runs of pairs that are memory-adjacent on both sides at once, with the same
    spacing on both sides (so the two spans have the same length)."""
    offsets = [int(t.storage_offset()) for t in srcs]
    runs: list[list[int]] = []
    for i in range(len(dsts)):
        j = runs[-1][-1] if runs else -1
        if runs and _follows(dsts, j, i, offsets) and adjacent(srcs[j], srcs[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
