"""The non-finite guard (``skip_nonfinite=True``), in one place: the flag, the select
kernels, the guarded path and the skip count; no host sync.

An update is skipped when any online weight holds NaN or Inf. The decision is a 0-dim
bool tensor that never leaves the device:

1. `local_flag()`: this process's online tensors are all finite. Their extremes
   (``torch._foreach_norm(..., inf)`` on an accelerator, ``torch.aminmax`` on the CPU: NaN
   and Inf propagate, finite values cannot overflow), stacked and reduced on the device.
2. `Agreement`: for sharded (DTensor) models under ``torch.distributed``, each rank
   sees only its shards, so the flags are combined by **one all-reduce of three int64
   numbers** per update, ``max(bad, call, -call)``, on the process group the shards live
   on (the default group when their meshes cover every rank). Every rank then takes the
   same decision. The call number rides along: if the ranks' calls do not match (one rank
   called ``update()`` more often), the update is skipped everywhere rather than averaged
   from a mismatched flag, and [`emakit.distributed()`][emakit.distributed] saves report the disagreement.
   DDP and single processes need no agreement: every rank holds the same weights.
3. `Guarded` (and `guarded_lerp_()`): kernels that select on the flag, bit for
   bit the plain ones where it is true; `GuardedPath` runs a plan's groups through
   them, a wrapper around the plan's path.
4. `FiniteGuard`, one per tracker: builds the flag for a plan (caching its sources
   and agreement), guards an action with it, and counts skips on the device
   (`SkipCount`, read back, with the warning about the first skip, only when
   someone asks for the count).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from .._dist.collectives import collective_device, dist_ready
from .._dist.deepspeed import is_partition
from .._dist.dtensor import is_dtensor
from ..decay import SKIP, Action
from .kernels import converted
from .pairs import TensorPair
from .paths import Group, Transfer
from .spans import aligned_offsets, span, split_runs

__all__ = [
    "GUARD_CHUNK",
    "Agreement",
    "FiniteGuard",
    "Guarded",
    "GuardedPath",
    "SkipCount",
    "guarded_copy_",
    "guarded_lerp_",
    "local_flag",
]

#: Elements per batch of a guarded update (`guarded_lerp_()`): the most scratch memory
#: it holds at once is this many elements of the shadow's dtype (16 MiB in float32).
GUARD_CHUNK = 1 << 22


def local_flag(tensors: Sequence[Tensor]) -> Tensor | None:
    """Whether every tensor in ``tensors`` is free of NaN and Inf, as a 0-dim bool tensor
    on the first tensor's device (None when there is nothing that could be non-finite).

    Integer and empty tensors are left out (always finite; an empty one has no max).
    Exact (no overflow: the extremes are compared, nothing is summed). On an accelerator,
    one ``torch._foreach_norm(..., inf)`` per dtype; on the CPU, where that norm is not
    vectorized (about 15x slower), one ``torch.aminmax`` per tensor.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            if t.is_complex():
                t = torch.view_as_real(t)
            groups.setdefault((t.device, t.dtype), []).append(t)
    flag: Tensor | None = None
    for (device, _), ts in groups.items():
        if device.type == "cpu":
            extremes = [v for t in ts for v in torch.aminmax(t)]
        else:
            extremes = list(torch._foreach_norm(ts, float("inf")))
        f = torch.stack(extremes).isfinite().all()
        flag = f if flag is None else flag & f.to(flag.device, non_blocking=True)
    return flag


