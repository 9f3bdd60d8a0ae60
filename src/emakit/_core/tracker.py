"""The bookkeeping of one EMA, shared by every EMA kind: counters, rule, plan and runner.

A :class:`Tracker` owns the call counter (``step``), whether the first call has happened
(``initted``), the last averaging call and its gap (the power-function EMA needs them),
the count of updates skipped for non-finite weights, and the swap flag. Its
:meth:`~Tracker.update` is the one update path of emakit:

1. :meth:`~Tracker.advance` counts the call and asks the pure
   :class:`~emakit.decay.DecayRule` what it does (the first call always initializes);
2. :meth:`~Tracker.apply` makes sure the plan still matches the model (rebuilding it from
   the owner's ``pairs`` callable when a tensor was replaced or moved), optionally guards
   the action with a device-side "weights are finite" flag, and hands it to the runner.

**Skipping non-finite updates** (``skip_nonfinite=True``) never reads a value back from the
device in ``update()``: the flag (:mod:`emakit._engine.finite`; for sharded models combined
across ranks by one small all-reduce) travels with the action and the kernels select on it,
and a skip adds one to a counter on the device. The counter is read, and the warning about
the first skip given, when :attr:`Tracker.num_skipped_nonfinite` is next read (a state dict
reads it). A skipped averaging call still counts as an averaging call (``last`` moves; the
power-function EMA sees a held step). Only the very first call reads the flag on the host,
so that a first call on non-finite weights leaves the EMA uninitialized, as before.

Facades (``EMA``, ``MultiEMA``, ``KarrasEMA`` ...) only wire a tracker to a model.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from .._engine.kernels import Impl
from .._engine.pairs import TensorPair
from .._engine.plan import Plan, build_plan
from .._engine.runners import Runner, SyncRunner
from ..decay import INIT, SKIP, Action, DecayRule
from ..errors import EMARuntimeError

__all__ = ["Tracker"]


def _references(views: tuple[Tensor, Tensor]) -> int:
    """How many references the views have (measured the same way every time, so that a
    count above the one taken at creation means a client holds one)."""
    step, initted = views
    return max(sys.getrefcount(step), sys.getrefcount(initted))


class Tracker:
    """Counters, decay rule, plan and runner of one EMA (see the module docstring).

    Args:
        rule: what each call does.
        pairs: builds the current pairs of online and shadow tensors (called whenever the
            plan must be built: first use, or after the model changed); it validates them
            and raises :class:`~emakit.EMAStateError` naming a tensor that no longer pairs.
        impl: the engine path (``"loop"``, ``"foreach"`` or ``"flat"``).
        runner: where updates run. Default: a :class:`~emakit._engine.runners.SyncRunner`.
        skip_nonfinite: skip updates whose online weights hold NaN or Inf. Default False.
    """

    def __init__(
        self,
        rule: DecayRule,
        pairs: Callable[[], list[TensorPair]],
        *,
        impl: Impl,
        runner: Runner | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        self.rule = rule
        self.pairs = pairs
        self.impl: Impl = impl
        self.runner: Runner = runner if runner is not None else SyncRunner()
        self.skip_nonfinite = skip_nonfinite
        self.step = 0
        self.initted = False
        self.last = 0
        self.gap = 0
        self._skipped = 0  # resolved skips; more may wait on the device (see _resolve)
        self._skip_count: Tensor | None = None  # skips not yet read back, on the device
        self._skip_first: Tensor | None = None  # the call of the first of them (0: none)
        self.swapped = False
        self._plan: Plan | None = None
        # ema-pytorch's step and initted are tensors that clients write in place
        # (ema.step += 1, ema.initted.data.fill_(True)). Views of the integer counters:
        # handed out by the properties, read back before the next update (writes take
        # effect), kept current while someone holds them.
        self._views = (torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.bool))
        self._views_out = False
        self._unheld = _references(self._views)  # the count when nobody else holds them

    # -- the plan -------------------------------------------------------------------------

    def plan(self) -> Plan:
        """The current plan, rebuilt from the live tensors if the model changed under it."""
        plan = self._plan
        freshness = "stale" if plan is None else plan.freshness()
        if freshness == "fresh":
            return plan  # type: ignore[return-value]
        self.runner.wait()
        pairs = self.pairs()  # the live tensors by name; raises when they no longer pair
        if freshness == "check" and plan is not None and plan.same_pairs(pairs):
            return plan
        plan = self._plan = build_plan(pairs, self.impl, staged=self.runner.staged)
        return plan

    def invalidate(self) -> None:
        """Drop the plan (after the owner moved or re-laid out its tensors)."""
        self.runner.wait()
        self._plan = None

    def counters(self) -> tuple[int, bool, int, int, int]:
        """``(step, initted, last, gap, num_skipped_nonfinite)``, to restore after a failed load."""
        self.sync_views()
        return self.step, self.initted, self.last, self.gap, self.num_skipped_nonfinite

    def restore_counters(self, saved: tuple[int, bool, int, int, int]) -> None:
        """Put back what :meth:`counters` returned."""
        step, initted, self.last, self.gap, self.num_skipped_nonfinite = saved
        self.set_counters(step=step, initted=initted)

    def reset(self, step: int) -> None:
        """Start over at ``step`` as an initialized EMA whose last averaging update was at
        ``step`` (e.g. an EMA reconstructed from snapshots)."""
        self.runner.wait()
        self.set_counters(step=step, initted=True)
        self.last, self.gap = step, 0
        self._plan = None

    # -- the update -----------------------------------------------------------------------

    # -- step and initted as tensors --------------------------------------------------

    def step_tensor(self) -> Tensor:
        """``step`` as a CPU int64 tensor that client code may write in place; the write
        takes effect at the next call (see :meth:`sync_views`)."""
        self.sync_views()
        self._refresh_views()  # both: the next sync reads both back
        self._views_out = True
        return self._views[0]

    def initted_tensor(self) -> Tensor:
        """``initted`` as a CPU bool tensor that client code may write in place (also
        through ``.data``); the write takes effect at the next call."""
        self.sync_views()
        self._refresh_views()
        self._views_out = True
        return self._views[1]

    def sync_views(self) -> None:
        """Take the values of handed-out views (clients may have written them), and stop
        watching them once nobody else holds them. A few µs, only after a hand-out."""
        if not self._views_out:
            return
        views = self._views  # no names bound to the tensors: they would count as holders
        self.step, self.initted = int(views[0]), bool(views[1])
        if _references(views) <= self._unheld:
            self._views_out = False

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
        if self._views_out:
            self._refresh_views()

    # -- the update -----------------------------------------------------------------------

    def update(self) -> Action:
        """Count one call and carry out what it does; returns the action applied
        (:data:`~emakit.decay.SKIP` when nothing happened)."""
        if self._views_out:
            self.sync_views()
            action = self.apply(self.advance())
            if self._views_out:
                self._refresh_views()  # someone holds them: keep them current
            return action
        action = self.advance()
        if action is SKIP:
            return action
        return self.apply(action)

    def advance(self) -> Action:
        """Count one call and return what it does, touching no tensor."""
        if self.swapped:
            raise EMARuntimeError("update() was called inside swap(); leave the swap() block first")
        step = self.step
        self.step = step + 1
        if not self.initted:
            return INIT
        return self.rule.action(step, self.last)

    def apply(self, action: Action) -> Action:
        """Carry out ``action`` (from :meth:`advance`) on the current plan."""
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
                self.pairs()
                raise
        self.record(action)
        return action

    def record(self, action: Action) -> None:
        """Update the counters after ``action`` was carried out (by :meth:`apply` or by a
        caller that ran it itself, e.g. a fused update of several EMAs)."""
        if action.kind == "init":
            self.initted = True
            self.last, self.gap = self.step, 0
        elif action.averages:
            self.last, self.gap = action.call, action.call - self.last

    def catch_up(self) -> None:
        """Average in the current weights now if the last averaging update came before the
        current call, so the averaging profile ends exactly at ``step`` (the post-hoc EMA
        does this before a snapshot)."""
        if not self.initted or self.step <= self.last:
            return
        self.runner.wait()
        plan = self.plan()
        if self.rule.frozen:
            action = Action("hold", call=self.step)
        else:
            action = Action("lerp", self.rule.weights(self.step, self.last), self.step)
        if self.skip_nonfinite:
            action = self.guard(plan, action)
        plan.run(action)
        self.record(action)

    # -- skipping non-finite updates ----------------------------------------------------

    def guard(self, plan: Plan, action: Action) -> Action:
        """``action`` guarded by "``plan``'s online weights are finite on every rank" (a
        flag on the device, counted as a skip where false), or :data:`SKIP` for a first
        call on non-finite weights (read on the host: the one call that does)."""
        ok = plan.finite_flag(self.step)
        if ok is None:
            return action
        if action.kind == "init":
            if not bool(ok):
                self.count_nonfinite()
                return SKIP
            return action
        self.count_flag(ok)
        return dataclasses.replace(action, guard=ok)

    def count_flag(self, ok: Tensor) -> None:
        """Count a skip on the device where the 0-dim bool ``ok`` is false (no host read)."""
        bad = ok.logical_not()
        count, first = self._skip_count, self._skip_first
        if count is None or first is None or count.device != ok.device:
            self._resolve()
            count = self._skip_count = torch.zeros((), dtype=torch.long, device=ok.device)
            first = self._skip_first = torch.zeros((), dtype=torch.long, device=ok.device)
        count.add_(bad)
        # the call of the first unread skip: kept once set, else this call if it skipped
        torch.where(first > 0, first, bad * self.step, out=first)

    def count_nonfinite(self, first: int | None = None, n: int = 1) -> None:
        """Count ``n`` skipped updates, the first at call ``first`` (default: this call);
        warn at the first skip of all."""
        before = self._skipped
        self._skipped += n
        if before == 0 and n > 0:
            warnings.warn(
                f"skipped an EMA update at step {self.step if first is None else first}: the "
                f"model's weights hold NaN or Inf (skip_nonfinite=True; further skips are "
                f"counted in num_skipped_nonfinite)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _resolve(self) -> None:
        """Read the device counter back (a host sync, only when the count is asked for)."""
        count, first = self._skip_count, self._skip_first
        if count is None or first is None:
            return
        n, at = torch.stack([count, first]).tolist()  # one read
        if n:
            count.zero_()
            first.zero_()
            self.count_nonfinite(at, n)

    @property
    def num_skipped_nonfinite(self) -> int:
        """Updates skipped because the weights held NaN or Inf (``skip_nonfinite=True``),
        the same on every rank. Reading it reads the device counter back (and gives the
        warning about the first skip)."""
        self._resolve()
        return self._skipped

    @num_skipped_nonfinite.setter
    def num_skipped_nonfinite(self, value: int) -> None:
        self._skipped = int(value)
        self._skip_count = self._skip_first = None

    def __getstate__(self) -> dict:
        self.runner.wait()
        self.sync_views()
        self._resolve()
        state = self.__dict__.copy()
        state["_skip_count"] = state["_skip_first"] = None
        state["_plan"] = None  # rebuilt on first use; it only holds references
        state["swapped"] = False
        state["_views_out"] = False
        return state
