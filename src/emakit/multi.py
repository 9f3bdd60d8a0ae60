"""``MultiEMA``: several EMAs of one model (e.g. betas 0.999 and 0.9999), one update pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .ema import EMA
from .engine.plan import _span, _split_runs
from .errors import EMATypeError, EMAValueError

__all__ = ["MultiEMA"]


#: Mean elements per tensor below which gathering the online tensors once into a staging
#: buffer beats one lerp per tensor per EMA (the update is then launch-bound, not
#: bandwidth-bound). Measured on CPU with benchmarks/bench_multi.py.
GATHER_BELOW = 1 << 16


class _FusedGroup:
    """One (device, dtype) group of averaged tensors, shared by every EMA of the set.

    Three forms, picked once: the online tensors already form one span of the shadow's
    dtype (each EMA takes one ``lerp_`` from it); they are many small tensors (gather them
    once into ``staging``, then one ``lerp_`` per EMA); or they are large (one foreach
    ``lerp_`` per EMA straight from them: a gather would only add a pass over memory).
    """

    def __init__(self, onlines: list[Tensor], shadows: list[list[Tensor]]) -> None:
        self.spans = [_span(s).reshape(-1) for s in shadows]
        self.shadows = shadows
        self.onlines = onlines
        self.src: list[Tensor] = []
        self.direct = False
        runs = _split_runs(onlines)
        ref = self.spans[0]
        same = onlines[0].dtype == ref.dtype and onlines[0].device == ref.device
        self.key = (onlines[0].dtype, onlines[0].device)
        self.guard = [onlines[i] for r in runs if len(r) > 1 for i in r]
        self.ptrs = [t.data_ptr() for t in self.guard]
        if len(runs) == 1 and same:
            self.source = _span(onlines).reshape(-1)
            return
        if same and ref.numel() / len(onlines) >= GATHER_BELOW:
            self.direct = True
            return
        self.source = torch.empty(ref.numel(), dtype=ref.dtype, device=ref.device)
        self.dst: list[Tensor] = []
        offset = 0
        for run in runs:
            n = sum(onlines[i].numel() for i in run)
            view = self.source.narrow(0, offset, n)
            self.dst.append(view.view(onlines[run[0]].shape) if len(run) == 1 else view)
            self.src.append(_span([onlines[i] for i in run]))
            offset += n

    def stale(self) -> bool:
        first = self.onlines[0]
        if (first.dtype, first.device) != self.key:
            return True
        return list(map(Tensor.data_ptr, self.guard)) != self.ptrs

    def lerp(self, weights: Sequence[float]) -> None:
        if self.direct:
            for shadows, w in zip(self.shadows, weights, strict=True):
                if w:
                    torch._foreach_lerp_(shadows, self.onlines, w)
            return
        if self.src:
            torch._foreach_copy_(self.dst, self.src)
        for span, w in zip(self.spans, weights, strict=True):
            if w:
                span.lerp_(self.source, w)


class MultiEMA(nn.Module):
    """Several EMAs of one model, updated together.

    Each EMA is a full :class:`~emakit.EMA` (``multi[i]`` or ``multi.emas[i]``: its own
    ``ema_model``, ``swap()``, forward and state). One :meth:`update` advances them all:
    the online tensors are walked once, gathered once into a staging buffer when they are
    not already one contiguous span, and each EMA then takes one ``lerp_`` per
    (device, dtype) group, instead of one per tensor per EMA.

    Args:
        model: the online module.
        betas: one EMA per beta, sharing the warm-up settings. Default (0.999, 0.9999).
        schedules: alternatively one schedule (``t -> decay``) per EMA; overrides ``betas``.
        **ema_kwargs: any :class:`~emakit.EMA` keyword shared by all (``update_every``,
            ``update_after_step``, ``ema_dtype``, ...). ``update_model_with_ema_every``
            and ``decay_groups`` are not supported here.

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
        ema_kwargs.pop("ema_model", None)
        self.emas = nn.ModuleList(EMA(model, **ema_kwargs, **cfg) for cfg in configs)
        self._fused: list[_FusedGroup] | None = None
        self._plans_seen: list[int] = []

    def __len__(self) -> int:
        return len(self.emas)

    def __getitem__(self, i: int) -> EMA:
        return self.emas[i]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[EMA]:
        return iter(self.emas)  # type: ignore[arg-type]

    @property
    def step(self) -> int:
        """Number of :meth:`update` calls so far."""
        return self[0]._step

    def _build_fused(self) -> list[_FusedGroup] | None:
        plans = [e._ensure_plan() for e in self]
        first = plans[0].pairs
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(first):
            if p.average:
                key = (p.shadow.device, p.shadow.dtype)
                groups.setdefault(key, []).append(i)
        fused = []
        for idx in groups.values():
            # every EMA laid its shadow out in the same (memory) order; follow it
            idx.sort(key=lambda i: first[i].shadow.storage_offset())
            onlines = [first[i].online for i in idx]
            shadows = [[plan.pairs[i].shadow for i in idx] for plan in plans]
            if any(len(_split_runs(s)) != 1 for s in shadows):
                return None  # layouts differ; fall back to per-EMA plans
            fused.append(_FusedGroup(onlines, shadows))
        return fused

    def update(self) -> None:
        """Advance every EMA by one training step (see :meth:`EMA.update`)."""
        lead = self[0]
        step = lead._step
        if not lead._initted or step % lead.update_every or step <= lead.update_after_step:
            for e in self:
                e.update()
            return
        for e in self:
            if e._swapped:
                e.update()  # raises the swap error
            e._step = step + 1
            e._before_update()
        plans = [e._ensure_plan() for e in self]
        if lead.skip_nonfinite and not lead._online_finite(plans[0]):
            return
        fused = self._fused
        if (
            fused is None
            or self._plans_seen != [id(p) for p in plans]
            or any(g.stale() for g in fused)
        ):
            fused = self._fused = self._build_fused()
            self._plans_seen = [id(p) for p in plans]
        if fused is None:
            for e, plan in zip(self, plans, strict=True):
                if not e.is_frozen:
                    plan.lerp_shadow(e._weights_at(step + 1))
            return
        weights = [0.0 if e.is_frozen else 1.0 - e._decay_at(step + 1) for e in self]
        with torch.no_grad():
            for g in fused:
                g.lerp(weights)
            for e, plan in zip(self, plans, strict=True):
                if not e.is_frozen:
                    plan._to_shadow.copy_only(plan.impl)

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Run every EMA model (eval mode, no grad); returns their outputs in order."""
        return [e(*args, **kwargs) for e in self]
