"""The update plan: which tensors move, grouped once, consumed on every update.

Building a plan walks the paired tensors once and sorts them into groups keyed by
``(shadow device, shadow dtype, online device, online dtype)``. Each group keeps:

* the per-tensor lists used by the ``"loop"`` and ``"foreach"`` implementations;
* for ``"flat"``, *runs*: maximal sequences of pairs that sit next to each other in
  memory on both sides, each run viewed as a single 1-D span, so a fully flattened model
  is updated with one ``lerp_`` per group. When the online tensors have another dtype or
  device than the shadow, they are first copied into a reusable staging buffer laid out
  like the shadow (no allocation per update).

The plan holds the tensor objects themselves, as ``torch.optim`` optimizers do: in-place
changes (optimizer steps, ``load_state_dict``, ``.data`` swaps of a Parameter) are seen.
Spans that are views made at build time are guarded by a pointer check, and the plan
rebuilds itself when the storage under them moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._dist.dtensor import local_tensor
from .finite import Agreement, local_flag
from .guards import Guards
from .kernels import (
    Guarded,
    Impl,
    ema_copy_,
    multi_tensor_lerp,
    single_tensor_lerp,
)
from .pairs import TensorPair
from .spans import aligned_offsets, runs_both, span, split_runs

if TYPE_CHECKING:
    from ..decay import Action

__all__ = ["Plan", "TensorPair", "build_plan"]


@dataclass
class _Flat:
    """The ``"flat"`` form of one list of pairs: spans, staging, and pointer guards."""

    dst: list[Tensor] = field(default_factory=list)
    src: list[Tensor] = field(default_factory=list)
    staging_src: list[Tensor] = field(default_factory=list)  # online runs -> staging views
    staging_dst: list[Tensor] = field(default_factory=list)  # staging views read by dst runs
    guard_tensors: list[Tensor] = field(default_factory=list)
    guard_ptrs: list[int] = field(default_factory=list)
    # (storage handle, reference count) of the storages under the guarded spans
    guard_counts: list[tuple[int, int]] = field(default_factory=list)

    def seal(self) -> None:
        """Record the reference counts of the storages under the guarded spans."""
        if _use_count is None:
            return
        handles = {t.untyped_storage()._cdata for t in self.guard_tensors}
        self.guard_counts = [(h, _use_count(h)) for h in handles]

    def stale(self) -> bool:
        # Fast path: re-pointing a tensor's .data away from a span's storage drops that
        # storage's reference count. If no count moved, nothing moved; if one did (a view
        # was made or freed somewhere), check every pointer, then accept the new counts.
        counts = self.guard_counts
        if counts and _use_count is not None and all(_use_count(h) == n for h, n in counts):
            return False
        # C-level map: about 90 ns a tensor, only for tensors inside multi-tensor spans.
        moved = list(map(Tensor.data_ptr, self.guard_tensors)) != self.guard_ptrs
        if not moved:
            self.seal()
        return moved


#: ``torch._C._set_grad_enabled``: what ``torch.no_grad`` calls, without its object per call.
_set_grad_enabled = torch._C._set_grad_enabled

#: ``torch._C._storage_Use_Count`` (private, present in the torch versions emakit
#: supports); without it every update checks every pointer.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _guard(flat: _Flat, run: list[int], side: Sequence[Tensor], *, every: bool = True) -> None:
    # A multi-tensor span is a view made now; if the storage of a tensor in it moves later
    # (``model.to()``, ``param.data = ...``), the span is stale and the plan rebuilds.
    # Online spans guard every tensor (a user may re-point any one parameter); the EMA's
    # own spans guard their ends, which catches ``ema_model.to()`` (``EMA.to()`` rebuilds
    # anyway). Lone tensors are used live and need no guard.
    if len(run) > 1:
        for i in run if every else (run[0], run[-1]):
            flat.guard_tensors.append(side[i])
            flat.guard_ptrs.append(side[i].data_ptr())


def _flatten(dsts: Sequence[Tensor], srcs: Sequence[Tensor], *, staged: bool = False) -> _Flat:
    flat = _Flat()
    if not dsts:
        return flat
    if not staged and dsts[0].dtype == srcs[0].dtype and dsts[0].device == srcs[0].device:
        for run in runs_both(dsts, srcs):
            flat.dst.append(span([dsts[i] for i in run]))
            flat.src.append(span([srcs[i] for i in run]))
            _guard(flat, run, dsts, every=False)
            _guard(flat, run, srcs)
        return flat
    # Different dtype or device: copy online runs into a staging buffer laid out pair by
    # pair, then update each shadow run from the matching staging slice. The buffer is
    # reused on every update, so nothing is allocated on the hot path.
    # Laid out as emakit lays out the shadow (aligned, zero padding), so runs of both
    # sides map onto it.
    offsets = aligned_offsets([t.numel() for t in dsts])
    # Pinned when the values arrive from an accelerator, so the copy can be non-blocking.
    pin = staged and dsts[0].device.type == "cpu" and srcs[0].device.type != "cpu"
    total = offsets[-1] + dsts[-1].numel()
    staging = torch.zeros(total, dtype=dsts[0].dtype, device=dsts[0].device, pin_memory=pin)

    def staging_view(run: list[int], like: Sequence[Tensor]) -> Tensor:
        n = offsets[run[-1]] + like[run[-1]].numel() - offsets[run[0]]
        view = staging.narrow(0, offsets[run[0]], n)
        return view.view(like[run[0]].shape) if len(run) == 1 else view

    for run in split_runs(srcs, offsets):
        flat.src.append(span([srcs[i] for i in run]))
        flat.staging_src.append(staging_view(run, srcs))
        _guard(flat, run, srcs)
    for run in split_runs(dsts, offsets):
        flat.dst.append(span([dsts[i] for i in run]))
        flat.staging_dst.append(staging_view(run, dsts))
        _guard(flat, run, dsts, every=False)
    return flat


@dataclass
class _Group:
    decay_group: int = 0
    key: tuple = ()
    lerp_dst: list[Tensor] = field(default_factory=list)
    lerp_src: list[Tensor] = field(default_factory=list)
    copy_dst: list[Tensor] = field(default_factory=list)
    copy_src: list[Tensor] = field(default_factory=list)
    flat_lerp: _Flat | None = None
    flat_copy: _Flat | None = None


class _Direction:
    """Groups for one direction of transfer (online -> shadow, or shadow -> online)."""

    def __init__(
        self, pairs: Sequence[TensorPair], *, to_shadow: bool, flat: bool, staged: bool = False
    ) -> None:
        groups: dict[tuple, _Group] = {}
        for p in pairs:
            dst, src = (p.shadow, p.online) if to_shadow else (p.online, p.shadow)
            dst, src = local_tensor(dst), local_tensor(src)  # DTensor: this rank's shard
            key = (p.group if p.average else 0, dst.device, dst.dtype, src.device, src.dtype)
            g = groups.setdefault(key, _Group(decay_group=key[0], key=key[1:]))
            if p.average:
                g.lerp_dst.append(dst)
                g.lerp_src.append(src)
            else:
                g.copy_dst.append(dst)
                g.copy_src.append(src)
        self.groups = list(groups.values())
        self.flat = flat or staged
        self.staged = staged
        self._guarded_lists: dict[tuple[int, int], tuple[Guarded, list, list]] = {}
        if self.flat:
            for g in self.groups:
                g.flat_lerp = _flatten(g.lerp_dst, g.lerp_src, staged=staged)
                g.flat_copy = _flatten(g.copy_dst, g.copy_src, staged=staged)
            for g in self.groups:
                for f in (g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY):
                    f.seal()

    def guarded(self, dsts: list[Tensor], srcs: list[Tensor]) -> Guarded:
        """The :class:`~.kernels.Guarded` form of two of this direction's lists (built on
        first use, with ``skip_nonfinite=True``)."""
        key = (id(dsts), id(srcs))
        entry = self._guarded_lists.get(key)
        if entry is None:  # the lists are kept with it, so their ids stay theirs
            entry = self._guarded_lists[key] = (Guarded(dsts, srcs), dsts, srcs)
        return entry[0]

    def stage(self, *, non_blocking: bool) -> None:
        """First half of a staged transfer: snapshot the sources into the staging buffers."""
        for g in self.groups:
            for f in (g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY):
                if f.staging_src:
                    torch._foreach_copy_(f.staging_src, f.src, non_blocking=non_blocking)

    def finish(self, weights: Sequence[float] | None, ok: Tensor | None = None) -> None:
        """Second half: update the destinations from the staging buffers (``weights`` None
        means copy instead of averaging; ``ok``: see :meth:`Plan.run`)."""
        for g in self.groups:
            fl, fc = g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY
            if ok is not None:
                self.guarded(fc.dst, fc.staging_dst).copy(ok)
                if weights is None:
                    self.guarded(fl.dst, fl.staging_dst).copy(ok)
                else:
                    self.guarded(fl.dst, fl.staging_dst).lerp(weights[g.decay_group], ok)
                continue
            if fc.staging_dst:
                torch._foreach_copy_(fc.dst, fc.staging_dst)
            if fl.staging_dst:
                if weights is None:
                    torch._foreach_copy_(fl.dst, fl.staging_dst)
                else:
                    torch._foreach_lerp_(fl.dst, fl.staging_dst, weights[g.decay_group])

    def stale(self) -> bool:
        """Whether storage moved under the plan: a span's tensor was re-pointed, or a group's
        tensors changed dtype or device (``model.to(...)``); one check per group plus one
        pointer per tensor inside a multi-tensor span."""
        for g in self.groups:
            dsts, srcs = g.lerp_dst or g.copy_dst, g.lerp_src or g.copy_src
            if dsts and (dsts[0].device, dsts[0].dtype, srcs[0].device, srcs[0].dtype) != g.key:
                return True
            for f in (g.flat_lerp, g.flat_copy):
                if f is not None and f.guard_tensors and f.stale():
                    return True
        return False

    def lerp(self, weights: Sequence[float], impl: Impl, ok: Tensor | None = None) -> None:
        for g in self.groups:
            weight = weights[g.decay_group]
            if ok is not None:
                self._guarded_group(g, weight, impl, ok)
            elif impl == "flat":
                fl, fc = g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY
                _run_flat_copy(fc)
                if fl.staging_src:
                    torch._foreach_copy_(fl.staging_src, fl.src)
                    torch._foreach_lerp_(fl.dst, fl.staging_dst, weight)
                elif fl.dst:
                    torch._foreach_lerp_(fl.dst, fl.src, weight)
            elif impl == "foreach":
                if g.copy_dst:
                    torch._foreach_copy_(g.copy_dst, g.copy_src)
                src0 = g.lerp_src[0] if g.lerp_src else None
                if src0 is not None and (src0.device, src0.dtype) == g.key[:2]:
                    # grouped by (device, dtype), and still so: nothing to convert
                    torch._foreach_lerp_(g.lerp_dst, g.lerp_src, weight)
                else:
                    multi_tensor_lerp(g.lerp_dst, g.lerp_src, weight)
            else:
                ema_copy_(g.copy_dst, g.copy_src, impl="loop")
                single_tensor_lerp(g.lerp_dst, g.lerp_src, weight)

    def _guarded_group(self, g: _Group, weight: float | None, impl: Impl, ok: Tensor) -> None:
        """One group's update (``weight`` None: copy) where ``ok`` holds, else nothing; the
        result is bit for bit the unguarded one's (see :class:`~.kernels.Guarded`)."""
        if impl == "flat":
            fl, fc = g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY
            for f in (fl, fc):
                if f.staging_src:  # other dtype or device: through the staging buffer
                    torch._foreach_copy_(f.staging_src, f.src)
            self.guarded(fc.dst, fc.staging_dst or fc.src).copy(ok)
            lerp_dst, lerp_src = fl.dst, fl.staging_dst or fl.src
        else:
            self.guarded(g.copy_dst, g.copy_src).copy(ok)
            lerp_dst, lerp_src = g.lerp_dst, g.lerp_src
        if weight is None:
            self.guarded(lerp_dst, lerp_src).copy(ok)
        else:
            self.guarded(lerp_dst, lerp_src).lerp(weight, ok)

    def copy_only(self, impl: Impl, ok: Tensor | None = None) -> None:
        """Copy the non-averaged pairs (integer buffers, no-EMA names) only."""
        for g in self.groups:
            if ok is not None:
                if impl == "flat":
                    fc = g.flat_copy or _EMPTY
                    if fc.staging_src:
                        torch._foreach_copy_(fc.staging_src, fc.src)
                    self.guarded(fc.dst, fc.staging_dst or fc.src).copy(ok)
                else:
                    self.guarded(g.copy_dst, g.copy_src).copy(ok)
            elif impl == "flat":
                _run_flat_copy(g.flat_copy or _EMPTY)
            elif g.copy_dst:
                ema_copy_(g.copy_dst, g.copy_src, impl=impl)

    def copy(self, impl: Impl, ok: Tensor | None = None) -> None:
        for g in self.groups:
            if ok is not None:
                self._guarded_group(g, None, impl, ok)
            elif impl == "flat":
                _run_flat_copy(g.flat_lerp or _EMPTY)
                _run_flat_copy(g.flat_copy or _EMPTY)
            else:
                ema_copy_(g.lerp_dst + g.copy_dst, g.lerp_src + g.copy_src, impl=impl)


