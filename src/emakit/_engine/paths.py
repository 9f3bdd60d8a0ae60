"""The groups a plan updates, and the paths that update them, picked when a plan is built.

As ``torch.optim`` picks ``_single_tensor_adam`` or ``_multi_tensor_adam`` once, a
[`Plan`][emakit._engine.plan.Plan] picks one `Path` when it is built and calls it
on every update, with no branch on the implementation in between:

* ``"loop"`` (`LOOP`): one ``lerp_``/``copy_`` per tensor, the reference (what
  ema-pytorch runs);
* ``"foreach"`` (`FOREACH`): one ``torch._foreach_lerp_``/``_foreach_copy_`` per
  group of tensors;
* ``"flat"``: the same foreach functions over groups built from *spans* (runs of
  memory-adjacent tensors viewed as one tensor, see `emakit._engine.flat`), so a model
  laid out flat is averaged by one ``lerp_`` per group. `pair_spans()` lays pairs out as
  spans, read in place or through a staging buffer: the one layout of the flat groups,
  the fused MultiEMA pass (`emakit._engine.fused`) and BEMA's work (`emakit._engine.bema`).

**Another dtype on the same device** (an fp32 shadow of a bf16 model, ``ema_dtype``): on
every path the averaged pairs are cast through one small buffer that stays in the cache
(`cast_rounds()`): for each window of `CAST_CHUNK_BYTES` the sources are copied (cast)
into it, then the shadow takes ``lerp_`` from it. One pass over memory (read the weights,
read and write the shadow), no buffer the size of the shadow, nothing allocated per update,
and the bits of ``shadow.lerp_(online.to(shadow.dtype), w)``: a cast is exact and
``lerp_`` is elementwise.

Every path takes ``groups`` (`Group`, one per decay group, device and dtype) and the
lerp weight of each decay group: ``lerp(groups, weights)``, ``copy(groups)``. What
happens around a path is not in it: `stage()` copies the online tensors into staging
buffers first (flat groups of another dtype or device, and every group of a background
runner), and the non-finite guard (`GuardedPath`) runs the same groups through select
kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .._dist.dtensor import local_tensor
from .compiled import CompiledLerp
from .flat import ALIGN, aligned, span, split_runs
from .kernels import copy_each, multi_tensor_lerp, single_tensor_lerp
from .pairs import TensorPair

#: The updates of the shadow run in inference mode, the C-level context manager where torch
#: has one (what ``torch.inference_mode`` enters, without its Python wrapper). Below
#: autograd: no grad, and none of autograd's per-tensor bookkeeping, which for an online
#: Parameter (``requires_grad=True``) includes a forward-grad lookup behind a mutex, about
#: a tenth of a 1,200-tensor update on the CPU. Version counters are still bumped for the
#: shadow (a normal tensor), so autograd still sees it written. Scratch made inside (the
#: guard's buffers, casts) are inference tensors, used only inside.
no_autograd = (
    torch._C._InferenceMode
    if hasattr(torch._C._InferenceMode, "__enter__")
    else torch.inference_mode  # pragma: no cover - older torch: a plain guard object
)

#: ``torch._C._storage_Use_Count`` (private, present in the torch versions emakit
#: supports); without it every freshness check compares every pointer.
_use_count = getattr(torch._C, "_storage_Use_Count", None)

#: Bytes of the buffer an averaged pair of another dtype on the same device is cast through
#: (`cast_rounds()`), by device type (others: ``"default"``). Measured on GPT-2 124M's shapes
#: on a 2-core CPU (``benchmarks/bench_mixed_precision.py --speed``, BENCHMARKS.md): 256 KiB
#: windows pay per-call overhead (2.7x the floor), 1-8 MiB cost about the same, 16 MiB
#: spill out of the cache. On an accelerator, large enough that the launches of two
#: kernels per window stay below their run time (``benchmarks/gpu_check.py`` measures it).
CAST_CHUNK_BYTES = {"cpu": 4 << 20, "default": 16 << 20}

#: One window of a cast: ``_foreach_copy_(buffer views, sources)``, then
#: ``_foreach_lerp_(shadow pieces, buffer views, w)``.
Round = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


@dataclass
class Transfer:
    """One list of pairs a kernel moves: ``dst`` from ``src``.

    ``stage_dst``/``stage_src``: the staging copies that must happen first (flat groups
    whose online tensors have another dtype or device, and every group of a staged plan);
    ``src`` then holds views of the staging buffer. ``convert``: some source differs from
    its destination in dtype or device (the per-tensor paths cast on the fly). ``rounds``:
    the averaged pairs of another dtype on the same device, cast window by window through
    one small buffer (see `cast_rounds()`); ``dst``/``src`` then hold the pairs themselves
    (copies cast on the fly). ``fused``: the averaged pairs of one device as one compiled
    function that casts and averages in one pass (``compile_update=True``, see
    `emakit._engine.compiled`).
    """

    dst: list[Tensor] = field(default_factory=list)
    src: list[Tensor] = field(default_factory=list)
    stage_dst: list[Tensor] = field(default_factory=list)
    stage_src: list[Tensor] = field(default_factory=list)
    convert: bool = False
    rounds: list[Round] = field(default_factory=list)
    fused: CompiledLerp | None = None


@dataclass
class Pointers:
    """Pointer guards: of the spans made at build time (see `Group.stale()`), and of the
    online tensors of a plan's shared frozen weights (see `emakit._engine.plan.Plan`)."""

    tensors: list[Tensor] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    # The storages under the tensors when sealed, held (so a handle never dangles), their
    # handles and their use counts then.
    storages: list[Any] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, run: list[int], side: Sequence[Tensor], *, every: bool = True) -> None:
        # A multi-tensor span is a view made now; if the storage of a tensor in it moves
        # later (``model.to()``, ``param.data = ...``), the span is stale. Online spans
        # guard every tensor (a user may re-point any one parameter); the EMA's own spans
        # guard their ends, which catches ``ema_model.to()``. Lone tensors are used live.
        if len(run) > 1:
            for i in run if every else (run[0], run[-1]):
                self.tensors.append(side[i])
                self.ptrs.append(side[i].data_ptr())

    def watch(self, tensors: Sequence[Tensor]) -> None:
        """Guard each of ``tensors``, lone ones too (views of them were made now)."""
        self.tensors += tensors
        self.ptrs += map(Tensor.data_ptr, tensors)

    def seal(self) -> None:
        """Record the use counts of the storages under the guarded spans."""
        if _use_count is not None:
            self.storages = []  # drop the old references before counting
            held = {s._cdata: s for s in (t.untyped_storage() for t in self.tensors)}
            self.storages = list(held.values())
            self.handles = list(held)
            self.counts = list(map(_use_count, self.handles))

    def moved(self) -> bool:
        # Re-pointing a tensor's .data away from a span's storage drops that storage's use
        # count: if no count moved, nothing moved; if one did (a view was made or freed
        # somewhere), compare every pointer, then accept the new counts. (CUDA builds'
        # one-call ``torch._C._tensors_data_ptrs_at_indices_equal`` was measured slower:
        # 7.8-8.3 µs against 5.5-6.3 µs for 76 tensors, its list conversion.)
        counts = self.counts
        if counts and _use_count is not None and list(map(_use_count, self.handles)) == counts:
            return False
        moved = list(map(Tensor.data_ptr, self.tensors)) != self.ptrs
        if not moved:
            self.seal()
        return moved