def _mesh_ranks(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


class Agreement:
    """How the ranks that hold ``pairs``' shards combine their flags, or None (see
    `build()`).

    Attributes:
        groups: the process groups to all-reduce over, in order (``[None]``: the default
            group, one all-reduce).
        device: where the all-reduced tensor lives (CPU for gloo, the current CUDA device
            for NCCL meshes).
    """

    def __init__(self, groups: list[Any], device: torch.device) -> None:
        self.groups = groups
        self.device = device

    @classmethod
    def build(cls, pairs: Sequence[TensorPair]) -> Agreement | None:
        """The agreement for ``pairs``: None unless some online tensor is a DTensor or a
        DeepSpeed ZeRO-3 partition and a default process group exists.

        One all-reduce on the default group when the meshes of the DTensors cover every
        rank (FSDP, HSDP, FSDP+TP on the whole job), and for ZeRO-3 partitions (cut over
        the data-parallel ranks); otherwise one per dimension of each distinct mesh (e.g.
        FSDP on one pipeline stage's ranks).
        """
        if not dist_ready():
            return None
        meshes: dict[tuple, Any] = {}
        for p in pairs:
            if is_dtensor(p.online):
                mesh = p.online.device_mesh  # type: ignore[attr-defined]
                key = (mesh.device_type, _mesh_ranks(mesh), tuple(mesh.mesh.shape))
                meshes.setdefault(key, mesh)
        if not meshes:
            if any(is_partition(p.online) for p in pairs):
                return cls([None], collective_device())
            return None
        first = next(iter(meshes.values()))
        if first.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(first.device_type)
        covered = {r for key in meshes for r in key[1]}
        if len(covered) == torch.distributed.get_world_size():
            return cls([None], device)
        groups = [m.get_group(d) for _, m in sorted(meshes.items()) for d in range(m.ndim)]
        return cls(groups, device)

    def combine(self, flag: Tensor | None, call: int) -> Tensor:
        """``flag`` of this rank combined with every other rank's (all-reduce): true only if
        every rank's flag is true and every rank is at the same ``call``."""
        dist = torch.distributed
        vec = torch.full((3,), call, dtype=torch.int64, device=self.device)  # no host copy
        vec[2].neg_()
        if flag is None:  # nothing here can be non-finite (e.g. every local shard empty)
            vec[0].zero_()
        else:
            vec[0].copy_(flag.logical_not(), non_blocking=True)
        for group in self.groups:
            # async: NCCL orders it on the stream, the host never waits for the value
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        return (vec[0] == 0) & (vec[1] + vec[2] == 0)


# -- the select kernels -------------------------------------------------------------------


def _pieces(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Non-empty ``(dst, src)`` pairs, tensors over `GUARD_CHUNK` elements cut into
    1-D chunks (when both sides are contiguous)."""
    out = []
    for d, s in zip(dsts, srcs, strict=True):
        n = d.numel()
        if n == 0:
            continue
        if n <= GUARD_CHUNK or not (d.is_contiguous() and s.is_contiguous()):
            out.append((d, s))
            continue
        fd, fs = d.view(-1), s.reshape(-1)
        for at in range(0, n, GUARD_CHUNK):
            size = min(GUARD_CHUNK, n - at)
            out.append((fd.narrow(0, at, size), fs.narrow(0, at, size)))
    return out


def _batches(pieces: list[tuple[Tensor, Tensor]]) -> list[list[tuple[Tensor, Tensor]]]:
    """``pieces`` in consecutive batches of one destination device and dtype and at most
    about `GUARD_CHUNK` elements."""
    batches: list[list[tuple[Tensor, Tensor]]] = []
    size, key = GUARD_CHUNK, None
    for d, s in pieces:
        if size + d.numel() > GUARD_CHUNK or (d.device, d.dtype) != key:
            batches.append([])
            size, key = 0, (d.device, d.dtype)
        batches[-1].append((d, s))
        size += d.numel()
    return batches


class _Batch:
    """One batch of a `Guarded`: destinations, sources, and scratch views."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self.dsts = [d for d, _ in pairs]
        self.srcs = [s for _, s in pairs]
        first = self.dsts[0]
        self.key = (first.device, first.dtype)
        self.convert = any((s.device, s.dtype) != self.key for s in self.srcs)
        # one where() over the destinations when they are one run in memory; the scratch
        # then mirrors their layout, alignment padding included
        contiguous = first.is_contiguous() and len(split_runs(self.dsts)) == 1
        self.flat = span(self.dsts).view(-1) if contiguous else None
        base = int(first.storage_offset())
        self.at: list[int] = [
            int(d.storage_offset()) - base if contiguous else at
            for d, at in zip(
                self.dsts, aligned_offsets([d.numel() for d in self.dsts]), strict=True
            )
        ]
        self.numel = self.at[-1] + self.dsts[-1].numel()
        self.new = first  # set by place(): the scratch as one 1-D view, and per tensor
        self.views: list[Tensor] = []

    def place(self, buf: Tensor) -> None:
        self.new = buf.narrow(0, 0, self.numel)
        for d, at in zip(self.dsts, self.at, strict=True):
            self.views.append(buf.narrow(0, at, d.numel()).view(d.shape))

    def select(self, ok: Tensor) -> None:
        """``dst = where(ok, scratch, dst)``: every bit of the scratch, or of the old dst."""
        if self.flat is not None:
            torch.where(ok, self.new, self.flat, out=self.flat)
            return
        for d, t in zip(self.dsts, self.views, strict=True):
            torch.where(ok, t, d, out=d)


def _memory_order(pair: tuple[Tensor, Tensor]) -> tuple[str, str, int, int]:
    d = pair[0]
    return str(d.device), str(d.dtype), d.untyped_storage().data_ptr(), int(d.storage_offset())


class Guarded:
    """Pairs of tensors prepared for updates that happen only where a device-side flag
    says so (``skip_nonfinite=True``); build once, call `lerp()` / `copy()` often.

    .. math:: s \\leftarrow \\text{where}(ok,\\ \\text{lerp}(s, o, w),\\ s)

    A select, not ``lerp_`` with the weight multiplied by ``ok``: ``s + 0 * (o - s)`` is NaN
    where ``o`` is NaN or Inf. Each batch of at most `GUARD_CHUNK` elements is copied
    into a scratch buffer, averaged there by the same ``lerp_`` (one foreach copy, one
    foreach lerp), then selected back: one ``where`` per batch when the shadows are one run
    in memory (emakit lays a shadow out so), else one per tensor. With ``ok`` true the
    result is bit for bit ``shadow.lerp_(online, weight)``; with ``ok`` false every shadow
    keeps every bit (``-0.0`` included). Large tensors go in chunks. The scratch, held for
    the object's life, is one buffer per device and dtype of at most
    `GUARD_CHUNK` elements (16 MiB in float32), less for smaller models.

    Args:
        dsts: tensors updated in place (the shadow).
        srcs: tensors read, paired by position (cast/moved to the destination's dtype and
            device where they differ, at each call).
    """

    def __init__(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
        # In memory order (the pairs are independent): neighbours in a shadow's storage
        # end up in one batch, updated by one where() whatever order the model lists them.
        pieces = sorted(_pieces(dsts, srcs), key=_memory_order)
        self.batches = [_Batch(b) for b in _batches(pieces)]
        sizes: dict[tuple[torch.device, torch.dtype], int] = {}
        for b in self.batches:
            sizes[b.key] = max(sizes.get(b.key, 0), b.numel)
        # zeros: the padding between views is selected into the shadow's padding
        bufs = {k: torch.zeros(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
        for b in self.batches:
            b.place(bufs[b.key])

    def lerp(self, weight: float, ok: Tensor) -> None:
        """``dst.lerp_(src, weight)`` where the 0-dim bool ``ok`` is true, else nothing."""
        flag = _OnDevice(ok)
        with torch.no_grad():
            for b in self.batches:
                torch._foreach_copy_(b.views, b.dsts)
                srcs = converted(b.srcs, b.dsts) if b.convert else b.srcs
                torch._foreach_lerp_(b.views, srcs, weight)
                b.select(flag(b.key[0]))

    def copy(self, ok: Tensor) -> None:
        """``dst.copy_(src)`` where the 0-dim bool ``ok`` is true, else nothing."""
        flag = _OnDevice(ok)
        with torch.no_grad():
            for b in self.batches:
                torch._foreach_copy_(b.views, b.srcs)  # casts as copy_ does
                b.select(flag(b.key[0]))


class _OnDevice:
    """``ok`` on each destination device, moved once per call (no host sync: a 0-dim copy)."""

    def __init__(self, ok: Tensor) -> None:
        self.by_device = {ok.device: ok}

    def __call__(self, device: torch.device) -> Tensor:
        flag = self.by_device.get(device)
        if flag is None:
            flag = self.by_device[device] = self.by_device[next(iter(self.by_device))].to(
                device, non_blocking=True
            )
        return flag


def guarded_lerp_(
    shadows: Sequence[Tensor], onlines: Sequence[Tensor], weight: float, ok: Tensor
) -> None:
    """``shadow.lerp_(online, weight)`` for every pair where the 0-dim bool tensor ``ok`` is
    true; where it is false every shadow keeps its bits. No host sync: ``ok`` stays on the
    device. A one-off `Guarded` (build one to update the same tensors often).

    Args:
        shadows: tensors updated in place.
        onlines: tensors read, paired by position (cast/moved to the shadow's dtype and
            device where they differ).
        weight: ``1 - decay``.
        ok: 0-dim bool tensor: average (true) or leave every shadow unchanged (false).

    Example:
        >>> s, o = [torch.zeros(2)], [torch.tensor([1.0, float("nan")])]
        >>> guarded_lerp_(s, o, 0.5, torch.tensor(False))
        >>> s[0]
        tensor([0., 0.])
    """
    Guarded(shadows, onlines).lerp(weight, ok)


def guarded_copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], ok: Tensor) -> None:
    """``dst.copy_(src)`` for every pair where the 0-dim bool tensor ``ok`` is true; else
    nothing changes (see `guarded_lerp_()`)."""
    Guarded(dsts, srcs).copy(ok)


# -- around a plan ---------------------------------------------------------------------------


class GuardedPath:
    """A plan's groups updated only where a device-side flag says so: the same transfers as
    the plan's path, through `Guarded` kernels (built per transfer on first use).

    Staging is not in it: the plan stages first, as for its unguarded path.
    """

    def __init__(self, groups: Sequence[Group]) -> None:
        self.groups = groups
        #: id of a transfer -> (its kernels, the transfer, kept so the id stays its own)
        self.kernels: dict[int, tuple[Guarded, Transfer]] = {}

    def _of(self, t: Transfer) -> Guarded:
        entry = self.kernels.get(id(t))
        if entry is None:
            entry = self.kernels[id(t)] = (Guarded(t.dst, t.src), t)
        return entry[0]

    def lerp(self, weights: Sequence[float], ok: Tensor) -> None:
        """The path's ``lerp`` where ``ok`` holds, else nothing."""
        for g in self.groups:
            self._of(g.copy).copy(ok)
            self._of(g.lerp).lerp(weights[g.decay_group], ok)

    def copy(self, ok: Tensor) -> None:
        """The path's ``copy`` where ``ok`` holds, else nothing."""
        for g in self.groups:
            self._of(g.copy).copy(ok)
            self._of(g.lerp).copy(ok)

    def copy_unaveraged(self, ok: Tensor) -> None:
        """The path's ``copy_unaveraged`` where ``ok`` holds, else nothing."""
        for g in self.groups:
            self._of(g.copy).copy(ok)


class SkipCount:
    """Updates skipped for non-finite weights: resolved on the host, plus a device counter
    (and the call of its first skip) that is read back only when the count is asked for."""

    def __init__(self) -> None:
        self.resolved = 0
        self._device: tuple[Tensor, Tensor] | None = None  # (count, call of the first)

    def add_flag(self, ok: Tensor, call: int) -> None:
        """Count a skip on the device where the 0-dim bool ``ok`` is false (no host read)."""
        bad = ok.logical_not()
        pending = self._device
        if pending is None or pending[0].device != ok.device:
            self.resolve()
            zeros = torch.zeros((2,), dtype=torch.long, device=ok.device)
            pending = self._device = (zeros[0], zeros[1])
        count, first = pending
        count.add_(bad)
        # the call of the first unread skip: kept once set, else this call if it skipped
        torch.where(first > 0, first, bad * call, out=first)

    def add(self, first: int, n: int = 1) -> None:
        """Count ``n`` skipped updates, the first at call ``first``; warn at the first skip
        of all."""
        before = self.resolved
        self.resolved += n
        if before == 0 and n > 0:
            warnings.warn(
                f"skipped an EMA update at step {first}: the model's weights hold NaN or Inf "
                f"(skip_nonfinite=True; further skips are counted in num_skipped_nonfinite)",
                RuntimeWarning,
                stacklevel=5,
            )

    def resolve(self) -> int:
        """Read the device counter back (a host sync, only when the count is asked for);
        the total."""
        pending = self._device
        if pending is not None:
            n, at = torch.stack(pending).tolist()  # one read
            if n:
                pending[0].zero_()
                pending[1].zero_()
                self.add(at, n)
        return self.resolved

    def set(self, value: int) -> None:
        """Set the total (a loaded state); drops what the device counted."""
        self.resolved = int(value)
        self._device = None


class _Guardable(Protocol):
    """What `FiniteGuard` needs of a plan."""

    pairs: list[TensorPair]
    shared: list[TensorPair]

    def online_tensors(self) -> list[Tensor]: ...


class FiniteGuard:
    """The guard of one tracker: the flag for its plan, and the skip count."""

    def __init__(self) -> None:
        self.skips = SkipCount()
        self._plan: Any = None  # the plan the sources and agreement below are for
        self._sources: list[Tensor] = []
        self._agreement: Agreement | None = None

    @torch.no_grad()
    def flag(self, plan: _Guardable, call: int) -> Tensor | None:
        """Whether every floating online tensor of ``plan`` is free of NaN and Inf, on every
        rank that holds a shard of them: a 0-dim bool tensor that stays on the device, or
        None when nothing anywhere could be non-finite.

        One reduction to the tensors' extremes per device and dtype, and for sharded
        (DTensor) models under ``torch.distributed`` one all-reduce of three numbers with
        the other ranks (which must be at the same ``call``; a mismatch makes the flag
        false). No host sync.
        """
        if self._plan is not plan:
            self._plan = plan
            self._sources = plan.online_tensors()
            # Shared pairs too: whether a rank shares a frozen shard (a load or unfreezing
            # decides per rank) must not change whether it joins the all-reduce.
            self._agreement = Agreement.build([*plan.pairs, *plan.shared])
        flag = local_flag(self._sources)
        if self._agreement is not None:
            return self._agreement.combine(flag, call)
        return flag

    def guard(self, plan: _Guardable, action: Action, call: int) -> Action:
        """``action`` guarded by "``plan``'s online weights are finite on every rank" (a
        flag on the device, counted as a skip where false), or `SKIP`
        for a first call on non-finite weights (read on the host: the one call that does,
        so that it leaves the EMA uninitialized)."""
        ok = self.flag(plan, call)
        if ok is None:
            return action
        if action.kind == "init":
            if not bool(ok):
                self.skips.add(call)
                return SKIP
            return action
        self.skips.add_flag(ok, call)
        return dataclasses.replace(action, guard=ok)

    def __getstate__(self) -> dict[str, Any]:
        self.skips.resolve()
        skips = SkipCount()
        skips.resolved = self.skips.resolved
        return {"skips": skips, "_plan": None, "_sources": [], "_agreement": None}
