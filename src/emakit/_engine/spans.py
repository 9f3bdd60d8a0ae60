"""Spans: runs of tensors that sit next to each other in memory, viewed as one 1-D tensor.

A model re-homed by :func:`~emakit._engine.flat.flatten_parameters` (and every EMA shadow,
which emakit lays out itself) keeps neighbouring tensors adjacent in one storage; the
engine then updates a whole run with one kernel instead of one per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["adjacent", "runs_both", "span", "split_runs"]


def adjacent(a: Tensor, b: Tensor) -> bool:
    """Whether contiguous ``b`` starts right where contiguous ``a`` ends, in one storage."""
    return bool(
        a.is_contiguous()
        and b.is_contiguous()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() + a.numel() == b.storage_offset()
    )


def span(tensors: Sequence[Tensor]) -> Tensor:
    """One 1-D view covering adjacent contiguous tensors (the tensor itself if alone)."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0].detach()
    return torch.as_strided(first, (sum(t.numel() for t in tensors),), (1,), first.storage_offset())


def split_runs(items: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``items`` cut into maximal runs of memory-adjacent tensors."""
    runs: list[list[int]] = []
    for i, t in enumerate(items):
        if runs and adjacent(items[runs[-1][-1]], t):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def runs_both(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> list[list[int]]:
    """Maximal runs of pairs that are memory-adjacent on both sides at once."""
    runs: list[list[int]] = []
    for i in range(len(dsts)):
        if runs and adjacent(dsts[runs[-1][-1]], dsts[i]) and adjacent(srcs[runs[-1][-1]], srcs[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
