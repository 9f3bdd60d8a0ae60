"""The non-finite guard (``skip_nonfinite=True``), in one place: the flag, the select
kernels, the guarded path and the skip count; no host sync.

An update is skipped when any online weight holds NaN or Inf. The decision is a 0-dim
bool tensor that never leaves the device, and the work is a handful of kernels over
flat buffers, whatever the number of tensors:

1. `Guarded`: the pairs of one transfer, prepared once, in batches of at most
   `GUARD_CHUNK` elements. Each update *gathers* the sources into row 0 of a scratch
   laid out like the destinations (one ``torch.cat`` of flat views, casting to the
   destination's dtype; a foreach copy where a source is not contiguous or lives on
   another device), takes its extremes (``torch.aminmax``: NaN and Inf propagate, finite
   values cannot overflow), keeps the old values in row 1, averages into row 0
   (``torch.lerp(old, row0, w, out=row0)``) and picks row 0 or row 1 back into the
   shadow (``torch.index_select`` on the flag: a copy either way, every bit). That is one
   kernel each per run of the shadow, which emakit lays out as one run per device and
   dtype; destinations scattered in memory (FSDP2 shards) are gathered into row 1 and
   scattered back by foreach copies. `GuardedPath` does this for a plan's groups; its
   `GuardedPath.flag()` gathers every transfer first and leaves the values in the
   scratch, so the update that follows for that very flag reads them from there.
2. `Agreement`: for sharded (DTensor) models under ``torch.distributed``, each rank
   sees only its shards, so the flags are combined by **one all-reduce of three int64
   numbers** per update, ``max(bad, call, -call)``, on the process group the shards live
   on (the default group when their meshes cover every rank). Every rank then takes the
   same decision. The call number rides along: if the ranks' calls do not match (one rank
   called ``update()`` more often), the update is skipped everywhere rather than averaged
   from a mismatched flag, and [`emakit.distributed()`][emakit.distributed] saves report the disagreement.
   DDP and single processes need no agreement: every rank holds the same weights.
3. `FiniteGuard`, one per tracker: builds the flag for a plan (caching its
   agreement), guards an action with it, and counts skips on the device (`SkipCount`,
   read back, with the warning about the first skip, only when someone asks for the count).

The weights are checked as the shadow receives them (cast to its dtype): a weight beyond
the range of a narrower shadow dtype counts as Inf, since averaging it in would make the
shadow Inf. A plan run by a background runner reads its weights on the worker, from a
snapshot; its flag is taken on the caller's thread straight from the online tensors
(`_local_flag()`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._dist.collectives import collective_device, dist_ready
from .._dist.deepspeed import is_partition
from .._dist.dtensor import is_dtensor
from ..decay import SKIP, Action
from .flat import ALIGN, aligned_offsets, memory_order, span, split_runs
from .pairs import TensorPair
from .paths import Group, no_autograd, stage

#: Elements per batch of a guarded update: the scratch a `Guarded` holds is two rows (three
#: for destinations scattered in memory) of at most this many elements per device and
#: dtype (16 MiB in float32). A transfer larger than one batch that must be gathered is
#: gathered again for its update, batch by batch.
GUARD_CHUNK = 1 << 21


def _all_finite(extremes: Sequence[Tensor]) -> Tensor | None:
    """Whether every one of ``extremes`` is finite: a 0-dim bool tensor on the first one's
    device (None when there are none). No host sync."""
    flag: Tensor | None = None
    for device in dict.fromkeys(e.device for e in extremes):
        f = torch.stack([e for e in extremes if e.device == device]).isfinite().all()
        flag = f if flag is None else flag & f.to(flag.device, non_blocking=True)
    return flag


def _floating(t: Tensor) -> Tensor | None:
    """``t`` as real floating values (complex viewed as pairs), or None when it cannot be
    non-finite (integer, bool or empty)."""
    if not t.numel() or not (t.is_floating_point() or t.is_complex()):
        return None
    return torch.view_as_real(t) if t.is_complex() else t


def _local_flag(tensors: Sequence[Tensor]) -> Tensor | None:
    """Whether ``tensors`` are free of NaN and Inf (see `_all_finite()`), from each one's
    extremes: exact, nothing is summed. On an accelerator one ``torch._foreach_norm(...,
    inf)`` per device and dtype; on the CPU, where that norm is not vectorized (about 15x
    slower), one ``torch.aminmax`` per tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for f in [f for f in map(_floating, tensors) if f is not None]:
        groups.setdefault((f.device, f.dtype), []).append(f)
    extremes: list[Tensor] = []
    for (device, _), ts in groups.items():
        if device.type == "cpu":
            extremes += [v for t in ts for v in torch.aminmax(t)]
        else:
            extremes += torch._foreach_norm(ts, float("inf"))
    return _all_finite(extremes)


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
        if s.shape != d.shape:  # as a copy would say (a cat would resize instead)
            raise RuntimeError(f"shape {tuple(s.shape)} does not match {tuple(d.shape)}")
        if n <= GUARD_CHUNK or not (d.is_contiguous() and s.is_contiguous()):
            out += [(d, s)] if n else []
            continue
        fd, fs = d.detach().view(-1), s.detach().view(-1)
        out += [
            (fd[i : i + GUARD_CHUNK], fs[i : i + GUARD_CHUNK]) for i in range(0, n, GUARD_CHUNK)
        ]
    return out