@dataclass
class Group:
    """The pairs of one decay group, shadow device and dtype, online device and dtype."""

    decay_group: int
    key: tuple
    first: tuple[Tensor, Tensor]  # a (dst, src) pair, to see the group's dtype change
    lerp: Transfer = field(default_factory=Transfer)
    copy: Transfer = field(default_factory=Transfer)
    pointers: Pointers = field(default_factory=Pointers)

    def stale(self) -> bool:
        """Whether the group's tensors changed dtype or device, or a span's storage moved."""
        dst, src = self.first
        if (dst.device, dst.dtype, src.device, src.dtype) != self.key:
            return True
        return bool(self.pointers.tensors) and self.pointers.moved()


def pair_spans(
    dsts: Sequence[Sequence[Tensor]],
    srcs: Sequence[Tensor],
    *,
    staged: bool,
    pointers: Pointers | None = None,
) -> tuple[list[list[Tensor]], list[Tensor], list[Tensor], list[Tensor]]:
    """Pairs ``(dsts[k][i], srcs[i])`` as spans, for one kernel per run of pairs.

    Returns ``(dst, src, stage_dst, stage_src)``. ``dst[k]`` holds the spans of ``dsts[k]``
    over the maximal runs of pairs adjacent and spaced alike in every list (and in
    ``srcs``, read in place, unless ``staged``); ``src`` what each run reads: a span of
    ``srcs``, or (``staged``) its piece of a staging buffer laid out like the spans of
    ``dsts[0]``, zero padding included, which ``torch._foreach_copy_(stage_dst, stage_src)``
    fills before each update. The buffer is made once (nothing is allocated per update),
    pinned when it takes values from an accelerator to the CPU. ``pointers`` guards the
    spans made here: the ends of the destinations' runs, every tensor of the sources'.
    """
    watch = pointers if pointers is not None else Pointers()
    runs = split_runs(dsts if staged else [*dsts, srcs])
    dst = [[span([d[i] for i in run]) for run in runs] for d in dsts]
    for run in runs:
        watch.add(run, dsts[0], every=False)
    if not staged:
        for run in runs:
            watch.add(run, srcs)
        return dst, [span([srcs[i] for i in run]) for run in runs], [], []
    at: list[int] = []  # where each pair sits in the buffer: its runs side by side, aligned
    starts, end = [], 0
    for run in runs:
        starts.append(aligned(end))
        base = int(dsts[0][run[0]].storage_offset())
        at += [starts[-1] + int(dsts[0][i].storage_offset()) - base for i in run]
        end = at[-1] + dsts[0][run[-1]].numel()
    ref, online = dsts[0][0], srcs[0].device
    pin = ref.device.type == "cpu" and online.type != "cpu" and torch.cuda.is_available()
    buffer = torch.zeros(end, dtype=ref.dtype, device=ref.device, pin_memory=pin)
    src = [
        buffer.narrow(0, a, s.numel()).view(s.shape) for a, s in zip(starts, dst[0], strict=True)
    ]
    stage_dst, stage_src = [], []
    for run in split_runs([srcs], at):  # runs of sources that land side by side
        view = buffer.narrow(0, at[run[0]], at[run[-1]] + srcs[run[-1]].numel() - at[run[0]])
        stage_dst.append(view.view(srcs[run[0]].shape) if len(run) == 1 else view)
        stage_src.append(span([srcs[i] for i in run]))
        watch.add(run, srcs)
    return dst, src, stage_dst, stage_src


