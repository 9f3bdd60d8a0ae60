"""``BEMA``: the bias-corrected EMA of Block et al. 2025 ("EMA Without the Lag",
arXiv:2508.00180), with the numbers of TRL's ``BEMACallback``.

An EMA lags the weights it averages; BEMA adds back a multiple of how far the weights
moved since a reference point, which removes the lag's bias at early times:

.. math:: \\text{ema}_t = (1 - \\beta_t)\\,\\text{ema}_{t-1} + \\beta_t\\,\\theta_t,\\qquad
   \\hat\\theta_t = \\text{ema}_t + \\alpha_t\\,(\\theta_t - \\theta_0)

with ``beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier)`` and
``alpha_t = (lag + multiplier t)^-bias_power`` (see [`BEMARule`][emakit.decay.BEMARule]).
It is an EMA kind like the others: the decay rule is pure, the update the EMA's own
``lerp_`` on the same runners (inline, background thread, offloaded to the CPU), the state
one versioned codec next to ema-pytorch's keys. ``theta_hat`` is built only when read
(``swap()``, ``ema(x)``, ``ema_model``, the exports, the state dict).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._core.state import StateCodec, integer, real, refuse_other_settings
from ._core.swap import Swap
from ._dist.dtensor import dtensor_like, is_dtensor, local_tensor
from ._engine.bema import BEMAWork, state_order
from ._engine.flat import rehome_
from ._engine.plan import Plan
from .decay import Action, BEMARule, bema_rule
from .ema import EMA
from .errors import EMAStateError

__all__ = ["BEMA", "BEMA_STATE_VERSION"]

#: Version of what `BEMA.state_dict()` adds to EMA's: the ``bema_ema.*`` and
#: ``bema_theta0.*`` tensors, and the settings in the module's metadata.
BEMA_STATE_VERSION = 1
_CODEC = StateCodec(  # BEMARule's settings, in the metadata
    BEMA_STATE_VERSION,
    [(integer if f.type == "int" else real)(f.name, meta=True) for f in fields(BEMARule)],
    version_name="bema_version",
)
_KEYS = ("bema_ema.", "bema_theta0.")  # the prefixes of BEMA's own tensors in its state


class BEMA(EMA):
    """A bias-corrected EMA (BEMA, arXiv:2508.00180) in TRL's parameterization.

    Call `update()` after every optimizer step, as for an [`EMA`][emakit.EMA]. ``t``
    is the number of `update()` calls, which is TRL's ``state.global_step``. At
    construction (TRL: ``on_train_begin``) ``theta0`` and the EMA are the model's weights.
    Then, at call ``t``:

    * ``t < update_after``: nothing;
    * ``t == update_after``: ``theta0`` and the EMA become ``theta_t``;
    * ``(t - update_after) % update_freq == 0``: ``ema.lerp_(theta_t, beta_t)`` (an
      EMA's update, from a snapshot of ``theta_t`` taken in ``update()`` when it runs in
      the background: the model is never read after ``update()`` returns).

    **The evaluated weights** ``ema + alpha_t * (theta - theta0)`` are built when
    something reads them (`swap()`, ``bema(x)``, ``ema_model``, an export,
    `state_dict()`), from the model's weights ``theta`` at that moment, with ``alpha_t``
    of the most recent update (0 before the first, so they are the EMA itself: the
    model's weights at construction or at ``update_after``). Read right after an update
    they are TRL's ``running_model``, bit for bit for a given EMA (the Trainer callback
    keeps the last update's for ``bema/`` when steps follow it); read between updates
    (``update_freq > 1``), the correction uses the current weights where TRL holds the
    last update's. They are built into the EMA model's own tensors while the plain EMA
    waits in a stash, so a module taken from ``ema_model`` holds them until the next
    `update()`, which puts the plain EMA back (a read then costs about four passes over
    the weights and the first update after it one more; further reads build again only
    if the model's weights changed).

    The paper (Algorithm 1) counts ``t`` from the burn-in, ``beta_t = (rho + gamma (t -
    tau))^-kappa``; TRL, and so this class, count it from the start of training, which
    differs when ``update_after > 0``.

    **Memory**: two copies of the averaged tensors, on ``device``: the EMA (the EMA
    model's own tensors) and ``theta0``; a third, the stash, from a read until the next
    update. A background BEMA (``device=`` given) adds the snapshot buffer an EMA in the
    background has, as does a BEMA on another device or dtype than the model. Frozen
    weights are shared with the model. An update costs an EMA's (one ``lerp_`` per
    span).

    **State**: `state_dict()` has [`EMA.state_dict`][emakit.EMA.state_dict]'s keys
    (``ema_model.*`` holds the evaluated weights), plus the EMA and ``theta0`` of every
    averaged tensor, and the settings in the module's metadata (``bema_version`` 1); for
    ``BEMA(nn.Linear(2, 2))``::

        {
            "initted": tensor(True),
            "step": tensor(800),
            "ema_model.weight": tensor(...),     # ema + alpha_t * (theta - theta0)
            "ema_model.bias": tensor(...),
            "bema_ema.weight": tensor(...),      # the plain EMA
            "bema_ema.bias": tensor(...),
            "bema_theta0.weight": tensor(...),   # the weights at update_after
            "bema_theta0.bias": tensor(...),
        }

    A resumed BEMA continues bit for bit (the plain EMA comes from ``bema_ema.*``; the
    layout is the one earlier versions wrote, and their states load). Loading refuses a
    state saved with other settings (when the metadata is there).

    Args:
        model: the online (training) module.
        update_freq: calls between BEMA updates (``phi``). Default 400.
        ema_power: the EMA weight's exponent (``kappa``); 0 disables the EMA. Default 0.5.
        bias_power: the bias weight's exponent (``eta``); 0 keeps ``alpha_t = 1``.
            Default 0.2.
        lag: the offset ``rho`` of both schedules. Default 10.
        update_after: the burn-in ``tau``, in calls. Default 0.
        multiplier: the time scale ``gamma``, > 0. Default 1.0. With a positive power,
            ``lag + multiplier * t`` must be >= 1 at the first update ``t = update_after +
            update_freq``, so that ``beta_t`` and ``alpha_t`` stay in [0, 1].
        min_ema_multiplier: the floor of ``beta_t``, in [0, 1]. Default 0.0.
        ema_model: keyword-only; a module (or factory) to hold the EMA and, when read, the
            evaluated weights; the model's weights (frozen ones too) are copied into it.
            Default None: a copy of ``model``.
        device: keyword-only; keep the BEMA tensors on this device, e.g. ``"cpu"`` (TRL's
            default) for a GPU model. Default None: the model's device.
        async_update: keyword-only; run the arithmetic on a background thread (see
            [`EMA`][emakit.EMA]). Default None: True when ``device`` is given.
        ema_dtype: keyword-only; keep floating BEMA tensors in at least this dtype.
            Default None.
        param_or_buffer_names_no_ema: keyword-only, as for [`EMA`][emakit.EMA].
        ignore_names: keyword-only, as for [`EMA`][emakit.EMA].
        ignore_startswith_names: keyword-only, as for [`EMA`][emakit.EMA].
        allow_different_devices: keyword-only, as for [`EMA`][emakit.EMA].
        forward_method_names: keyword-only, as for [`EMA`][emakit.EMA].
        include_online_model: keyword-only, as for [`EMA`][emakit.EMA].
        share_frozen: keyword-only; frozen weights shared with the model instead of
            copied (no ``theta0`` or EMA copy of them), as for [`EMA`][emakit.EMA].
            Default False.
        watch_model: keyword-only, as for [`EMA`][emakit.EMA]. Default False.

    Attributes:
        rule: the [`BEMARule`][emakit.decay.BEMARule] (its settings: ``rule.update_freq``,
            ``rule.lag`` ...); the tracker's rule.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> bema = BEMA(net, update_freq=2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> for _ in range(4):
        ...     net(torch.randn(8, 4)).pow(2).mean().backward()
        ...     opt.step(); opt.zero_grad(); bema.update()
        >>> round(bema.get_current_decay(), 4)  # 1 - (10 + 4) ** -0.5
        0.7327
        >>> y = bema(torch.randn(2, 4))  # on the BEMA weights
    """

    def __init__(
        self,
        model: nn.Module,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: float = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        *,
        ema_model: nn.Module | Any | None = None,
        device: torch.device | str | None = None,
        async_update: bool | None = None,
        ema_dtype: torch.dtype | None = None,
        param_or_buffer_names_no_ema: Iterable[str] = (),
        ignore_names: Iterable[str] = (),
        ignore_startswith_names: Iterable[str] = (),
        allow_different_devices: bool = False,
        forward_method_names: Sequence[str] = (),
        include_online_model: bool = False,
        share_frozen: bool = False,
        watch_model: bool = False,
    ) -> None:
        rule = bema_rule(
            update_freq, ema_power, bias_power, lag, update_after, multiplier, min_ema_multiplier
        )
        super().__init__(
            model,
            ema_model=ema_model,
            update_after_step=0,
            update_every=1,
            param_or_buffer_names_no_ema=param_or_buffer_names_no_ema,
            ignore_names=ignore_names,
            ignore_startswith_names=ignore_startswith_names,
            include_online_model=include_online_model,
            allow_different_devices=allow_different_devices,
            forward_method_names=forward_method_names,
            ema_dtype=ema_dtype,
            device=device,
            async_update=async_update,
            share_frozen=share_frozen,
            watch_model=watch_model,
        )
        self.rule = self.tracker.rule = rule
        #: ``theta0`` of every corrected tensor, by name (the plain EMA is the EMA model's).
        self._theta0: dict[str, Tensor] = {}
        self._work: tuple[Plan, BEMAWork] | None = None
        #: While the EMA model holds the evaluated weights: the work that built them, the
        #: stash holding the plain EMA, and the online versions they were built from.
        self._built: tuple[BEMAWork, list[Tensor], list[tuple[int, int]]] | None = None
        self.tracker.work = self._work_for  # the runner is handed BEMA's work for a plan
        self.copy_params_from_model_to_ema()  # theta0 and the EMA: = the model now
        self.tracker.set_counters(initted=True)

    def copy_params_from_model_to_ema(self) -> None:
        """Restart BEMA from the model's current weights: ``theta0`` and the EMA become a
        copy of the model (the counters are kept)."""
        self._drop_evaluated()
        self.tracker.runner.wait()
        self._work_for(self.tracker.plan()).run(Action("copy", call=self.tracker.step))

    def update(self) -> None:
        """One call (see [`EMA.update`][emakit.EMA.update]); the EMA model first drops the
        evaluated weights a read built, so the update averages the plain EMA."""
        if self._built is not None and not self.tracker.swapped:
            self._drop_evaluated()
        super().update()

    def _work_for(self, plan: Plan) -> BEMAWork:
        """The BEMA work over ``plan``'s pairs (built again when the plan is new), which the
        tracker hands its runner (inline, thread or stream) instead of the plan."""
        if self._work is None or self._work[0] is not plan or self._work[1].thawed():
            theta0 = self._theta0
            gone = sorted(theta0.keys() - {p.name for p in plan.pairs})
            if gone:  # the model changed: the state cannot follow
                raise EMAStateError(
                    f"the model's averaged tensors changed under this BEMA ({gone[:5]} are "
                    f"gone); build a new BEMA for the new model"
                )
            # New entries (all of them at first, then a frozen weight trained again) start
            # from the shadow's value, laid out like the shadows (the same spans), keyed in
            # the model's order (the same on every rank), not memory order.
            new = [p for p in state_order(plan.pairs) if p.name not in theta0]
            if new:
                self._drop_evaluated()  # from the plain EMA
            shadows = [local_tensor(p.shadow) for p in new]
            tensors = [torch.empty(0, dtype=s.dtype, device=s.device) for s in shadows]
            rehome_(tensors, sources=shadows)
            by_name = {p.name: t for p, t in zip(new, tensors, strict=True)}
            theta0.update((p.name, by_name[p.name]) for p in plan.pairs if p.name in by_name)
            work = BEMAWork(plan, theta0)
            built = self._built
            if built is not None and _spans(built[0]) != _spans(work):
                self._drop_evaluated()  # the stash no longer fits the EMA model's layout
            elif built is not None:  # a new plan over the same tensors: they stay built
                self._built = (work, built[1], built[2])
            self._work = (plan, work)
        return self._work[1]

    # -- the evaluated weights -------------------------------------------------------------

    def _last_alpha(self) -> float:
        """``alpha_t`` of the most recent averaging update (0 before the first)."""
        last = self.rule.last_update(self.tracker.step)
        return self.rule.alpha(last) if last else 0.0

    def _evaluate(self) -> None:
        """Build the evaluated weights into the EMA model from the model's weights now,
        unless they were built from these very weights (or the model holds them: swapped)."""
        self.tracker.runner.wait()
        if self.__dict__.get("_theta0") is None or self.tracker.swapped:
            return  # still in EMA's constructor, or the model runs on them now
        work = self._work_for(self.tracker.plan())
        built = self._built
        if built is not None and built[0] is work and built[2] == work.versions():
            return
        stash = work.build(self._last_alpha(), None if built is None else built[1])
        self._built = (work, stash, work.versions())

    def _drop_evaluated(self) -> None:
        """Put the plain EMA back into the EMA model and free the stash (if built)."""
        built = self.__dict__.get("_built")
        if built is not None:
            self.tracker.runner.wait()
            built[0].restore(built[1])
            self._built = None

    def _plain_ema(self) -> dict[str, Tensor]:
        """The plain EMA of every corrected tensor, by name (in the stash while the EMA
        model holds the evaluated weights, else the EMA model's own tensors)."""
        work = self._work_for(self.tracker.plan())
        if self._built is not None:
            ema = self._built[0].stashed(self._built[1])
        else:
            ema = {name: work.shadows[i] for name, (_, _, i) in work.where.items()}
        return {name: ema[name] for name in self._theta0}  # the model's order, every rank's

    def _before_read(self) -> None:
        self._evaluate()  # ema_model, ema(x), forward methods, update_model_with_ema

    def swap(self, *, in_place: bool = False) -> Swap:
        """As [`EMA.swap`][emakit.EMA.swap], with the evaluated weights (built on entry)."""
        return _EvaluatedSwap(self, in_place=check.boolean("in_place", in_place))

    def get_current_decay(self) -> float:
        """``1 - beta_t`` of the most recent BEMA update (0 before the first)."""
        last = self.rule.last_update(self.tracker.step)
        return self.rule.decay(last) if last else 0.0

    @property
    def bias_weight(self) -> float:
        """``alpha_t`` of the most recent BEMA update (0 before the first)."""
        return self._last_alpha()

    # -- state -----------------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self._drop_evaluated()
        out = super()._apply(fn, recurse)
        theta0 = getattr(self, "_theta0", {})
        for name, t in theta0.items():  # plain tensors: no autograd
            theta0[name] = fn(t)
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._evaluate()  # ema_model.* hold the evaluated weights
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _CODEC.encode(asdict(self.rule), destination, prefix)  # the settings
        shadows = {p.name: p.shadow for p in self.tracker.plan().pairs}
        for key, store in (("bema_ema.", self._plain_ema()), ("bema_theta0.", self._theta0)):
            for name, t in store.items():
                # a DTensor like its shadow (FSDP2), so distributed checkpoints shard it alike
                shadow = shadows[name]
                value = dtensor_like(t, shadow) if is_dtensor(shadow) else t
                destination[prefix + key + name] = value if keep_vars else value.detach()

    def owns_state_key(self, key: str) -> bool:
        return key.startswith(_KEYS) or super().owns_state_key(key)

    def _load_own_state(
        self, state_dict: Mapping[str, Any], prefix: str, metadata: dict, missing_keys: list[str]
    ) -> None:
        saved = _CODEC.decode(state_dict, prefix, metadata, missing_keys)
        refuse_other_settings("BEMA", saved, asdict(self.rule))
        # The EMA model then loads ``ema_model.*`` (the evaluated weights when saved): the
        # plain EMA waits in the stash until the next update, as after a read.
        self._evaluate()
        with torch.no_grad():
            for key, store in (("bema_ema.", self._plain_ema()), ("bema_theta0.", self._theta0)):
                for name, t in store.items():
                    value = state_dict.get(prefix + key + name)
                    if value is None:
                        missing_keys.append(prefix + key + name)
                    else:
                        t.copy_(local_tensor(value))

    def extra_repr(self) -> str:
        return repr(self.rule)

    def __getstate__(self) -> dict:
        self._drop_evaluated()  # the copy holds the plain EMA; a read builds again
        return {**super().__getstate__(), "_work": None}  # rebuilt on first use


def _spans(work: BEMAWork) -> list[tuple[int, int, torch.dtype]]:
    """Where a work's spans of the EMA model lie: a stash fits works that agree on it."""
    return [(t.data_ptr(), t.numel(), t.dtype) for t in work.ema]


class _EvaluatedSwap(Swap):
    """`Swap` of a BEMA: the evaluated weights are built on every entry."""

    def __init__(self, bema: BEMA, *, in_place: bool) -> None:
        super().__init__(bema.tracker, bema.model, in_place=in_place)
        self.bema = bema

    def enter(self) -> Swap:
        self.bema._evaluate()
        return super().enter()