class _Batch:
    """Pairs of one destination device and dtype, at most about `GUARD_CHUNK` elements,
    and their place in the scratch: laid out like the destinations when these are one run
    in memory (then averaged and selected in place, alignment padding included), else one
    after the other (gathered and scattered back by foreach copies)."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self.dsts = [d for d, _ in pairs]
        self.srcs = [s for _, s in pairs]
        first = self.dsts[0]
        self.key = (first.device, first.dtype)
        self.run = first.is_contiguous() and len(split_runs([self.dsts])) == 1
        sizes = [d.numel() for d in self.dsts]
        base = int(first.storage_offset())
        at = [int(d.storage_offset()) - base for d in self.dsts]
        self.at = at if self.run else aligned_offsets(sizes)
        self.numel = self.at[-1] + sizes[-1]
        self.alone = True  # the only batch of its scratch (see Guarded)

    def place(self, rows: Tensor) -> None:
        """Take the first ``numel`` columns of the scratch: row 0 gathers the sources, then
        holds the new values; row 1 the old ones; row 2 (scattered destinations only) the
        picked ones, copied back."""
        self.rows = rows[:, : self.numel]
        self.views = [
            [
                row[at : at + d.numel()].view(d.shape)
                for d, at in zip(self.dsts, self.at, strict=True)
            ]
            for row in self.rows
        ]
        self.out = span(self.dsts).view(1, -1) if self.run else self.rows[2:]
        # The sources as the batch reads them: one span of the destinations' dtype, read in
        # place (no gather: a large tensor, a flat model); else row 0, filled by one cat of
        # flat views (about half the cost of a foreach copy of many small tensors), zeros
        # between, where every source is contiguous and on the scratch's device.
        src = self.srcs[0]
        self.source, self.direct = self.rows[0], False
        self.cat: list[Tensor] | None = None
        if all(
            s.is_contiguous() and (s.device, s.dtype) == (rows.device, src.dtype) for s in self.srcs
        ):
            if self.run and src.dtype == rows.dtype and len(split_runs([self.srcs], self.at)) == 1:
                self.source, self.direct = span(self.srcs).view(-1), True
                return
            gap, self.cat, end = torch.zeros(ALIGN, dtype=src.dtype, device=src.device), [], 0
            for s, at in zip(self.srcs, self.at, strict=True):
                self.cat += (
                    [gap[: at - end], s.detach().view(-1)] if at > end else [s.detach().view(-1)]
                )
                end = at + s.numel()

    def gather(self) -> None:
        """The sources into row 0 (cast to the destination's dtype and device), zeros in
        between (it is read whole: extremes, spans); nothing when they are read in place."""
        if self.cat is not None:
            torch.cat(self.cat, out=self.rows[0])
            return
        if self.direct:
            return
        if not self.alone:  # the scratch holds another batch's values
            self.rows[0].zero_()
        torch._foreach_copy_(self.views[0], self.srcs)

    def select(self, pick: Tensor, weight: float | None) -> None:
        """``dst = lerp(dst, source, weight)`` (``source`` without a ``weight``), or ``dst``,
        every bit, as ``pick`` (a 1-element index) says: row 0 or row 1, a copy either way."""
        new, old = self.rows[0], self.rows[1]
        if self.run:
            old.copy_(self.out[0])
        else:
            torch._foreach_copy_(self.views[1], self.dsts)
        if weight is not None:
            torch.lerp(old, self.source, weight, out=new)
        elif self.direct:
            new.copy_(self.source)
        torch.index_select(self.rows[:2], 0, pick, out=self.out)
        if not self.run:
            torch._foreach_copy_(self.dsts, self.views[2])


class Guarded:
    """Pairs of tensors prepared for updates that happen only where a device-side flag
    says so (``skip_nonfinite=True``); build once, call `update()` often.

    .. math:: s \\leftarrow \\text{where}(ok,\\ \\text{lerp}(s, o, w),\\ s)

    A select, not ``lerp_`` with the weight multiplied by ``ok``: ``s + 0 * (o - s)`` is NaN
    where ``o`` is NaN or Inf. With ``ok`` true the result is bit for bit
    ``shadow.lerp_(online, weight)``; with ``ok`` false every shadow keeps every bit
    (``-0.0`` included). See the module docstring for the kernels; the scratch, held for
    the object's life, is two rows (three for destinations scattered in memory) of at
    most `GUARD_CHUNK` elements per device and dtype (16 MiB in float32), less for
    smaller models. The views of the sources it reads are made again when a source's
    storage moved (``param.data = ...``).

    Args:
        dsts: tensors updated in place (the shadow).
        srcs: tensors read, paired by position (cast/moved to the destination's dtype and
            device where they differ).
    """

    def __init__(self, dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
        self.dsts, self.srcs = list(dsts), list(srcs)
        self.ptrs: list[int] = []
        self.batches: list[_Batch] = []

    def _build(self) -> None:
        """The batches, if not built yet for the sources' storages (see the class docs)."""
        ptrs = list(map(Tensor.data_ptr, self.srcs))
        if ptrs == self.ptrs and self.batches:
            return
        # In memory order (the pairs are independent): neighbours in a shadow's storage
        # end up in one batch, updated by one kernel whatever order the model lists them.
        batches: list[list[tuple[Tensor, Tensor]]] = []
        size, key = GUARD_CHUNK, None
        for d, s in sorted(_pieces(self.dsts, self.srcs), key=lambda pair: memory_order(pair[0])):
            if size + d.numel() > GUARD_CHUNK or (d.device, d.dtype) != key:
                batches.append([])
                size, key = 0, (d.device, d.dtype)
            batches[-1].append((d, s))
            size += d.numel()
        self.batches = [_Batch(b) for b in batches]
        shape: dict[tuple[torch.device, torch.dtype], tuple[int, int]] = {}
        for b in self.batches:
            rows, n = shape.get(b.key, (2, 0))
            shape[b.key] = (rows if b.run else 3, max(n, b.numel))
        # zeros: the gaps between tensors are selected into the shadow's (zero) padding
        bufs = {k: torch.zeros(rows_n, dtype=k[1], device=k[0]) for k, rows_n in shape.items()}
        shared = Counter(b.key for b in self.batches)
        for b in self.batches:
            b.alone = shared[b.key] == 1
            b.place(bufs[b.key])
        self.ptrs = ptrs

    def gather(self) -> list[Tensor]:
        """Gather every batch; the extremes of the floating values (a batch that is alone
        in its scratch keeps its values there for the next `update()`)."""
        self._build()
        extremes: list[Tensor] = []
        for b in self.batches:
            b.gather()
            values = _floating(b.source)
            if values is not None:
                extremes += torch.aminmax(values)
        return extremes

    def update(self, ok: Tensor, weight: float | None = None, *, gathered: bool = False) -> None:
        """``dst.lerp_(src, weight)`` (``dst.copy_(src)`` without a ``weight``) where the
        0-dim bool ``ok`` is true, else nothing (``gathered``: `gather()` just ran for
        these values)."""
        if not gathered:
            self._build()
        picks: dict[torch.device, Tensor] = {}
        for b in self.batches:
            if not (gathered and b.alone):
                b.gather()
            device = b.key[0]
            if device not in picks:  # the row ok picks, on this device: no host sync
                picks[device] = ok.to(device, non_blocking=True).logical_not().long().view(1)
            b.select(picks[device], weight)


# -- around a plan ---------------------------------------------------------------------------


class GuardedPath:
    """A plan's groups updated only where a device-side flag says so: the same transfers as
    the plan's path, through `Guarded` kernels.

    Args:
        groups: the plan's groups.
        background: the plan is run by a background runner: its updates read the staging
            buffers the runner fills, and its flag is taken on the caller's thread from the
            online tensors, leaving the worker's scratch alone.
    """

    def __init__(self, groups: Sequence[Group], *, background: bool = False) -> None:
        self.groups = groups
        self.background = background
        self.kernels = [
            (Guarded(g.lerp.dst, g.lerp.src), Guarded(g.copy.dst, g.copy.src)) for g in groups
        ]
        #: The flag the scratch was last gathered for (see `flag()`).
        self.ready: Tensor | None = None

    def flag(self, agreement: Agreement | None = None, call: int = 0) -> Tensor | None:
        """Whether the online weights are finite (on every rank, with an ``agreement``):
        a 0-dim bool tensor, or None when nothing could be non-finite. Stages and gathers
        the values; the next update with this very flag reads them from the scratch."""
        gathered = not self.background
        with no_autograd(True):
            try:
                if gathered:
                    stage(self.groups)
                    local = _all_finite([e for ks in self.kernels for k in ks for e in k.gather()])
            except RuntimeError:  # e.g. a .data of another shape: the update names it
                gathered = False
            if not gathered:
                # the online tensors (or spans) the transfers read, staged or not
                online = [x.stage_src or x.src for g in self.groups for x in (g.lerp, g.copy)]
                local = _local_flag([t for ts in online for t in ts])
        ok = local if agreement is None else agreement.combine(local, call)
        self.ready = ok if gathered else None
        return ok

    def run(self, action: Action, *, staged: bool = False, averaged: bool = True) -> None:
        """The path's ``lerp`` or ``copy`` where ``action.guard`` holds, else nothing
        (``staged``: the runner has just filled the staging buffers; ``averaged=False``:
        only the pairs that are never averaged)."""
        ok = action.guard
        gathered = ok is self.ready
        if not (gathered or staged):
            stage(self.groups, lerp=averaged)
        for g, (lerp, copy) in zip(self.groups, self.kernels, strict=True):
            copy.update(ok, gathered=gathered)
            if averaged:
                weight = action.weights[g.decay_group] if action.kind == "lerp" else None
                lerp.update(ok, weight, gathered=gathered)


class SkipCount:
    """Updates skipped for non-finite weights: resolved on the host, plus a device counter
    (and the call of its first skip) that is read back only when the count is asked for."""

    def __init__(self) -> None:
        self.resolved = 0
        self._device: Tensor | None = None  # [count, call of the first]

    def add_flag(self, ok: Tensor, call: int) -> None:
        """Count a skip on the device where the 0-dim bool ``ok`` is false (no host read)."""
        if self._device is None or self._device.device != ok.device:
            self.resolve()
            self._device = torch.zeros(2, dtype=torch.long, device=ok.device)
        count, first = self._device
        bad = ok.logical_not()
        count.add_(bad)
        # the call of the first unread skip: kept once set, else this call if it skipped
        torch.where(first > 0, first, bad * call, out=first)

    def add(self, first: int, n: int = 1) -> None:
        """Count ``n`` skipped updates, the first at call ``first``; warn at the first skip
        of all."""
        if self.resolved == 0 and n > 0:
            warnings.warn(
                f"skipped an EMA update at step {first}: the model's weights hold NaN or Inf "
                f"(skip_nonfinite=True; further skips are counted in num_skipped_nonfinite)",
                RuntimeWarning,
                stacklevel=5,
            )
        self.resolved += n

    def resolve(self) -> int:
        """Read the device counter back (a host sync, only when the count is asked for);
        the total."""
        if self._device is not None:
            n, at = self._device.tolist()  # one read
            if n:
                self._device.zero_()
                self.add(at, n)
        return self.resolved

    def set(self, value: int) -> None:
        """Set the total (a loaded state); drops what the device counted."""
        self.resolved = int(value)
        self._device = None

    def __getstate__(self) -> dict[str, Any]:
        return {"resolved": self.resolve(), "_device": None}


class FiniteGuard:
    """The guard of one tracker: the flag for its plan, and the skip count."""

    def __init__(self) -> None:
        self.skips = SkipCount()
        self._plan: Any = None  # the plan the agreement below is for
        self._agreement: Agreement | None = None

    def guard(self, plan: Any, action: Action, call: int) -> Action:
        """``action`` guarded by "``plan``'s online weights are finite on every rank", or
        `SKIP` for a first call on non-finite weights (read on the host: the one call that
        does, so that it leaves the EMA uninitialized).

        The flag is a 0-dim bool tensor that stays on the device, computed by the plan's
        `GuardedPath` (see `GuardedPath.flag()`; ``plan`` is a
        [`Plan`][emakit._engine.plan.Plan]) and, for sharded (DTensor) models under
        ``torch.distributed``, combined by one all-reduce of three numbers with the other
        ranks (which must be at the same ``call``; a mismatch makes the flag false). Where
        it is false, the skip is counted on the device. No host sync.
        """
        if self._plan is not plan:
            self._plan = plan
            # Shared pairs too: whether a rank shares a frozen shard (a load or unfreezing
            # decides per rank) must not change whether it joins the all-reduce.
            self._agreement = Agreement.build([*plan.pairs, *plan.shared])
        ok = plan.guarded().flag(self._agreement, call)
        if ok is None:  # nothing anywhere could be non-finite
            return action
        if action.kind == "init":
            if not bool(ok):
                self.skips.add(call)
                return SKIP
            return action
        self.skips.add_flag(ok, call)
        return dataclasses.replace(action, guard=ok)

    def __getstate__(self) -> dict[str, Any]:
        return {"skips": self.skips, "_plan": None, "_agreement": None}
