"""Rank helpers for ``torch.distributed``: is a process group up, is this rank 0.

Both work in a process that never initialized ``torch.distributed`` (one process, rank 0).
"""

from __future__ import annotations

import torch

__all__ = ["dist_ready", "is_rank_zero"]


def dist_ready() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_zero() -> bool:
    """True on rank 0 of the default process group, and in a non-distributed process.

    Guard single-writer outputs with it (snapshots, logs). Collective exports such as
    [`save_full_ema_weights()`][emakit.distributed.save_full_ema_weights] must be called on every rank.
    """
    return not dist_ready() or torch.distributed.get_rank() == 0
