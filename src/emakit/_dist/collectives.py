"""Process groups for emakit's collective saves, loads and exports: is one up, is this
rank 0, and do the ranks agree.

`dist_ready()` and [`is_rank_zero()`][emakit.distributed.is_rank_zero] work in a process
that never initialized ``torch.distributed`` (one process, rank 0). `agree()` is a bounded
arrival check and one all-gather of a few int64 numbers per call, on
every rank of the process group:

``[MAGIC, operation, step, num_skipped_nonfinite, extra_hi, extra_lo, settings]``

* **Every rank called the same operation.** The ranks first meet in a bounded arrival
  check (``timeout_s``, 30 s by default) on the process group's c10d store, the same on
  every backend (`emakit._dist.arrival`): a rank whose peers never arrive, because the
  call sits inside ``if is_rank_zero():`` or another rank-dependent branch, raises an
  [`EMARuntimeError`][emakit.EMARuntimeError] saying "call on every rank" and naming the
  ranks that did not arrive (rank 0 learns who is missing, the others learn it from rank
  0, or that rank 0 is), instead of hanging until the process group's own timeout (30
  minutes by default). The check runs no collective, so a failed one abandons none; but
  the ranks' emakit calls are then out of step, the program is wrong, and the message
  says how to fix it. Where torch does not expose the store, a collective does the check
  (gloo's ``monitored_barrier``, which also names the ranks; one bounded all-reduce on
  other backends, which cannot), and a failure leaves the process group unusable. Ranks
  that meet in different emakit operations raise on every rank, naming who called what.
* **Every rank's EMA is at the same step with the same skip count.** Otherwise every rank
  raises the same [`EMAStateError`][emakit.errors.EMAStateError], naming the ranks and their steps: one
  rank called ``update()`` more often than the others, so a checkpoint would record one
  rank's step for shards that were averaged a different number of times.
* **Every rank's EMA was built with the same settings.** ``settings`` is a digest (63
  bits of SHA-256) of the settings that must agree (the shadow dtype, the decay rule and
  its parameters, the update cadence, the post-hoc profiles, the export dtype: whatever
  the caller passes, by name). A config read differently on one node would otherwise
  be written as one EMA of mixed parts, or abort inside a gather of tensors of other
  sizes. When the digests differ (every rank sees the same table), the ranks exchange
  the settings themselves (one ``all_gather_object``, on this failure path only) and
  every rank raises the same [`EMAStateError`][emakit.errors.EMAStateError] naming
  each setting that differs, its values and the ranks that hold them, before anything
  is written or loaded.
* ``extra`` carries 64 bits from the first rank to all, returned by `agree()` (the
  version folder of a sharded save or load), so the check costs no collective of its own.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import EMARuntimeError, EMAStateError
from .arrival import default_store, missing_ranks

#: Default seconds a rank waits for the others at an agreement step. The ranks meet there
#: right after a training step, whose own collectives (gradient reduce-scatter, all-reduce)
#: already lined them up, so they normally arrive within a fraction of a second; a call
#: that only some ranks make fails after this long instead of minutes, naming the ranks
#: that did not arrive on every backend (the check is on the process group's store, see
#: `emakit._dist.arrival`; rank 0 is named by the others when it is the one missing).
#: Raise it (the functions' ``timeout_s``) when ranks do uneven work right before the
#: call (an evaluation on rank 0 only).
AGREE_TIMEOUT_S = 30.0

#: The operations that agree, by code (the code travels in the all-gather).
OPERATIONS = {
    1: "save_sharded_ema",
    2: "load_sharded_ema",
    3: "save_full_ema_weights",
    4: "load_sharded_ema (after loading)",
    5: "state_dict of a ZeRO-3 EMA",
    6: "load_state_dict of a partitioned EMA",
    7: "PostHocEMA.checkpoint",
    8: "save_ema_weights",
    9: "load_ema_weights",
}
_CODES = {name: code for code, name in OPERATIONS.items()}
#: Codes of one collective under its two names (the verb and its ``_full_`` alias meet).
_SAME = {8: 3}
_MAGIC = 0x454D414B  # "EMAK": a row of emakit's, not some other all-gather's


def dist_ready() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_zero() -> bool:
    """True on rank 0 of the default process group, and in a non-distributed process.

    Guard single-writer outputs with it (snapshots, logs). emakit's collective saves and
    exports ([`save_ema_weights()`][emakit.checkpoint.save_ema_weights] of a sharded EMA...)
    must be called on every rank.
    """
    return not dist_ready() or torch.distributed.get_rank() == 0


def collective_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device for an NCCL
    group, the CPU for gloo (and for a group with both, whose CPU tensors go to gloo)."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "gloo" not in backend and "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_padded(
    local: Tensor, rows: int, group: Any = None, *, to_writer: bool = False
) -> Tensor | None:
    """Every rank's ``local``, padded with zeros to ``rows`` rows, in one buffer of
    ``world * rows`` rows in rank order: an all-gather on ``group`` (every rank receives
    it), or with ``to_writer`` a gather to rank 0, the writer (the other ranks receive
    nothing and get None). The one way emakit assembles a full tensor from shards: FSDP2's
    rows (`emakit._files.export`) and DeepSpeed's flat partitions (`emakit._dist.deepspeed`).
    A gather to the writer over gloo on the CPU goes point to point (`_receive_on_writer()`),
    so that rank 0 holds the tensor once.
    """
    dist = torch.distributed
    if to_writer and local.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return _receive_on_writer(local, rows, group)
    if local.shape[0] != rows:  # the last ranks' shards are shorter, or empty: pad them
        local = _padded(local, rows)
    world = dist.get_world_size(group)
    if to_writer:
        out = local.new_empty((world * rows, *local.shape[1:])) if dist.get_rank() == 0 else None
        chunks = None if out is None else list(out.chunk(world))
        dist.gather(local.contiguous(), chunks, dst=0, group=group)
        return out
    full = local.new_empty((world * rows, *local.shape[1:]))
    # all_gather_single where present: gloo's all_gather_into_tensor holds two copies
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, local.contiguous(), group=group)
    return full


def _padded(local: Tensor, rows: int) -> Tensor:
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    return padded


def _receive_on_writer(local: Tensor, rows: int, group: Any) -> Tensor | None:
    """`gather_padded()` to rank 0 over gloo on the CPU, by point-to-point: rank 0 receives
    each rank's padded rows straight into its chunk of the output, and copies its own in
    unpadded. gloo's ``gather`` receives into a flat buffer of its own and then copies it
    into the chunks, so rank 0 held the tensor twice; this way it holds it once (measured
    in BENCHMARKS.md). The ranks send in the order they gather, so messages pair up."""
    dist = torch.distributed
    if dist.get_rank() != 0:
        if rows:
            dist.send(
                _padded(local, rows) if local.shape[0] != rows else local.contiguous(), 0, group
            )
        return None
    world, me = dist.get_world_size(group), dist.get_rank(group)
    out = local.new_empty((world * rows, *local.shape[1:]))
    if not rows:
        return out
    chunks = out.split(rows)
    chunks[me][: local.shape[0]].copy_(local)
    chunks[me][local.shape[0] :].zero_()
    pending = [
        dist.irecv(chunks[i], src=_global_rank(group, i), group=group)
        for i in range(world)
        if i != me
    ]
    for work in pending:
        if work is not None:  # None only for a rank outside the group, which rank 0 is not
            work.wait()
    return out


def _global_rank(group: Any, index: int) -> int:
    return index if group is None else int(torch.distributed.get_global_rank(group, index))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _missing_by_collective(group: Any, timeout_s: float) -> list[int] | None:
    """The fallback where torch exposes no store (`emakit._dist.arrival.default_store()`):
    the ranks that did not arrive, where the backend can tell: a gloo group's
    ``monitored_barrier`` names them on rank 0 (and rank 0's absence on the others); other
    backends run one bounded all-reduce of a single number, which cannot. None when
    everyone arrived; ``[]`` when they did not and the backend cannot tell who."""
    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    gloo = "gloo" in str(dist.get_backend(group)).lower()
    try:
        if gloo:
            dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
        else:
            one = torch.ones(1, dtype=torch.int64, device=collective_device(group))
            dist.all_reduce(one, group=group, async_op=True).wait(timeout=timeout)
    except RuntimeError as e:
        found = re.search(r"Ranks? ([\d, ]+) failed to pass", " ".join(str(e).split()))
        if found:
            return [int(r) for r in found.group(1).replace(",", " ").split()]
        return [0] if gloo and dist.get_rank(group) != 0 else []
    return None


def _arrivals(operation: str, group: Any, timeout_s: float) -> tuple[list[int] | None, str]:
    """``(the group ranks that did not arrive or None, what that did to the group)``."""
    store = default_store()
    if store is None:
        abandoned = "This process group cannot be used any more (its collective was abandoned)"
        return _missing_by_collective(group, timeout_s), abandoned
    try:
        missing = missing_ranks(store, group, timeout_s)
    except RuntimeError as e:  # the store itself failed (its server is gone)
        raise EMARuntimeError(
            f"{operation}: the process group's store failed while the ranks met "
            f"({' '.join(str(e).split())[:200]}); is the job shutting down?"
        ) from e
    return missing, (
        "No collective was started, but this rank's emakit calls are now out of step with "
        "the others': fix the program and start the job again"
    )


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
    settings: Mapping[str, str] | None = None,
) -> int:
    """One bounded all-gather: every rank of ``group`` is in ``operation`` with the same
    ``step``, ``skips`` and ``settings`` (see the module docstring).

    Args:
        operation: one of `OPERATIONS`' names.
        step: this rank's EMA step (call count).
        skips: this rank's ``num_skipped_nonfinite``.
        group: the process group (default: the default group).
        timeout_s: seconds to wait for the other ranks.
        check_counts: compare ``step`` and ``skips`` (False: only that every rank came).
        extra: 64 bits that every rank receives from the first rank.
        settings: the settings that must agree, by name, as text (None: not checked).

    Returns:
        The first rank's ``extra``.

    Raises:
        EMARuntimeError: the other ranks did not arrive within ``timeout_s`` (or the
            process group failed), or some ranks are in another emakit operation.
        EMAStateError: the ranks' settings, steps or skip counts differ (raised on every
            rank).
    """
    dist = torch.distributed
    world = dist.get_world_size(group)
    extra &= (1 << 64) - 1  # in two int64 columns, 32 bits each
    row = [_MAGIC, _CODES[operation], int(step), int(skips), extra >> 32, extra & 0xFFFFFFFF]
    row.append(_digest(settings))
    mine = torch.tensor(row, dtype=torch.int64, device=collective_device(group))
    rows = [torch.empty_like(mine) for _ in range(world)]
    me = dist.get_rank()
    missing, aftermath = _arrivals(operation, group, timeout_s)
    if missing is not None:
        if dist.get_rank(group) in missing:
            who = "this rank arrived after the others had stopped waiting"
        elif missing:
            who = f"{_ranks([_global_rank(group, r) for r in missing])} did not arrive"
        else:
            who = f"not all {world} ranks arrived"
        raise EMARuntimeError(
            f"{operation} is a collective: call on every rank. On rank {me}, {who} within "
            f"timeout_s={timeout_s:g} s. Is the call inside `if is_rank_zero():` or another "
            f"branch that only some ranks take? {aftermath}"
        )
    try:
        work = dist.all_gather(rows, mine, group=group, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise EMARuntimeError(
            f"{operation} is a collective: call on every rank; rank {me} did not hear from "
            f"all {world} ranks within timeout_s={timeout_s:g} s "
            f"({' '.join(str(e).split())[:200]}). This process group cannot be used any more"
        ) from e
    table = [[int(v) for v in t.tolist()] for t in rows]
    ranks = [_global_rank(group, i) for i in range(world)]
    kinds = {_SAME.get(r[1], r[1]) if r[0] == _MAGIC else -1 for r in table}
    if len(kinds) > 1:
        names = [
            OPERATIONS.get(r[1], f"an unknown operation (code {r[1]})")
            if r[0] == _MAGIC
            else "another collective (not an emakit agreement)"
            for r in table
        ]
        parts = "; ".join(f"{_ranks(rs)} in {name}" for name, rs in _by_value(ranks, names).items())
        raise EMARuntimeError(
            f"the ranks are not all in the same collective: {parts}. Every rank must make "
            f"emakit's collective calls (save_sharded_ema, load_sharded_ema, "
            f"save_ema_weights of a sharded EMA, save_full_ema_weights) in the same order; "
            f"none may sit inside `if is_rank_zero():`"
        )
    if len({r[6] for r in table}) > 1:
        _refuse_settings(operation, settings or {}, ranks, group)
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
    return (table[0][4] << 32) | table[0][5]


def _digest(settings: Mapping[str, str] | None) -> int:
    """63 bits of the SHA-256 of ``settings`` (0: none), the same on every host."""
    if settings is None:
        return 0
    text = json.dumps(dict(settings), sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _refuse_settings(
    operation: str, settings: Mapping[str, str], ranks: list[int], group: Any
) -> None:
    """Raise on every rank, naming each setting that differs across the ranks (their
    digests already did: every rank is here, so the exchange cannot hang)."""
    everyone: list[Any] = [None] * len(ranks)
    torch.distributed.all_gather_object(everyone, dict(settings), group=group)
    parts = []
    for name in sorted({k for s in everyone for k in s}):
        values = _by_value(ranks, [s.get(name, "(not set)") for s in everyone])
        if len(values) > 1:
            held = "; ".join(f"{_short(v)} on {_ranks(rs)}" for v, rs in values.items())
            parts.append(f"{name}: {held}")
    if operation.startswith(("save", "PostHoc")):
        done = "nothing was written"
    elif operation.startswith("load") and "after" not in operation:
        done = "nothing was loaded"
    else:
        done = "the state was not taken" if operation.startswith("state") else "it loaded"
    raise EMAStateError(
        f"{operation}: the ranks differ in what must be the same on every rank ({done}): "
        + " | ".join(parts)
        + ". Every rank must build its EMA with the same settings (was a config read "
        "differently on one node?) and load its own state; fix it on the ranks named and "
        "restart from the last checkpoint"
    )


def _short(value: str, limit: int = 160) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def agree_on(
    operation: str, counts: Any, *, settings: Mapping[str, str] | None = None, **kwargs: Any
) -> int:
    """`agree()` on the ``step``, ``num_skipped_nonfinite`` and settings of ``counts`` (an
    EMA, or its tracker: `emakit._core.tracker.Tracker.agreed_settings()`), with
    ``settings`` added (an export's dtype...); ``kwargs`` are `agree()`'s (``group``,
    ``timeout_s``, ...)."""
    tracker = getattr(counts, "tracker", counts)
    agreed = {**tracker.agreed_settings(), **(settings or {})}
    return agree(
        operation,
        step=int(counts.step),
        skips=counts.num_skipped_nonfinite,
        settings=agreed,
        **kwargs,
    )
