"""The update plan: which tensors move, grouped once, consumed on every update.

Building a plan walks the paired tensors once and sorts them into groups keyed by
``(decay group, shadow device, shadow dtype, online device, online dtype)``
(`build_groups()`), and picks the one
`Path` that updates them: the reference loop, foreach, or
foreach over *spans* for ``"flat"`` (maximal runs of pairs that sit next to each other in
memory on both sides, each viewed as one 1-D tensor, so a fully flattened model is updated
with one ``lerp_`` per group). When the online tensors have another dtype or device than
the shadow, flat groups first copy them into a reusable staging buffer laid out like the
shadow (no allocation per update).

An update is then: stage (only where a group has staging buffers), then the path; with a
guard (``skip_nonfinite``), the same groups through
`GuardedPath`. A background runner calls the two halves
itself ([`Plan.stage()`][emakit._engine.plan.Plan.stage] now, [`Plan.finish()`][emakit._engine.plan.Plan.finish] later).

The plan holds the tensor objects themselves, as ``torch.optim`` optimizers do: in-place
changes (optimizer steps, ``load_state_dict``, ``.data`` swaps of a Parameter) are seen.
Spans that are views made at build time are guarded by a pointer check, and the plan
rebuilds itself when the storage under them moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .._dist.dtensor import is_dtensor
from ..decay import COPY, Action
from .finite import GuardedPath
from .guards import Guards
from .pairs import TensorPair, Tracked
from .paths import FOREACH, LOOP, Group, Pointers, build_groups, no_autograd, stage

_MOVES = frozenset(("lerp", "init", "copy"))

#: How a plan updates: the kernels' ``"loop"``, ``"foreach"`` or ``"flat"``
#: (`emakit._engine.kernels.IMPLS`), or ``"compiled"``: per tensor, each group's averaged
#: pairs through one compiled function (`emakit._engine.compiled`).
Engine = Literal["loop", "foreach", "flat", "compiled"]


class Plan:
    """Pre-grouped tensor lists for every transfer an EMA performs.

    Args:
        tracked: the tracked tensors (a `Tracked` value, or
            plain pairs), in the order the shadow is laid out.
        impl: ``"loop"``, ``"foreach"``, ``"flat"`` or ``"compiled"`` (see `Engine`).
        staged: route every online tensor through a staging buffer (background runners).

    The online -> shadow groups are built at once; shadow -> online (used by
    ``copy_params_from_ema_to_model`` and ``update_model_with_ema``) on first use.
    """

    def __init__(
        self, tracked: Tracked | Sequence[TensorPair], impl: Engine, *, staged: bool = False
    ) -> None:
        tracked = Tracked.of(tracked)
        self.pairs = list(tracked.pairs)
        self.shared = list(tracked.shared)  # no work; counted by the ranks' agreement
        # A shared weight whose online storage is replaced (``.data = ...``, ``.to()``) stops
        # sharing: the plan is then stale and the next one averages it (DTensor shards are
        # watched by identity in the guards).
        watched = [p.online for p in self.shared if not is_dtensor(p.online)]
        self.shared_pointers = Pointers(watched, [t.data_ptr() for t in watched])
        self.shared_pointers.seal()
        self.impl: Engine = "flat" if staged else impl
        self.staged = staged
        self.guards = Guards(
            [w for p in self.pairs for w in ((p.online_slot, p.online), (p.shadow_slot, p.shadow))],
            [p.online for p in self.shared if is_dtensor(p.online)],
            tracked.roots,
            tracked.changes,
            tracked.frozen if self.shared else None,
        )
        self.groups: list[Group] = build_groups(
            self.pairs,
            to_shadow=True,
            flat=self.impl == "flat",
            staged=staged,
            compiled=self.impl == "compiled",
        )
        self.path = LOOP if self.impl == "loop" else FOREACH  # chosen once
        self._staging = any(t.stage_dst for g in self.groups for t in (g.lerp, g.copy))
        self._guarded: GuardedPath | None = None
        self._online_groups: list[Group] | None = None
        #: Whether the online tensors live on a CUDA device (snapshots are non-blocking).
        self.on_accelerator = bool(self.pairs) and self.pairs[0].online.is_cuda
        #: Kernels (spans or tensors) one averaging update touches, summed over groups.
        self.num_kernels = sum(
            1 + len(g.copy.dst)
            if g.lerp.fused is not None
            else sum(len(r[2]) for r in g.lerp.rounds) or len(g.lerp.dst) + len(g.copy.dst)
            for g in self.groups
        )
        #: One more than the highest decay group index among the pairs.
        self.num_decay_groups = 1 + max((p.group for p in self.pairs), default=0)

    # -- staleness --------------------------------------------------------------------------

    def freshness(self) -> str:
        """``"stale"`` when the model changed under the plan (a tracked tensor was replaced,
        a group's dtype or device changed, a span's tensor was re-pointed: build a new
        plan); ``"check"`` when a tensor may have been added, deleted or replaced somewhere
        (the owner compares the live pairs with `pairs`, see [`same_pairs()`][emakit._engine.plan.Plan.same_pairs]); else
        ``"fresh"``. See `emakit._engine.guards`."""
        for g in self.groups:
            if g.stale():
                return "stale"
        shared = self.shared_pointers
        if shared.tensors and shared.moved():
            return "stale"
        return self.guards.check()

    def same_pairs(self, tracked: Tracked | Sequence[TensorPair]) -> bool:
        """Whether ``tracked``'s pairs are the plan's own: same names, tensors and roles. If
        so, the plan is fresh again until the next registration on the tracked modules."""
        same = _identity(Tracked.of(tracked).pairs) == _identity(self.pairs)
        if same:
            self.guards.accept()
        return same

    # -- updates ----------------------------------------------------------------------------

    def guarded(self) -> GuardedPath:
        """The plan's groups behind the non-finite guard (built on first use)."""
        if self._guarded is None:
            self._guarded = GuardedPath(self.groups, background=self.staged)
        return self._guarded

    def run(self, action: Action, *, staged: bool = False, averaged: bool = True) -> None:
        """Carry out ``action`` now: copy (``"init"``/``"copy"``), average (``"lerp"``), or
        nothing (``"hold"``, ``"skip"``); with ``staged``, from the snapshot the staging
        buffers hold (see [`stage()`][emakit._engine.plan.Plan.stage]); with
        ``averaged=False`` only the pairs that are never averaged (integer buffers, no-EMA
        names) are copied.

        An ``action.guard`` (a 0-dim bool tensor, see `emakit._engine.finite`) makes the
        update conditional on the device: where it is false nothing changes, where it is
        true the result is bit for bit the unguarded one."""
        if action.kind not in _MOVES:
            return
        with no_autograd(True):
            if action.guard is not None:
                self.guarded().run(action, staged=staged, averaged=averaged)
                return
            if self._staging and not staged:
                stage(self.groups, lerp=averaged)
            if action.kind == "lerp" and averaged:
                self.path.lerp(self.groups, action.weights)
            else:
                self.path.copy(self.groups, averaged=averaged)

    def stage(self, *, non_blocking: bool = False, guard: Tensor | None = None) -> None:
        """Snapshot the online tensors into the staging buffers (staged plans only; the
        snapshot is scratch, so ``guard`` changes nothing here)."""
        with no_autograd(True):
            stage(self.groups, non_blocking=non_blocking)

    def finish(self, action: Action) -> None:
        """Carry out ``action`` from the staged snapshot (see [`stage()`][emakit._engine.plan.Plan.stage])."""
        self.run(action, staged=True)

    def lerp_shadow(self, weights: Sequence[float]) -> None:
        """``shadow.lerp_(online, weights[group])`` for averaged pairs; copy the others."""
        self.run(Action("lerp", tuple(weights)))

    def copy_to_shadow(self) -> None:
        """Copy every tracked online tensor into its shadow."""
        self.run(COPY)

    def copy_unaveraged(self, guard: Tensor | None = None) -> None:
        """Copy only the pairs that are never averaged, where ``guard`` holds if given."""
        self.run(Action("copy", guard=guard), averaged=False)

    def _to_online(self) -> list[Group]:
        if self._online_groups is None:
            # Reverse transfers are rare (helpers, hare-and-tortoise); per-tensor foreach
            # suffices and needs no staging memory.
            self._online_groups = build_groups(self.pairs, to_shadow=False, flat=False)
        return self._online_groups

    @torch.no_grad()
    def copy_to_online(self) -> None:
        """Copy every tracked shadow tensor into the online model."""
        self.path.copy(self._to_online())

    @torch.no_grad()
    def lerp_online(self, weight: float) -> None:
        """``online.lerp_(shadow, weight)`` for averaged pairs; copy the others."""
        self.path.lerp(self._to_online(), [weight] * self.num_decay_groups)


def _identity(pairs: Sequence[TensorPair]) -> list[tuple]:
    """What makes two lists of pairs the same: names, tensors (the objects) and roles."""
    return [(p.name, id(p.online), id(p.shadow), p.average, p.group) for p in pairs]


#: Alias of [`Plan`][emakit._engine.plan.Plan], kept for the callers that build plans
#: through it (``staged=True`` routes every online tensor through a reusable staging
#: buffer, pinned when it comes from an accelerator, so an update can be split into a
#: quick snapshot, `Plan.stage()`, and the arithmetic, `Plan.finish()`).
build_plan = Plan
