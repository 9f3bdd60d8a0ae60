"""Rank agreement before emakit's collective saves, loads and exports.

Imported by :mod:`emakit.distributed` only. :func:`agree` is one all-gather of a few
int64 numbers per call, on every rank of the process group:

``[MAGIC, operation, step, num_skipped_nonfinite, extra_hi, extra_lo]``

* **Every rank called the same operation.** The all-gather's wait is bounded
  (``timeout_s``): a rank whose peers never arrive, because the call sits inside
  ``if is_rank_zero():`` or another rank-dependent branch, raises an
  :class:`~emakit.EMARuntimeError` saying so after ``timeout_s`` seconds instead of
  hanging until the process group's own timeout (30 minutes by default). After such a
  timeout the process group is unusable (its pending collective was abandoned): the
  program is wrong, and the message says how to fix it. Ranks that meet in different
  emakit operations raise on every rank, naming who called what.
* **Every rank's EMA is at the same step with the same skip count.** Otherwise every rank
  raises the same :class:`~emakit.EMAStateError`, naming the ranks and their steps: one
  rank called ``update()`` more often than the others, so a checkpoint would record one
  rank's step for shards that were averaged a different number of times.
* ``extra`` carries 64 bits from the first rank to all (the version folder of a sharded
  save), so the check costs no collective of its own.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ..errors import EMARuntimeError, EMAStateError

__all__ = ["AGREE_TIMEOUT_S", "OPERATIONS", "Agreed", "agree", "collective_device"]

#: Default seconds a rank waits for the others at an agreement step.
AGREE_TIMEOUT_S = 300.0

#: The operations that agree, by code (the code travels in the all-gather).
OPERATIONS = {
    1: "save_sharded_ema",
    2: "load_sharded_ema",
    3: "save_full_ema_weights",
    4: "load_sharded_ema (after loading)",
    5: "state_dict of a ZeRO-3 EMA",
    6: "load_full_ema_weights",
}
_CODES = {name: code for code, name in OPERATIONS.items()}
_MAGIC = 0x454D414B  # "EMAK": a row of emakit's, not some other all-gather's
_MASK32 = (1 << 32) - 1


def collective_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device for an NCCL
    group, the CPU for gloo (and for a group with both, whose CPU tensors go to gloo)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global_rank(group: Any, index: int) -> int:
    return index if group is None else int(torch.distributed.get_global_rank(group, index))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class Agreed:
    """What every rank brought to :func:`agree`.

    Attributes:
        ranks: the global rank of each row.
        rows: ``[MAGIC, op, step, skips, extra_hi, extra_lo]`` per rank.
    """

    def __init__(self, ranks: list[int], rows: list[list[int]]) -> None:
        self.ranks = ranks
        self.rows = rows

    @property
    def extra(self) -> int:
        """The first rank's ``extra`` (64 bits)."""
        row = self.rows[0]
        return (row[4] << 32) | row[5]


def _by_value(ranks: list[int], values: list[Any]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        groups.setdefault(v, []).append(r)
    return groups


def agree(
    operation: str,
    *,
    step: int,
    skips: int,
    group: Any = None,
    timeout_s: float = AGREE_TIMEOUT_S,
    check_counts: bool = True,
    extra: int = 0,
) -> Agreed:
    """One bounded all-gather: every rank of ``group`` is in ``operation`` with the same
    ``step`` and ``skips`` (see the module docstring).

    Args:
        operation: one of :data:`OPERATIONS`' names.
        step: this rank's EMA step (call count).
        skips: this rank's ``num_skipped_nonfinite``.
        group: the process group (default: the default group).
        timeout_s: seconds to wait for the other ranks.
        check_counts: compare ``step`` and ``skips`` (False: only that every rank came).
        extra: 64 bits that every rank receives from the first rank (:attr:`Agreed.extra`).

    Returns:
        Every rank's row.

    Raises:
        EMARuntimeError: the other ranks did not arrive within ``timeout_s`` (or the
            process group failed), or some ranks are in another emakit operation.
        EMAStateError: the ranks' steps or skip counts differ (raised on every rank).
    """
    dist = torch.distributed
    code = _CODES[operation]
    device = collective_device(group)
    world = dist.get_world_size(group)
    extra &= (1 << 64) - 1
    row = [_MAGIC, code, int(step), int(skips), extra >> 32, extra & _MASK32]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    me = dist.get_rank()
    try:
        work = dist.all_gather(rows, mine, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise EMARuntimeError(
            f"{operation} is a collective: every rank must call it, but rank {me} did not "
            f"hear from all {world} ranks within timeout_s={timeout_s:g} s "
            f"({' '.join(str(e).split())[:200]}). Is the call inside `if is_rank_zero():` or "
            f"another branch that only some ranks take? Call {operation} on every rank. "
            f"This process group cannot be used any more (its collective was abandoned)"
        ) from e
    table = [[int(v) for v in t.tolist()] for t in rows]
    ranks = [_global_rank(group, i) for i in range(world)]
    names = [
        OPERATIONS.get(r[1], f"an unknown operation (code {r[1]})")
        if r[0] == _MAGIC
        else "another collective (not an emakit agreement)"
        for r in table
    ]
    calls = _by_value(ranks, names)
    if len(calls) > 1:
        parts = "; ".join(f"{_ranks(rs)} in {name}" for name, rs in calls.items())
        raise EMARuntimeError(
            f"the ranks are not all in the same collective: {parts}. Every rank must make "
            f"emakit's collective calls (save_sharded_ema, load_sharded_ema, "
            f"save_full_ema_weights) in the same order; none may sit inside "
            f"`if is_rank_zero():`"
        )
    if check_counts:
        for what, column, why in (
            (
                "step",
                2,
                "some ranks called update() more often than others, so their EMAs were not "
                "averaged alike and no one step describes them. Call ema.update() on every "
                "rank after every optimizer step",
            ),
            (
                "num_skipped_nonfinite",
                3,
                "some ranks skipped updates for NaN/Inf weights that others averaged, so "
                "the ranks' model weights differ (under DDP they must be identical on every "
                "rank). Find where the ranks' weights diverged",
            ),
        ):
            values = _by_value(ranks, [r[column] for r in table])
            if len(values) > 1:
                parts = ", ".join(f"{what} {v} on {_ranks(rs)}" for v, rs in sorted(values.items()))
                done = "nothing was written" if operation.startswith("save") else "it loaded"
                raise EMAStateError(
                    f"{operation}: the EMA differs across ranks ({parts}; {done}): {why}; "
                    f"to recover, load the last checkpoint saved before the ranks diverged"
                )
    return Agreed(ranks, table)