def _memory(t: Tensor) -> Tensor:
    """A dense tensor's elements as one 1-D view, in the order they sit in memory."""
    t = t.detach()
    if t.is_contiguous():
        return t.view(-1)
    return torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())


def _same_layout(d: Tensor, s: Tensor) -> bool:
    """Whether ``d`` and ``s`` hold their elements in the same order in memory, densely."""
    if d.is_contiguous() and s.is_contiguous():
        return True
    formats = (torch.channels_last, torch.channels_last_3d)
    return d.stride() == s.stride() and any(d.is_contiguous(memory_format=f) for f in formats)


def cast_rounds(
    dsts: Sequence[Tensor], srcs: Sequence[Tensor], *, flat: bool, pointers: Pointers
) -> list[Round]:
    """Pairs ``(dsts[i], srcs[i])`` of one device, the sources of another dtype, cut into
    windows cast through one reused buffer of `CAST_CHUNK_BYTES` (see the module docstring).

    The pairs are laid out one after another in a virtual buffer, as the destinations sit
    in memory (``flat``: runs of adjacent destinations as one span, their alignment padding
    included and staged as zeros, so the padding stays zero; runs smaller than a window
    packed tightly, larger ones aligned), and the virtual buffer is cut
    into windows of the real one's size: a tensor larger than a window is split across
    windows, small ones share a window. A pair whose two sides are laid out differently in
    memory (other strides) takes a window of its own, in its shape; the buffer grows to the
    largest such tensor. ``pointers`` guards every tensor viewed here.
    """
    ref = dsts[0]
    per = CAST_CHUNK_BYTES.get(ref.device.type, CAST_CHUNK_BYTES["default"])
    size = aligned(max(1, per // ref.element_size()))
    pairs = [(i, d, s) for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)) if d.numel()]
    same = [i for i, d, s in pairs if _same_layout(d, s)]
    whole = [i for i, d, s in pairs if not _same_layout(d, s)]
    runs = split_runs([[dsts[i] for i in same]]) if flat else [[k] for k in range(len(same))]
    zeros = torch.zeros(ALIGN, dtype=ref.dtype, device=ref.device)
    lerps: list[tuple[int, Tensor]] = []  # (where in the virtual buffer, shadow 1-D view)
    copies: list[tuple[int, Tensor]] = []  # (where, 1-D source view, or zeros for padding)
    end = 0
    for run in runs:
        idx = [same[k] for k in run]
        one = len(idx) == 1
        shadow = _memory(dsts[idx[0]]) if one else span([dsts[i] for i in idx])
        # small runs packed tightly (many small tensors share a window), large ones aligned
        start = aligned(end) if shadow.numel() >= size else end
        base = int(dsts[idx[0]].storage_offset())
        lerps.append((start, shadow))
        for j, i in enumerate(idx):
            at = start + int(dsts[i].storage_offset()) - base
            if j and at > end:  # alignment padding inside the span: staged as zeros
                copies.append((end, zeros[: at - end]))
            copies.append((at, _memory(srcs[i])))
            end = at + dsts[i].numel()
    largest = max((dsts[i].numel() for i in whole), default=0)
    buffer = torch.zeros(max(min(size, end), largest), dtype=ref.dtype, device=ref.device)
    rounds: list[Round] = [([], [], [], []) for _ in range(-(-end // size))]
    for items, lerp in ((copies, False), (lerps, True)):
        for start, t in items:
            pos, stop = start, start + t.numel()
            while pos < stop:  # cut at the windows' edges
                k = pos // size
                cut = min(stop, (k + 1) * size)
                piece, view = t[pos - start : cut - start], buffer[pos - k * size : cut - k * size]
                cd, cs, ld, ls = rounds[k]
                if lerp:
                    ld.append(piece)
                    ls.append(view)
                else:
                    cd.append(view)
                    cs.append(piece)
                pos = cut
    for i in whole:
        view = buffer[: dsts[i].numel()].view(dsts[i].shape)
        rounds.append(([view], [srcs[i]], [dsts[i]], [view]))
    pointers.watch([*dsts, *srcs])
    return [r for r in rounds if r[2]]


def build_groups(
    pairs: Sequence[TensorPair],
    *,
    to_shadow: bool,
    flat: bool,
    staged: bool = False,
    compiled: bool = False,
) -> list[Group]:
    """The groups of ``pairs`` for one direction (online -> shadow, or back): per tensor,
    or as spans when ``flat`` (always through staging buffers when ``staged``). Averaged
    pairs of another dtype on the same device are cast window by window (`cast_rounds()`)
    on every path, unless ``staged``; with ``compiled``, the averaged pairs of each group
    on one device are one compiled function instead (`CompiledLerp`)."""
    groups: dict[tuple, Group] = {}
    for p in pairs:
        dst, src = (p.shadow, p.online) if to_shadow else (p.online, p.shadow)
        dst, src = local_tensor(dst), local_tensor(src)  # DTensor: this rank's shard
        key = (dst.device, dst.dtype, src.device, src.dtype)
        decay_group = p.group if p.average else 0
        g = groups.get((decay_group, *key))
        if g is None:
            g = groups[(decay_group, *key)] = Group(decay_group, key, (dst, src))
        transfer = g.lerp if p.average else g.copy
        transfer.dst.append(dst)
        transfer.src.append(src)
        transfer.convert = key[:2] != key[2:]
    for g in groups.values():
        dst, src = g.first
        one_device = to_shadow and not staged and dst.device == src.device
        cast = one_device and dst.dtype != src.dtype
        if compiled and one_device and g.lerp.dst:  # flat is False: the copies go per tensor
            g.lerp.fused = CompiledLerp(g.lerp.dst, g.lerp.src)
        elif cast and g.lerp.dst:
            g.lerp.rounds = cast_rounds(g.lerp.dst, g.lerp.src, flat=flat, pointers=g.pointers)
        if flat or staged:
            stages = staged or (dst.dtype, dst.device) != (src.dtype, src.device)
            for t in (g.lerp, g.copy):
                if t.dst and not cast:
                    (t.dst,), t.src, t.stage_dst, t.stage_src = pair_spans(
                        [t.dst], t.src, staged=stages, pointers=g.pointers
                    )
                    t.convert = False  # the spans read sources of their own dtype and device
        g.pointers.seal()
    return list(groups.values())


def stage(groups: Sequence[Group], *, non_blocking: bool = False, lerp: bool = True) -> None:
    """Copy the online tensors into the groups' staging buffers (where they have any); only
    the copied (never averaged) pairs' with ``lerp=False``."""
    for g in groups:
        for t in (g.lerp, g.copy) if lerp else (g.copy,):
            if t.stage_dst:
                torch._foreach_copy_(t.stage_dst, t.stage_src, non_blocking=non_blocking)


# -- the paths -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Path:
    """One implementation: its kernels, and the two updates of a plan's groups over them.

    Attributes:
        name: ``"loop"`` or ``"foreach"``.
        copy_each: copies every pair of two lists (casting where they differ).
        lerp_same: ``dst.lerp_(src, weight)`` for pairs of one dtype and device.
        lerp_cast: the same, casting/moving each source to its destination first.
    """

    name: str
    copy_each: Callable[[list[Tensor], list[Tensor]], Any]
    lerp_same: Callable[[list[Tensor], list[Tensor], float], Any]
    lerp_cast: Callable[[list[Tensor], list[Tensor], float], Any]

    def lerp(self, groups: Sequence[Group], weights: Sequence[float]) -> None:
        """Average the averaged pairs with ``weights[group.decay_group]``; copy the others."""
        for g in groups:
            if g.copy.dst:
                self.copy_each(g.copy.dst, g.copy.src)
            t = g.lerp
            if t.fused is not None:
                t.fused(weights[g.decay_group])
            elif t.rounds:
                for cast_dst, cast_src, dst, src in t.rounds:
                    self.copy_each(cast_dst, cast_src)
                    self.lerp_same(dst, src, weights[g.decay_group])
            elif t.dst:
                lerp = self.lerp_cast if t.convert else self.lerp_same
                lerp(t.dst, t.src, weights[g.decay_group])

    def copy(self, groups: Sequence[Group], *, averaged: bool = True) -> None:
        """Copy every pair (only the never-averaged ones with ``averaged=False``)."""
        for g in groups:
            for t in (g.lerp, g.copy) if averaged else (g.copy,):
                if t.dst:
                    self.copy_each(t.dst, t.src)


#: The reference path: one kernel per tensor.
LOOP = Path("loop", copy_each, single_tensor_lerp, single_tensor_lerp)
#: One multi-tensor kernel per group (of tensors, or of spans for ``"flat"``).
FOREACH = Path("foreach", torch._foreach_copy_, torch._foreach_lerp_, multi_tensor_lerp)
