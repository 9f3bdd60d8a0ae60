"""The bookkeeping of one EMA, shared by every EMA kind: rule, plan and runner.

A `Tracker` owns the decay rule, the plan, the runner and the swap flag, and holds
the parts it delegates to: the counters (`Counters`: step,
initted, last averaging call and gap, ema-pytorch's tensor views) and the non-finite guard
(`FiniteGuard`: the flag and the skip count). Its
`update()` is the one update path of emakit:

1. `advance()` counts the call and asks the pure
   [`DecayRule`][emakit.decay.DecayRule] what it does (the first call always initializes);
2. `apply()` makes sure the plan still matches the model (asking its
   `PairSource` for the live pairs when a tensor was replaced, added or deleted),
   optionally guards the action with a device-side "weights are finite" flag, and hands it
   to the runner.

**Skipping non-finite updates** (``skip_nonfinite=True``) never reads a value back from the
device in ``update()``: the flag (for sharded models combined across ranks by one small
all-reduce) travels with the action, the kernels select on it, and a skip adds one to a
counter on the device, read (and the first skip warned about) when
`Tracker.num_skipped_nonfinite` is next read. A skipped averaging call still counts
as an averaging call (``last`` moves; the power-function EMA sees a held step). Only the
very first call reads the flag on the host, so that a first call on non-finite weights
leaves the EMA uninitialized.

Facades (``EMA``, ``MultiEMA``, ``KarrasEMA`` ...) only wire a tracker to a model.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from .._engine.finite import FiniteGuard
from .._engine.kernels import Impl
from .._engine.pairs import Tracked
from .._engine.plan import Plan, build_plan
from .._engine.runners import Runner, SyncRunner
from ..decay import INIT, SKIP, Action, DecayRule
from ..errors import EMARuntimeError
from .counters import Counters

__all__ = ["PairSource", "Tracker"]


class PairSource(Protocol):
    """Where a tracker gets the live pairs from: its owner's tensors, paired by name.

    This is the one call a tracker makes up into its owner, and only from
    `Tracker.plan()` when the plan no longer matches the model (first use, or after a
    tensor was replaced, added or deleted).
    """

    def tracked(self) -> Tracked:
        """The pairs as they are now, validated; raises
        [`EMAStateError`][emakit.errors.EMAStateError] naming a tensor that no longer pairs."""
        ...


class Tracker:
    """Decay rule, plan and runner of one EMA, with its counters and non-finite guard (see
    the module docstring).

    Args:
        rule: what each call does.
        source: the owner's live pairs (see `PairSource`).
        impl: the engine path (``"loop"``, ``"foreach"`` or ``"flat"``).
        runner: where updates run. Default: a `SyncRunner`.
        skip_nonfinite: skip updates whose online weights hold NaN or Inf. Default False.
    """

    def __init__(
        self,
        rule: DecayRule,
        source: PairSource,
        *,
        impl: Impl,
        runner: Runner | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.rule = rule
        self.source = source
        self.impl: Impl = impl
        self.runner: Runner = runner if runner is not None else SyncRunner()
        self.skip_nonfinite = skip_nonfinite
        self.counters = Counters()
        self.finite = FiniteGuard()
        self.swapped = False
        self._plan: Plan | None = None

    # -- the counters (see Counters) --------------------------------------------------------

    @property
    def step(self) -> int:
        """``update()`` calls so far."""
        return self.counters.step

    @property
    def initted(self) -> bool:
        """Whether the first call has initialized the EMA."""
        return self.counters.initted

    @property
    def last(self) -> int:
        """The call of the last averaging update."""
        return self.counters.last

    @last.setter
    def last(self, value: int) -> None:
        self.counters.last = value

    @property
    def gap(self) -> int:
        """Calls between the last two averaging updates."""
        return self.counters.gap

    @gap.setter
    def gap(self, value: int) -> None:
        self.counters.gap = value

    def step_tensor(self) -> Tensor:
        """``step`` as ema-pytorch's writable CPU tensor (see `Counters`)."""
        return self.counters.step_tensor()

    def initted_tensor(self) -> Tensor:
        """``initted`` as ema-pytorch's writable CPU tensor (see `Counters`)."""
        return self.counters.initted_tensor()

    def sync_views(self) -> None:
        """Take the values clients wrote into the tensor views."""
        self.counters.sync()

    def set_counters(self, *, step: int | None = None, initted: bool | None = None) -> None:
        """Set ``step`` and/or ``initted``; views already handed out see the new values."""
        self.counters.set(step=step, initted=initted)

    def snapshot(self) -> tuple[int, bool, int, int, int]:
        """``(step, initted, last, gap, num_skipped_nonfinite)``, to restore after a failed
        load."""
        c = self.counters
        c.sync()
        return c.step, c.initted, c.last, c.gap, self.num_skipped_nonfinite

    def restore(self, saved: tuple[int, bool, int, int, int]) -> None:
        """Put back what `snapshot()` returned."""
        step, initted, last, gap, skipped = saved
        self.counters.set(step=step, initted=initted)
        self.counters.last, self.counters.gap = last, gap
        self.num_skipped_nonfinite = skipped

    def reset(self, step: int) -> None:
        """Start over at ``step`` as an initialized EMA whose last averaging update was at
        ``step`` (e.g. an EMA reconstructed from snapshots)."""
        self.runner.wait()
        self.counters.set(step=step, initted=True)
        self.counters.last, self.counters.gap = step, 0
        self._plan = None

    @property
    def num_skipped_nonfinite(self) -> int:
        """Updates skipped because the weights held NaN or Inf (``skip_nonfinite=True``),
        the same on every rank. Reading it reads the device counter back (and gives the
        warning about the first skip)."""
        return self.finite.skips.resolve()

    @num_skipped_nonfinite.setter
    def num_skipped_nonfinite(self, value: int) -> None:
        self.finite.skips.set(value)

    # -- the plan -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The current plan, rebuilt from the source's live pairs if the model changed."""
        plan = self._plan
        freshness = "stale" if plan is None else plan.freshness()
        if freshness == "fresh":
            return plan  # type: ignore[return-value]
        self.runner.wait()
        tracked = self.source.tracked()  # the live tensors; raises when they no longer pair
        if freshness == "check" and plan is not None and plan.same_pairs(tracked):
            return plan
        plan = self._plan = build_plan(tracked, self.impl, staged=self.runner.staged)
        return plan

    def invalidate(self) -> None:
        """Drop the plan (after the owner moved or re-laid out its tensors)."""
        self.runner.wait()
        self._plan = None

    # -- the update -----------------------------------------------------------------------

    def update(self) -> Action:
        """Count one call and carry out what it does; returns the action applied
        (`SKIP` when nothing happened)."""
        counters = self.counters
        if counters.held:
            counters.sync()
            action = self.apply(self.advance())
            if counters.held:
                counters.refresh()  # someone holds them: keep them current
            return action
        action = self.advance()
        if action is SKIP:
            return action
        return self.apply(action)

    def advance(self) -> Action:
        """Count one call and return what it does, touching no tensor."""
        if self.swapped:
            raise EMARuntimeError("update() was called inside swap(); leave the swap() block first")
        c = self.counters
        step = c.step
        c.step = step + 1
        if not c.initted:
            return INIT
        return self.rule.action(step, c.last)

    def apply(self, action: Action) -> Action:
        """Carry out ``action`` (from `advance()`) on the current plan."""
        if action is SKIP:
            return action
        plan = self.plan()
        if self.skip_nonfinite and action.guard is None:
            action = self.guard(plan, action)
            if action is SKIP:
                return action
        if action.kind != "hold":
            try:
                self.runner.submit(plan, action)
            except RuntimeError:
                # e.g. a tensor's .data re-pointed to another shape, which per-tensor
                # paths only meet in the kernel: pairing again names it (EMAStateError)
                self.source.tracked()
                raise
        self.record(action)
        return action

    def record(self, action: Action) -> None:
        """Update the counters after ``action`` was carried out (by `apply()` or by a
        caller that ran it itself, e.g. a fused update of several EMAs)."""
        c = self.counters
        if action.kind == "init":
            c.initted = True
            c.last, c.gap = c.step, 0
        elif action.averages:
            c.last, c.gap = action.call, action.call - c.last

    def catch_up(self) -> None:
        """Average in the current weights now if the last averaging update came before the
        current call, so the averaging profile ends exactly at ``step`` (the post-hoc EMA
        does this before a snapshot)."""
        c = self.counters
        if not c.initted or c.step <= c.last:
            return
        self.runner.wait()
        plan = self.plan()
        if self.rule.frozen:
            action = Action("hold", call=c.step)
        else:
            action = Action("lerp", self.rule.weights(c.step, c.last), c.step)
        if self.skip_nonfinite:
            action = self.guard(plan, action)
        plan.run(action)
        self.record(action)

    def guard(self, plan: Plan, action: Action) -> Action:
        """``action`` guarded by the non-finite flag of ``plan`` at this call (see
        `FiniteGuard.guard <emakit._engine.finite.FiniteGuard.guard>()`)."""
        return self.finite.guard(plan, action, self.counters.step)

    def count_flag(self, ok: Tensor) -> None:
        """Count a skip at this call on the device where the 0-dim bool ``ok`` is false
        (a flag computed for another tracker of the same model)."""
        self.finite.skips.add_flag(ok, self.counters.step)

    def __getstate__(self) -> dict:
        self.runner.wait()
        state = self.__dict__.copy()
        state["_plan"] = None  # rebuilt on first use; it only holds references
        state["swapped"] = False
        return state
