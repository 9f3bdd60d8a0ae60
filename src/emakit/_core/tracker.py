"""The bookkeeping of one EMA, shared by every EMA kind: counters, rule, plan and runner.

A `Tracker` holds the counters (``step``, ``initted``, ``last``, ``gap``), the pure
[`DecayRule`][emakit.decay.DecayRule], the engine's plan and runner, the swap flag and the
non-finite guard (`FiniteGuard`: the flag and the skip count). An update is two steps,
which every facade (``EMA.update()``, ``MultiEMA.update()``) takes in this order:

1. `advance()` counts the call and asks the rule what it does (the first call always
   initializes); an averaging call moves ``last`` and ``gap`` here, when it is decided;
2. `apply()` makes sure the plan still matches the model (asking its owner for the live
   pairs when a tensor was replaced, added or deleted), optionally guards the action
   with a device-side "weights are finite" flag, and hands it to the runner with the plan
   (or with what ``work(plan)`` builds: BEMA's own work). The first copy sets ``initted``.

**A call that raises counts nothing.** `advance()` asks the rule before it counts (a
schedule that raises or returns NaN leaves every counter as it was), and an `apply()`
that raises before its work is handed on (a model that no longer pairs) puts ``step``,
``last`` and ``gap`` back (`rewind()`): the weights are unchanged, and a retry is the
same call of the schedule.

**Skipping non-finite updates** (``skip_nonfinite=True``) never reads a value back from the
device in ``update()``: the flag (for sharded models combined across ranks by one small
all-reduce) travels with the action, the kernels select on it, and a skip adds one to a
counter on the device, read (and the first skip warned about) when
`Tracker.num_skipped_nonfinite` is next read. A skipped averaging call still counts as an
averaging call (``last`` moves; the power-function EMA sees a held step). Only the very
first call reads the flag on the host, so that a first call on non-finite weights leaves
the EMA uninitialized.

**ema-pytorch's tensor views.** ema-pytorch keeps ``step`` and ``initted`` as tensors that
clients write in place (``ema.step += 1``, ``ema.initted.data.fill_(True)``). The tracker
counts with Python integers (a skipped call costs an integer compare) and hands out tensor
views on request (`tensor_views()`). While a client may hold one, each call reads them back
first, so a write takes effect (also one made through ``.data``, which no version counter
sees, and one made to a view the client dropped right after), and writes the new values
into them. "May hold" is the views' reference count above the one taken when nobody held
them (``sys.getrefcount``): a weak reference would lose a write made to a view dropped
before the next call. Once nobody holds them, calls stop reading them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._engine.finite import FiniteGuard
from .._engine.pairs import Tracked
from .._engine.plan import Engine, Plan, build_plan
from .._engine.runners import Runner
from ..decay import INIT, SKIP, Action, DecayRule
from ..errors import EMARuntimeError

if TYPE_CHECKING:
    from .._engine.runners import Work


def _references(views: tuple[Tensor, Tensor]) -> int:
    """How many references the views have (measured the same way every time, so that a
    count above the one taken at creation means a client holds one)."""
    step, initted = views
    return max(sys.getrefcount(step), sys.getrefcount(initted))


class Tracker:
    """Counters, decay rule, plan and runner of one EMA, with its non-finite guard (see
    the module docstring).

    Args:
        rule: what each call does.
        pairs: the owner's live pairs, paired by name and validated (raising
            [`EMAStateError`][emakit.errors.EMAStateError] naming a tensor that no longer
            pairs). The one call a tracker makes up into its owner, only when the plan no
            longer matches the model (first use, or after a tensor was replaced, added or
            deleted).
        impl: the engine path (``"loop"``, ``"foreach"``, ``"flat"`` or ``"compiled"``).
        runner: where updates run: a `SyncRunner`, `ThreadRunner` or `StreamRunner`.
        skip_nonfinite: skip updates whose online weights hold NaN or Inf. Default False.
    """

    def __init__(
        self,
        rule: DecayRule,
        pairs: Callable[[], Tracked],
        impl: Engine,
        runner: Runner,
        skip_nonfinite: bool = False,
    ) -> None:
        self.rule = rule
        self.pairs = pairs
        self.impl = impl
        self.runner = runner
        self.skip_nonfinite = skip_nonfinite
        self.finite = FiniteGuard()
        #: What the runner is handed for a plan, if not the plan itself (BEMA's work).
        self.work: Callable[[Plan], Work] | None = None
        self.swapped = False
        self._plan: Plan | None = None
        #: ``update()`` calls so far.
        self.step = 0
        #: Whether the first call has initialized the EMA.
        self.initted = False
        #: The call of the last averaging update (or of the initializing copy).
        self.last = 0
        #: Calls between the last two averaging updates.
        self.gap = 0
        #: Settings of the owner that the ranks of a job must agree on, beyond the rule's
        #: and ``skip_nonfinite`` (``ema_dtype``...), as text by name.
        self.settings: dict[str, str] = {}
        #: ``(step, last, gap)`` before the last `advance()`, for `rewind()`.
        self._before = (0, 0, 0)
        self._views = (torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.bool))
        #: Whether the tensor views were handed out and may be held (read back each call).
        self.views_held = False
        self._unheld = _references(self._views)  # the count when nobody else holds them

    # -- the counters and ema-pytorch's tensor views of two of them -------------------------

    def tensor_views(self) -> tuple[Tensor, Tensor]:
        """``step`` and ``initted`` as CPU int64 and bool tensors that client code may
        write in place (also through ``.data``); a write takes effect at the next call."""
        self.sync_views()
        self._refresh_views()
        self.views_held = True
        return self._views

    def sync_views(self) -> None:
        """Take the values of handed-out views (clients may have written them), and stop
        watching them once nobody else holds them. A few µs, only after a hand-out."""
        if not self.views_held:
            return
        views = self._views  # no names bound to the tensors: they would count as holders
        self.step, self.initted = int(views[0]), bool(views[1])
        if _references(views) <= self._unheld:
            self.views_held = False

    def _refresh_views(self) -> None:
        step, initted = self._views
        step.fill_(self.step)
        initted.fill_(self.initted)

    def set_counters(self, *, step: int | None = None, initted: bool | None = None) -> None:
        """Set ``step`` and/or ``initted`` (a loaded state, a client's assignment); views
        already handed out see the new values."""
        self.sync_views()
        if step is not None:
            self.step = step
        if initted is not None:
            self.initted = initted
        if self.views_held:
            self._refresh_views()

    def snapshot(self) -> tuple[int, bool, int, int, int]:
        """``(step, initted, last, gap, num_skipped_nonfinite)``, to restore after a failed
        load."""
        self.sync_views()
        return self.step, self.initted, self.last, self.gap, self.num_skipped_nonfinite

    def restore(self, saved: tuple[int, bool, int, int, int]) -> None:
        """Put back what `snapshot()` returned."""
        step, initted, self.last, self.gap, skipped = saved
        self.set_counters(step=step, initted=initted)
        self.num_skipped_nonfinite = skipped

    def reset(self, step: int) -> None:
        """Start over at ``step`` as an initialized EMA whose last averaging update was at
        ``step`` (e.g. an EMA reconstructed from snapshots)."""
        self.invalidate()
        self.set_counters(step=step, initted=True)
        self.last, self.gap = step, 0

    @property
    def num_skipped_nonfinite(self) -> int:
        """Updates skipped because the weights held NaN or Inf (``skip_nonfinite=True``),
        the same on every rank. Reading it reads the device counter back (and gives the
        warning about the first skip)."""
        return self.finite.skips.resolve()

    @num_skipped_nonfinite.setter
    def num_skipped_nonfinite(self, value: int) -> None:
        self.finite.skips.set(value)

    def agreed_settings(self) -> dict[str, str]:
        """What every rank's EMA must share, by name, as text: the rule's settings
        ([`DecayRule.settings()`][emakit.decay.DecayRule.settings]), ``skip_nonfinite``
        and the owner's `settings`. emakit's collective saves and loads compare them
        across the ranks (`emakit._dist.collectives.agree_on`)."""
        return {
            **self.rule.settings(),
            "skip_nonfinite": str(self.skip_nonfinite),
            **self.settings,
        }

    # -- the plan -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The current plan, rebuilt from the source's live pairs if the model changed."""
        plan = self._plan
        freshness = "stale" if plan is None else plan.freshness()
        if freshness == "fresh":
            return plan  # type: ignore[return-value]
        self.runner.wait()
        tracked = self.pairs()  # the live tensors; raises when they no longer pair
        if freshness == "check" and plan is not None and plan.same_pairs(tracked):
            return plan
        plan = self._plan = build_plan(tracked, self.impl, staged=self.runner.staged)
        return plan

    def invalidate(self) -> None:
        """Drop the plan (after the owner moved or re-laid out its tensors)."""
        self.runner.wait()
        self._plan = None

    # -- the update -----------------------------------------------------------------------

    def advance(self) -> Action:
        """Count one call and return what it does (then `apply()` it unless it is
        `SKIP`), touching no tensor. The rule is asked first: a rule that raises (a
        schedule returning NaN, a decay group's callable failing) leaves every counter
        as it was. An averaging call moves ``last`` and ``gap`` here, so it counts as one
        even when its update is then skipped (non-finite weights); an `apply()` that
        raises puts them back (`rewind()`)."""
        if self.swapped:
            raise EMARuntimeError(
                "update() was called inside swap(), where the online model holds the EMA "
                "weights; leave the swap() block first. If an optimizer.step() in the block "
                "called it (an optimizer hooked with add_to_optimizer_post_step_hook, a "
                "framework's callback), that step has trained the EMA weights, not the "
                "model's: inside swap() the model's tensors are the EMA's, and what is "
                "written there stays in the EMA. Call optimizer.step() outside the block "
                "(evaluate inside it, in eval mode under torch.no_grad())"
            )
        if self.views_held:
            self.sync_views()  # a client may have written ema.step / ema.initted in place
        step, last = self.step, self.last
        action = self.rule.action(step, last) if self.initted else INIT  # may raise
        self._before = (step, last, self.gap)
        self.step = call = step + 1
        if self.views_held:
            self._refresh_views()
        if action.kind == "lerp" or action.kind == "hold":  # action.averages, inline
            self.last, self.gap = call, call - last
        return action

    def rewind(self) -> None:
        """Undo the counting of the last `advance()` (its update raised before it was
        handed to the runner), so that a retry is the same call of the schedule."""
        self.step, self.last, self.gap = self._before
        if self.views_held:
            self._refresh_views()

    def apply(self, action: Action) -> Action:
        """Carry out ``action`` (from `advance()`) on the current plan."""
        if action is SKIP:
            return action
        try:
            plan = self.plan()  # raises when the model no longer pairs
            if self.skip_nonfinite and action.guard is None:
                action = self.finite.guard(plan, action, self.step)
                if action is SKIP:
                    return action
            if action.kind != "hold":
                work = plan if self.work is None else self.work(plan)
                try:
                    self.runner.submit(work, action)
                except RuntimeError:
                    # e.g. a tensor's .data re-pointed to another shape, which per-tensor
                    # paths only meet in the kernel: pairing again names it (EMAStateError)
                    self.pairs()
                    raise
        except BaseException:
            self.rewind()  # the call did not happen: a retry is the same call
            raise
        if action.kind == "init":
            self.set_counters(initted=True)
            self.last, self.gap = self.step, 0
        return action

    def catch_up(self) -> None:
        """Average in the current weights now if the last averaging update came before the
        current call, so the averaging profile ends exactly at ``step`` (the post-hoc EMA
        does this before a snapshot)."""
        step, last = self.step, self.last
        if not self.initted or step <= last:
            return
        self._before = (step, last, self.gap)  # what a failed apply() below puts back
        if self.rule.frozen:
            self.apply(Action("hold", call=step))
        else:
            self.apply(Action("lerp", self.rule.weights(step, last), step))
        self.runner.wait()
        self.last, self.gap = step, step - last

    def __getstate__(self) -> dict:
        self.runner.wait()
        self.sync_views()
        # the plan is rebuilt on first use (it only holds references)
        return {**self.__dict__, "_plan": None, "swapped": False, "views_held": False}
