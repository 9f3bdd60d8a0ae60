"""``BEMA``: the bias-corrected EMA of Block et al. 2025 ("EMA Without the Lag",
arXiv:2508.00180), with the numbers of TRL's ``BEMACallback``.

An EMA lags the weights it averages; BEMA adds back a multiple of how far the weights
moved since a reference point, which removes the lag's bias at early times:

.. math:: \\text{ema}_t = (1 - \\beta_t)\\,\\text{ema}_{t-1} + \\beta_t\\,\\theta_t,\\qquad
   \\hat\\theta_t = \\text{ema}_t + \\alpha_t\\,(\\theta_t - \\theta_0)

with ``beta_t = max((lag + multiplier t)^-ema_power, min_ema_multiplier)`` and
``alpha_t = (lag + multiplier t)^-bias_power`` (see [`BEMARule`][emakit.decay.BEMARule]).
It is an EMA kind like the others: the decay rule is pure, the update a fused piece of
work on the same runners (inline, background thread, offloaded to the CPU), the state one
versioned codec next to ema-pytorch's keys, and ``swap()``, ``ema(x)`` and the exports
read the evaluated weights ``theta_hat``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import Tensor, nn

from ._core.state import StateCodec, integer, real, refuse_other_settings
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


class BEMA(EMA):
    """A bias-corrected EMA (BEMA, arXiv:2508.00180) in TRL's parameterization.

    Call `update()` after every optimizer step, as for an [`EMA`][emakit.EMA]. ``t``
    is the number of `update()` calls, which is TRL's ``state.global_step``. At
    construction (TRL: ``on_train_begin``) ``theta0``, the EMA and the evaluated weights
    are the model's weights. Then, at call ``t``:

    * ``t < update_after``: nothing;
    * ``t == update_after``: ``theta0``, the EMA and the evaluated weights become
      ``theta_t`` (TRL keeps its evaluated copy from ``on_train_begin`` until the first
      averaging update instead; the paper's BEMA at ``tau`` is ``theta_tau``, as here);
    * ``(t - update_after) % update_freq == 0``: ``ema.lerp_(theta_t, beta_t)``, then the
      evaluated weights ``ema + alpha_t * (theta_t - theta0)``; between updates they hold.

    The paper (Algorithm 1) counts ``t`` from the burn-in, ``beta_t = (rho + gamma (t -
    tau))^-kappa``; TRL, and so this class, count it from the start of training, which
    differs when ``update_after > 0``.

    **Memory**: three copies of the averaged tensors, on ``device``: ``theta0`` and the
    EMA (BEMA's state), and the evaluated weights (the EMA model itself: what
    `swap()`, ``ema(x)`` and the exports read, computed at each update from that
    step's ``theta_t`` as TRL's ``running_model`` is), plus one staging buffer when the
    EMA lives on another device or dtype than the model.

    **State**: `state_dict()` has [`EMA.state_dict`][emakit.EMA.state_dict]'s keys
    (``ema_model.*`` holds the evaluated weights), plus the EMA and ``theta0`` of every
    averaged tensor, and the settings in the module's metadata (``bema_version`` 1); for
    ``BEMA(nn.Linear(2, 2))``::

        {
            "initted": tensor(True),
            "step": tensor(800),
            "ema_model.weight": tensor(...),     # ema + alpha_t * (theta_t - theta0)
            "ema_model.bias": tensor(...),
            "bema_ema.weight": tensor(...),      # the plain EMA
            "bema_ema.bias": tensor(...),
            "bema_theta0.weight": tensor(...),   # the weights at update_after
            "bema_theta0.bias": tensor(...),
        }

    A resumed BEMA continues bit for bit. Loading refuses a state saved with other
    settings (when the metadata is there).

    Args:
        model: the online (training) module.
        update_freq: calls between BEMA updates (``phi``). Default 400.
        ema_power: the EMA weight's exponent (``kappa``); 0 disables the EMA. Default 0.5.
        bias_power: the bias weight's exponent (``eta``); 0 keeps ``alpha_t = 1``.
            Default 0.2.
        lag: the offset ``rho`` of both schedules. Default 10.
        update_after: the burn-in ``tau``, in calls. Default 0.
        multiplier: the time scale ``gamma``, > 0. Default 1.0.
        min_ema_multiplier: the floor of ``beta_t``, in [0, 1]. Default 0.0.
        ema_model: keyword-only; a module (or factory) to hold the evaluated weights; the
            model's weights are copied into it. Default None: a copy of ``model``.
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
        )
        self.rule = self.tracker.rule = rule
        #: BEMA's state by the prefix of its keys: the plain EMA and ``theta0``, by name.
        self._state: dict[str, dict[str, Tensor]] = {"bema_ema.": {}, "bema_theta0.": {}}
        self._work: tuple[Plan, BEMAWork] | None = None
        self.tracker.work = self._work_for  # the runner is handed BEMA's work for a plan
        self.copy_params_from_model_to_ema()  # lays out theta0 and the EMA: = the model now
        self.tracker.set_counters(initted=True)

    def copy_params_from_model_to_ema(self) -> None:
        """Restart BEMA from the model's current weights: ``theta0``, the EMA and the
        evaluated weights all become a copy of the model (the counters are kept)."""
        self.tracker.runner.wait()
        self._work_for(self.tracker.plan()).run(Action("copy", call=self.tracker.step))

    def _work_for(self, plan: Plan) -> BEMAWork:
        """The BEMA work over ``plan``'s pairs (built again when the plan is new), which the
        tracker hands its runner (inline, thread or stream) instead of the plan."""
        if self._work is None or self._work[0] is not plan or self._work[1].thawed():
            ema, theta0 = self._state.values()
            gone = sorted(ema.keys() - {p.name for p in plan.pairs})
            if gone:  # the model changed: the state cannot follow
                raise EMAStateError(
                    f"the model's averaged tensors changed under this BEMA ({gone[:5]} are "
                    f"gone); build a new BEMA for the new model"
                )
            # New entries (all of them at first, then a frozen weight trained again) start
            # from the shadow's value, laid out like the shadows (the same spans), keyed in
            # the model's order (the same on every rank), not memory order.
            new = [p for p in state_order(plan.pairs) if p.name not in ema]
            shadows = [local_tensor(p.shadow) for p in new]
            for store in (ema, theta0):
                tensors = [torch.empty(0, dtype=s.dtype, device=s.device) for s in shadows]
                rehome_(tensors, sources=shadows)
                by_name = {p.name: t for p, t in zip(new, tensors, strict=True)}
                store.update((p.name, by_name[p.name]) for p in plan.pairs if p.name in by_name)
            self._work = (plan, BEMAWork(plan, ema, theta0))
        return self._work[1]

    def get_current_decay(self) -> float:
        """``1 - beta_t`` of the most recent BEMA update (0 before the first)."""
        return self.rule.decay(self.tracker.last) if self.tracker.last > 0 else 0.0

    @property
    def bias_weight(self) -> float:
        """``alpha_t`` of the most recent BEMA update (0 before the first)."""
        return self.rule.alpha(self.tracker.last) if self.tracker.last > 0 else 0.0

    # -- state -----------------------------------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        out = super()._apply(fn, recurse)
        for store in getattr(self, "_state", {}).values():  # plain tensors: no autograd
            for name, t in store.items():
                store[name] = fn(t)
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _CODEC.encode(asdict(self.rule), destination, prefix)  # the settings
        shadows = {p.name: p.shadow for p in self.tracker.plan().pairs}
        for key, store in self._state.items():
            for name, t in store.items():
                # a DTensor like its shadow (FSDP2), so distributed checkpoints shard it alike
                shadow = shadows[name]
                value = dtensor_like(t, shadow) if is_dtensor(shadow) else t
                destination[prefix + key + name] = value if keep_vars else value.detach()

    def owns_state_key(self, key: str) -> bool:
        return key.startswith(tuple(self._state)) or super().owns_state_key(key)

    def _load_own_state(
        self, state_dict: Mapping[str, Any], prefix: str, metadata: dict, missing_keys: list[str]
    ) -> None:
        saved = _CODEC.decode(state_dict, prefix, metadata, missing_keys)
        refuse_other_settings("BEMA", saved, asdict(self.rule))
        with torch.no_grad():
            for key, store in self._state.items():
                for name, t in store.items():
                    value = state_dict.get(prefix + key + name)
                    if value is None:
                        missing_keys.append(prefix + key + name)
                    else:
                        t.copy_(local_tensor(value))

    def extra_repr(self) -> str:
        return repr(self.rule)

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_work": None}  # rebuilt on first use