_EMPTY = _Flat()


def _run_flat_copy(f: _Flat) -> None:
    if f.staging_src:
        torch._foreach_copy_(f.staging_src, f.src)
        torch._foreach_copy_(f.dst, f.staging_dst)
    elif f.dst:
        torch._foreach_copy_(f.dst, f.src)


class Plan:
    """Pre-grouped tensor lists for every transfer an EMA performs.

    Args:
        pairs: the tracked tensors, in the order the shadow is laid out.
        impl: ``"loop"``, ``"foreach"`` or ``"flat"``.

    The online -> shadow direction is built at once; shadow -> online (used by
    ``copy_params_from_ema_to_model`` and ``update_model_with_ema``) on first use.
    """

    def __init__(self, pairs: Sequence[TensorPair], impl: Impl, *, staged: bool = False) -> None:
        self.pairs = list(pairs)
        self.impl: Impl = "flat" if staged else impl
        self.staged = staged
        self.guards = Guards(pairs)  # pairs may carry the model's structure (Pairs)
        self._to_shadow = _Direction(
            self.pairs, to_shadow=True, flat=self.impl == "flat", staged=staged
        )
        self._to_online: _Direction | None = None
        self._finite_sources: list[Tensor] | None = None
        self._agreement: Agreement | bool | None = False  # False: not built yet

    @property
    def on_accelerator(self) -> bool:
        """Whether the online tensors live on a CUDA device (snapshots are non-blocking)."""
        return bool(self.pairs) and self.pairs[0].online.is_cuda

    @property
    def num_kernels(self) -> int:
        """Kernels (spans or tensors) one averaging update touches, summed over groups."""
        n = 0
        for g in self._to_shadow.groups:
            if self.impl == "flat":
                n += len((g.flat_lerp or _EMPTY).dst) + len((g.flat_copy or _EMPTY).dst)
            else:
                n += len(g.lerp_dst) + len(g.copy_dst)
        return n

    def _online_direction(self) -> _Direction:
        if self._to_online is None:
            # Reverse transfers are rare (helpers, hare-and-tortoise); per-tensor foreach
            # suffices and needs no staging memory.
            self._to_online = _Direction(self.pairs, to_shadow=False, flat=False)
        return self._to_online

    def freshness(self) -> str:
        """``"stale"`` when the model changed under the plan (a tracked tensor was replaced,
        a group's dtype or device changed, a span's tensor was re-pointed: build a new
        plan); ``"check"`` when a tensor may have been added or replaced somewhere (the
        owner compares the live pairs with :attr:`pairs`, see :meth:`same_pairs`); else
        ``"fresh"``. See :mod:`emakit._engine.guards`."""
        if self._to_shadow.stale():
            return "stale"
        return self.guards.check()

    def stale(self) -> bool:
        """Whether the plan is certainly stale (see :meth:`freshness`)."""
        return self.freshness() == "stale"

    def same_pairs(self, pairs: Sequence[TensorPair]) -> bool:
        """Whether ``pairs`` are the plan's own: same names, tensors and roles. If so, the
        plan stops checking until the next registration anywhere."""
        same = len(pairs) == len(self.pairs) and all(
            a.name == b.name
            and a.online is b.online
            and a.shadow is b.shadow
            and a.average == b.average
            and a.group == b.group
            for a, b in zip(pairs, self.pairs, strict=True)
        )
        if same:
            self.guards.accept()
        return same

    def run(self, action: Action) -> None:
        """Carry out ``action`` now: copy (``"init"``/``"copy"``), average (``"lerp"``), or
        nothing (``"hold"``, ``"skip"``).

        An ``action.guard`` (a 0-dim bool tensor, see :mod:`emakit._engine.finite`) makes the
        update conditional on the device: where it is false nothing changes, where it is
        true the result is bit for bit the unguarded one."""
        kind = action.kind
        # The hot path: switching grad mode directly costs a tenth of the no_grad decorator.
        grad = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            if kind == "lerp":
                self._to_shadow.lerp(action.weights, self.impl, action.guard)
            elif kind in ("init", "copy"):
                self._to_shadow.copy(self.impl, action.guard)
        finally:
            _set_grad_enabled(grad)

    @torch.no_grad()
    def stage(self, *, non_blocking: bool = False, guard: Tensor | None = None) -> None:
        """Snapshot the online tensors into the staging buffers (staged plans only; the
        snapshot is scratch, so ``guard`` changes nothing here)."""
        self._to_shadow.stage(non_blocking=non_blocking)

    @torch.no_grad()
    def finish(self, action: Action) -> None:
        """Carry out ``action`` from the staged snapshot (see :meth:`stage`)."""
        if action.kind == "lerp":
            self._to_shadow.finish(action.weights, action.guard)
        elif action.kind in ("init", "copy"):
            self._to_shadow.finish(None, action.guard)

    @property
    def num_decay_groups(self) -> int:
        """One more than the highest decay group index among the pairs."""
        return 1 + max((p.group for p in self.pairs), default=0)

    @torch.no_grad()
    def lerp_shadow(self, weights: Sequence[float]) -> None:
        """``shadow.lerp_(online, weights[group])`` for averaged pairs; copy the others."""
        self._to_shadow.lerp(weights, self.impl)

    @torch.no_grad()
    def finite_flag(self, call: int) -> Tensor | None:
        """Whether every floating online tensor is free of NaN and Inf, on every rank that
        holds a shard of them: a 0-dim bool tensor that stays on the device, or None when
        nothing anywhere could be non-finite (see :mod:`emakit._engine.finite`).

        One reduction to the tensors' extremes per device and dtype, and for sharded
        (DTensor) models under ``torch.distributed`` one all-reduce of three numbers with
        the other ranks (which must be at the same ``call``; a mismatch makes the flag
        false). No host sync.
        """
        if self._finite_sources is None:
            srcs: list[Tensor] = []
            for g in self._to_shadow.groups:
                if self.impl == "flat":
                    fl, fc = g.flat_lerp or _EMPTY, g.flat_copy or _EMPTY
                    srcs += fl.src + fc.src
                else:
                    srcs += g.lerp_src + g.copy_src
            self._finite_sources = srcs
        if self._agreement is False:
            self._agreement = Agreement.build(self.pairs)
        flag = local_flag(self._finite_sources)
        agreement = self._agreement
        if isinstance(agreement, Agreement):
            return agreement.combine(flag, call)
        return flag

    @torch.no_grad()
    def copy_unaveraged(self, guard: Tensor | None = None) -> None:
        """Copy only the pairs that are never averaged (integer buffers, no-EMA names);
        with a ``guard`` only where it holds (see :meth:`run`)."""
        self._to_shadow.copy_only(self.impl, guard)

    @torch.no_grad()
    def copy_to_shadow(self) -> None:
        """Copy every tracked online tensor into its shadow."""
        self._to_shadow.copy(self.impl)

    @torch.no_grad()
    def copy_to_online(self) -> None:
        """Copy every tracked shadow tensor into the online model."""
        self._online_direction().copy("loop" if self.impl == "loop" else "foreach")

    @torch.no_grad()
    def lerp_online(self, weight: float) -> None:
        """``online.lerp_(shadow, weight)`` for averaged pairs; copy the others."""
        weights = [weight] * self.num_decay_groups
        self._online_direction().lerp(weights, "loop" if self.impl == "loop" else "foreach")


def build_plan(pairs: Sequence[TensorPair], impl: Impl, *, staged: bool = False) -> Plan:
    """Build the :class:`Plan` for ``pairs`` (see the module docstring).

    ``staged=True`` routes every online tensor through a reusable staging buffer (pinned
    when it comes from an accelerator), so an update can be split into a quick snapshot
    (:meth:`Plan.stage`) and the arithmetic (:meth:`Plan.finish`), run later or elsewhere.
    """
    return Plan(pairs, impl, staged=staged)
