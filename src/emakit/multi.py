"""``MultiEMA``: several EMAs of one model (e.g. betas 0.999 and 0.9999), one update pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import nn

from ._core.state import check_loadable, load_or_restore, refuse_load_arguments
from ._core.tracker import Tracker
from ._engine.fused import FusedPlan
from ._engine.plan import Plan
from .decay import SKIP, Action
from .ema import EMA
from .errors import EMARuntimeError, EMATypeError, EMAValueError

__all__ = ["MultiEMA"]


class MultiEMA(nn.Module):
    """Several EMAs of one model, updated together.

    Each EMA is a full [`EMA`][emakit.EMA] (``multi[i]`` or ``multi.emas[i]``: its own
    ``ema_model``, ``swap()``, forward and state). One [`update()`][emakit.multi.MultiEMA.update] advances them all:
    the online tensors are walked once, gathered once into a staging buffer when they are
    not already one contiguous span, and each EMA then takes one ``lerp_`` per
    (device, dtype) group, instead of one per tensor per EMA.

    Args:
        model: the online module.
        betas: one EMA per beta, sharing the warm-up settings. Default (0.999, 0.9999).
        schedules: alternatively one schedule (``t -> decay``) per EMA; overrides ``betas``.
        **ema_kwargs: any [`EMA`][emakit.EMA] keyword shared by all (``update_every``,
            ``update_after_step``, ``ema_dtype``, ...). ``update_model_with_ema_every``
            and ``decay_groups`` are not supported here; ``include_online_model``
            defaults to False (the state holds the EMAs, not N copies of the model).

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> multi = MultiEMA(net, betas=(0.9, 0.99), update_after_step=0, update_every=1)
        >>> multi.update(); multi.update()
        >>> [round(e.get_current_decay(), 3) for e in multi]
        [0.37, 0.37]
        >>> with multi[1].swap():
        ...     _ = net(torch.zeros(1, 4))
    """

    def __init__(
        self,
        model: nn.Module,
        betas: Sequence[float] = (0.999, 0.9999),
        *,
        schedules: Sequence[Callable[[int], float]] | None = None,
        **ema_kwargs: Any,
    ) -> None:
        super().__init__()
        for key in ("update_model_with_ema_every", "decay_groups", "beta", "schedule", "ema_model"):
            if ema_kwargs.get(key) is not None:
                raise EMAValueError(
                    f"MultiEMA does not take {key}=; give betas= or schedules=, and build "
                    f"separate EMA objects for per-EMA models or hare-and-tortoise updates"
                )
        if ema_kwargs.get("compile_update"):
            raise EMAValueError(
                "MultiEMA does not take compile_update=True: it fuses its EMAs' updates in "
                "one eager pass over the weights; build separate EMA objects to compile each"
            )
        if schedules is not None:
            if isinstance(schedules, (str, bytes)) or not all(callable(s) for s in schedules):
                raise EMATypeError(
                    f"schedules must be a sequence of callables t -> decay, got {schedules!r}"
                )
            configs: list[dict[str, Any]] = [{"schedule": s} for s in schedules]
        else:
            if isinstance(betas, (int, float)):
                raise EMATypeError(
                    f"betas must be a sequence of floats, e.g. (0.999, 0.9999), got {betas=}"
                )
            configs = [{"beta": b} for b in betas]
        if not configs:
            raise EMAValueError(
                "MultiEMA needs at least one EMA: give a non-empty betas= or schedules="
            )
        # N EMAs of one model: the model is saved once, by whoever owns it.
        ema_kwargs.setdefault("include_online_model", False)
        self.emas = nn.ModuleList(EMA(model, **ema_kwargs, **cfg) for cfg in configs)
        # One runner for the set: a fused update is one piece of work, and every EMA's
        # readers (state_dict, swap, forward) wait for it.
        runner = self[0].tracker.runner
        for e in self:
            e.tracker.runner = runner
        self._fused: FusedPlan | None = None
        self._plans_seen: list[int] = []

    def __len__(self) -> int:
        return len(self.emas)

    def __getitem__(self, i: int) -> EMA:
        return self.emas[i]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[EMA]:
        return iter(self.emas)  # type: ignore[arg-type]

    @property
    def step(self) -> int:
        """Number of [`update()`][emakit.multi.MultiEMA.update] calls so far."""
        return self[0].tracker.step

    def _fused_for(self, plans: list[Plan]) -> FusedPlan | None:
        seen = [id(p) for p in plans]
        if seen != self._plans_seen or (self._fused is not None and self._fused.stale()):
            staged = self[0].tracker.runner.staged
            self._fused = FusedPlan.build(plans, frozen=[e.is_frozen for e in self], staged=staged)
            self._plans_seen = seen
        return self._fused

    def update(self) -> None:
        """Advance every EMA by one training step (see [`EMA.update()`][emakit.ema.EMA.update]).

        Averaging calls read the online tensors once for all EMAs (a fused pass, on the
        set's shared runner: inline, background thread or CUDA stream); the first call and
        warm-up copies go through each EMA's own plan.
        """
        trackers = [e.tracker for e in self]
        if any(t.swapped for t in trackers):
            raise EMARuntimeError("update() was called inside swap(); leave the swap() block first")
        advanced: list[Tracker] = []
        try:
            self._update(trackers, advanced)
        except BaseException:
            for t in advanced:  # a failed call counts for none of them (see Tracker.rewind)
                t.rewind()
            raise

    def _update(self, trackers: list[Tracker], advanced: list[Tracker]) -> None:
        actions = []
        for t in trackers:
            actions.append(t.advance())
            advanced.append(t)
        if actions[0] is SKIP:
            return
        if all(a.averages for a in actions):
            plans = [t.plan() for t in trackers]
            guard = None
            if trackers[0].skip_nonfinite:
                # one flag (one all-reduce when sharded) for all, counted by each member
                guard = trackers[0].finite.guard(plans[0], actions[0], trackers[0].step).guard
                if guard is not None:
                    for t in trackers[1:]:
                        t.finite.skips.add_flag(guard, t.step)
                    actions = [dataclasses.replace(a, guard=guard) for a in actions]
            fused = self._fused_for(plans)
            if fused is not None:
                weights = tuple(a.weights[0] if a.kind == "lerp" else 0.0 for a in actions)
                if any(weights):  # advance() has counted every member's averaging call
                    action = Action("lerp", weights, actions[0].call, guard=guard)
                    trackers[0].runner.submit(fused, action)
                return
        for t, a in zip(trackers, actions, strict=True):
            t.apply(a)  # an action guarded above is not guarded (or counted) again

    def owns_state_key(self, key: str) -> bool:
        """Whether a state key (relative to this MultiEMA) is one a member reads or ignores
        beyond its tensors (see [`emakit.EMA.owns_state_key()`][emakit.EMA.owns_state_key])."""
        for i, member in enumerate(self):
            if key.startswith(head := f"emas.{i}."):
                return member.owns_state_key(key[len(head) :])
        return False

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load every member's state (``emas.<i>.*``); a state that does not fit is refused
        before anything is loaded, so a failed load leaves every member as it was."""
        refuse_load_arguments(state_dict, assign)
        check_loadable(
            self.state_dict(keep_vars=True), state_dict, strict=strict, owned=self.owns_state_key
        )
        self._plans_seen = []
        return load_or_restore(
            lambda: super(MultiEMA, self).load_state_dict(state_dict, strict=strict),
            [e.tracker for e in self],
        )

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run every EMA model (eval mode, no grad); returns their outputs in order."""
        return [e(*args, **kwargs) for e in self]
