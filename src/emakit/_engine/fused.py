"""Several EMAs of one model in one pass: the online tensors are read once for all of them.

`FusedPlan` pairs the plans of N EMAs whose shadows are laid out alike (each one
span per device and dtype, in the same order, which is how emakit lays them out). Each
group of averaged tensors takes one of three forms, picked once:

* the online tensors already form one span of the shadow's dtype: each EMA takes one
  ``lerp_`` from it;
* they are many small tensors: they are gathered once into a staging buffer, then each EMA
  takes one ``lerp_`` from it (the update is launch-bound, not bandwidth-bound);
* they are large: one foreach ``lerp_`` per EMA straight from them (over spans where they
  sit side by side; a gather would only add a pass over memory).

For a background runner (``staged=True``) every group gathers, so `FusedPlan.stage()`
is the snapshot and `FusedPlan.finish()` the N lerps. Tensors that are copied rather
than averaged (integer buffers, no-EMA names) are copied by each EMA's own plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._dist.dtensor import local_tensor
from .finite import Guarded
from .flat import split_runs
from .paths import Pointers, pair_spans
from .plan import Plan

if TYPE_CHECKING:
    from ..decay import Action


#: Mean elements per tensor below which gathering the online tensors once into a staging
#: buffer beats one lerp per tensor per EMA. Measured on CPU with benchmarks/bench_multi.py.
GATHER_BELOW = 1 << 16


class FusedPlan:
    """One averaging pass for the plans of several EMAs of one model.

    Build it with `build()`, which returns None when the shadows are not laid out
    alike (the caller then updates each plan on its own). An action's ``weights`` hold one
    lerp weight per EMA (0 leaves that EMA unchanged).

    Attributes:
        targets: per EMA, the spans its ``lerp_`` moves and what each reads, every group's.
        gathers: per group, the copies that gather its online tensors (none where they are
            read in place).
        firsts: per group, its first online tensor and that tensor's dtype and device.
    """

    def __init__(self, plans: Sequence[Plan], frozen: Sequence[bool]) -> None:
        self.plans = list(plans)
        self.frozen = list(frozen)
        #: Whether the online tensors live on a CUDA device (snapshots are non-blocking).
        self.on_accelerator = self.plans[0].on_accelerator
        self.targets: list[tuple[list[Tensor], list[Tensor]]] = [([], []) for _ in self.plans]
        self.gathers: list[tuple[list[Tensor], list[Tensor]]] = []
        self.firsts: list[tuple[Tensor, tuple]] = []
        self.pointers = Pointers()  # of the spans made here
        self.guarded: list[Guarded] = []  # skip_nonfinite: one per EMA, see finish()

    @classmethod
    def build(
        cls, plans: Sequence[Plan], *, frozen: Sequence[bool] | None = None, staged: bool = False
    ) -> FusedPlan | None:
        """The fused plan of ``plans`` (same model, same pair order), or None.

        ``frozen`` marks EMAs that never change (beta 1): their copied tensors are left
        alone too, as a frozen [`EMA`][emakit.EMA] leaves them.
        """
        fused = cls(plans, frozen or [False] * len(plans))
        first = plans[0].pairs
        # DTensors (FSDP2): this rank's shards, as the plans themselves use them
        shadow = [[local_tensor(p.shadow) for p in plan.pairs] for plan in plans]
        by_key: dict[tuple, list[int]] = {}
        for i, p in enumerate(first):
            if p.average:
                by_key.setdefault((shadow[0][i].device, shadow[0][i].dtype), []).append(i)
        for idx in by_key.values():
            # every EMA laid its shadow out in the same (memory) order; follow it
            idx.sort(key=lambda i: shadow[0][i].storage_offset())
            onlines = [local_tensor(first[i].online) for i in idx]
            shadows = [[s[i] for i in idx] for s in shadow]
            spacing = [int(t.storage_offset()) for t in shadows[0]]  # and all spaced alike
            if any(len(split_runs([s], spacing)) != 1 for s in shadows):
                return None
            # read in place when the online tensors form one span of the shadows' dtype, or
            # are large (a gather would only add a pass over memory); else gathered once
            key, ref = (onlines[0].dtype, onlines[0].device), shadows[0][0]
            one_span = len(split_runs([*shadows, onlines])) == 1
            large = sum(o.numel() for o in onlines) >= GATHER_BELOW * len(onlines)
            gather = staged or key != (ref.dtype, ref.device) or not (one_span or large)
            dst, src, gather_dst, gather_src = pair_spans(
                shadows, onlines, staged=gather, pointers=fused.pointers
            )
            for (dsts, srcs), spans in zip(fused.targets, dst, strict=True):
                dsts += spans
                srcs += src
            fused.gathers.append((gather_dst, gather_src))
            fused.firsts.append((onlines[0], key))
        fused.pointers.seal()
        return fused

    def stale(self) -> bool:
        """Whether a group's online tensors changed dtype or device, or the storage under a
        span moved, since the plan was built."""
        return any((t.dtype, t.device) != key for t, key in self.firsts) or self.pointers.moved()

    def run(self, action: Action) -> None:
        """Average every EMA now (``action.weights``: one weight per EMA; ``action.guard``:
        see [`Plan.run()`][emakit._engine.plan.Plan.run])."""
        self.stage(guard=action.guard)
        self.finish(action)

    @torch.no_grad()
    def stage(self, *, non_blocking: bool = False, guard: Tensor | None = None) -> None:
        """Copy the never-averaged tensors of every EMA (only where ``guard`` holds, when
        given) and gather the averaged ones."""
        for plan, frozen in zip(self.plans, self.frozen, strict=True):
            if not frozen:
                plan.copy_unaveraged(guard)
        for dst, src in self.gathers:
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=non_blocking)

    @torch.no_grad()
    def finish(self, action: Action) -> None:
        """Each EMA's ``lerp_`` from the gathered tensors, with its weight (0: left alone);
        only where ``action.guard`` holds when given (skip_nonfinite, see
        [`Plan.run()`][emakit._engine.plan.Plan.run])."""
        ok = action.guard
        if ok is not None and not self.guarded:
            self.guarded = [Guarded(dst, src) for dst, src in self.targets]
        for i, ((dst, src), w) in enumerate(zip(self.targets, action.weights, strict=True)):
            if w and ok is not None:
                self.guarded[i].update(ok, w)
            elif w and dst:  # (foreach kernels refuse empty lists)
                torch._foreach_lerp_(dst, src, w)
