"""``KarrasEMA``: the power-function EMA of Karras et al. 2024 (arXiv:2312.02696, §3).

It runs on the same planned engine as [`EMA`][emakit.EMA]; only the decay differs. The
paper's per-step decay ``beta(t) = (1 - 1/t)^(gamma + 1)`` assumes an update at every
step. Updating every ``update_every`` steps with that decay (as ema-pytorch 0.8.3 does)
silently turns the profile into a much longer one. Here each update uses the gap ``dt``
since the previous averaging update,

.. math:: \\beta = \\Big(1 - \\frac{\\Delta t}{t}\\Big)^{\\gamma + 1},

which gives every sample exactly the profile mass of the steps it stands for, so the
averaging profile is the paper's for any ``update_every``
(see [`power_function_beta()`][emakit.posthoc.math.power_function_beta]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._core.frozen import shares
from .._core.state import StateCodec, integer, real
from .._engine.pairs import TensorPair
from .._validate import boolean
from ..decay import DecayRule, PowerDecay
from ..ema import EMA
from ..errors import EMAError, EMAStateError, EMAValueError
from .math import (
    check_gamma,
    check_sigma_rel,
    gamma_to_sigma_rel,
    power_function_beta,
    sigma_rel_to_gamma,
)

__all__ = [
    "KARRAS_STATE_VERSION",
    "KarrasEMA",
    "profile_time",
    "refuse_other_profiles",
    "resolve_profile",
]

#: Version of what `KarrasEMA.state_dict()` adds to EMA's (``gamma``, ``t``, ``dt``, in
#: the module's metadata under ``karras_version``; version 1 wrote them as keys).
KARRAS_STATE_VERSION = 2
_CODEC = StateCodec(
    KARRAS_STATE_VERSION,
    [real("gamma", meta=True), integer("t", meta=True), integer("dt", meta=True)],
    legacy_keys=("gamma", "t", "dt"),
    legacy_version_key="karras_version",
    version_name="karras_version",
)


def profile_time(
    step: int, update_every: int, catch_up_every: int | None = None
) -> tuple[int, int]:
    """``(t, dt)`` of a power-function EMA after ``step`` calls, derived from the step alone.

    Its averaging updates are the first call (the initializing copy), every later call
    ``c`` with ``(c - 1) % update_every == 0``, and, under a [`PostHocEMA`][emakit.PostHocEMA] that
    snapshots every ``catch_up_every`` calls, each multiple of that (the snapshot averages
    in the current weights first). ``t`` is the last of them, ``dt`` its gap to the one
    before (0 after the first call). Used when a state carries no ``t``/``dt`` metadata:
    ema-pytorch's states, or emakit's after the dict was rebuilt.
    """
    if step < 1:
        return 0, 0
    cadence = 1 + update_every * ((step - 1) // update_every)
    events = {1, cadence, cadence - update_every}
    if catch_up_every:
        snap = step - step % catch_up_every
        events |= {snap, snap - catch_up_every}
    last, *before = sorted((e for e in events if 1 <= e <= step), reverse=True)
    return last, (last - before[0]) if before else 0


def resolve_profile(sigma_rel: object, gamma: object) -> tuple[float, float]:
    """``(sigma_rel, gamma)`` from exactly one of them, validated.

    Raises:
        EMAValueError: both or neither given, or a value out of range (see
            [`sigma_rel_to_gamma()`][emakit.posthoc.math.sigma_rel_to_gamma]).
    """
    if (sigma_rel is None) == (gamma is None):
        raise EMAValueError(
            f"give exactly one of sigma_rel (relative EMA length, e.g. 0.05) and gamma "
            f"(its exponent), got {sigma_rel=!r} and {gamma=!r}"
        )
    if sigma_rel is not None:
        s = check_sigma_rel(sigma_rel)
        return s, sigma_rel_to_gamma(s)
    g = check_gamma(gamma)
    return gamma_to_sigma_rel(g), g


def refuse_other_profiles(
    kind: str, saved: Sequence[float] | None, mine: Sequence[float], *, several: bool
) -> None:
    """Refuse a state that a ``kind`` (``"KarrasEMA"``, ``"PostHocEMA"``) saved with other
    profiles than ``mine``, its gammas (one, or ``several``), compared to a relative 1e-9.
    A state that records none (ema-pytorch's) is not compared.

    Raises:
        EMAStateError: naming both sides' ``sigma_rel(s)`` and ``gamma(s)``, and the
            keyword to build the ``kind`` with to load the state.
    """
    if saved is None or (
        len(saved) == len(mine)
        and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(saved, mine, strict=True))
    ):
        return
    s_name, g_name = ("sigma_rels", "gammas") if several else ("sigma_rel", "gamma")

    def values(gammas: Sequence[float]) -> tuple[object, object]:
        """(sigma_rel(s) or None, gamma(s)) as a keyword would take them."""
        gs = tuple(float(g) for g in gammas)
        try:  # 12 decimals rebuild the same gammas to well within 1e-9
            srs: tuple[float, ...] | None = tuple(round(gamma_to_sigma_rel(g), 12) for g in gs)
        except EMAError:  # a recorded gamma no profile has
            srs = None
        if several:
            return srs, gs
        return (None if srs is None else srs[0]), gs[0]

    def text(gammas: Sequence[float]) -> str:
        srs, gs = values(gammas)
        return f"{g_name}={gs!r}" if srs is None else f"{s_name}={srs!r} ({g_name}={gs!r})"

    srs, gs = values(saved)
    keyword = f"{g_name}={gs!r}" if srs is None else f"{s_name}={srs!r} or {g_name}={gs!r}"
    raise EMAStateError(
        f"state_dict is of a {kind} with {text(saved)}, but this {kind} has {text(mine)}; "
        f"build the {kind} with the profile{'s' if several else ''} the state was saved "
        f"with: {keyword}"
    )


class KarrasEMA(EMA):
    """A power-function EMA (arXiv:2312.02696, §3): averages the weights with profile
    ``p_t(tau) ∝ tau^gamma``, so its length grows with training time.

    Keyword-compatible with ``ema_pytorch.KarrasEMA`` 0.8.3, with its decay fixed for
    ``update_every > 1``. As in ema-pytorch, the first `update()` copies the model and
    later calls do work when ``(step - 1) % update_every == 0``. An update at call ``t``
    that comes ``dt`` calls after the previous averaging update applies

    .. math:: \\hat\\theta \\leftarrow \\beta\\,\\hat\\theta + (1 - \\beta)\\,\\theta,\\qquad
       \\beta = \\Big(1 - \\frac{\\Delta t}{t}\\Big)^{\\gamma + 1}.

    Args:
        model: the online (training) module.
        sigma_rel: the relative EMA length (width of the profile over training time), in
            ``(0, SIGMA_REL_MAX]`` (~0.30028); typical values 0.05 to 0.2. Above
            ``1/sqrt(12)`` gamma is negative (ema-pytorch's root): the profile weighs early
            iterates more than the latest. Give this or ``gamma``.
        gamma: the profile exponent, ``>= GAMMA_MIN`` (~ -0.382); ``sigma_rel`` is derived
            from it by the paper's formula. Give this or ``sigma_rel``.
        ema_model: a module to hold the EMA weights, or a zero-argument factory. Default
            None: a copy of ``model``.
        update_every: only every ``update_every``-th call averages. Default 100.
        frozen: never average after the first copy. Default False.
        param_or_buffer_names_no_ema: names copied instead of averaged. Default ().
        ignore_names: names never touched. Default ().
        ignore_startswith_names: name prefixes never touched. Default ().
        allow_different_devices: allow EMA tensors on another device. Default False.
        move_ema_to_online_device: move the EMA model to the model's device at update
            time. Default False.
        use_foreach: keyword-only; engine path as for [`EMA`][emakit.EMA]. Default None.
        ema_dtype: keyword-only; keep floating EMA tensors in this dtype (e.g.
            ``torch.float32`` for a bf16 model). Default None.
        skip_nonfinite: keyword-only; skip updates with NaN/Inf weights, as for
            [`EMA`][emakit.EMA]. Default False.
        device: keyword-only; where the EMA lives, as for [`EMA`][emakit.EMA].
            Default None.
        async_update: keyword-only; average on a background thread, as for
            [`EMA`][emakit.EMA]. Default None.
        share_frozen: keyword-only; frozen parameters shared with the model rather than
            copied, as for [`EMA`][emakit.EMA]. Default False.
        watch_model: keyword-only; watch the model's registries through a dict subclass
            (alters the model), as for [`EMA`][emakit.EMA]. Default False.
        partition: keyword-only; keep only this rank's slice of every parameter of a
            model replicated over the ranks, as for [`EMA`][emakit.EMA] (a DeepSpeed
            ZeRO-3 model is partitioned anyway). Default False.

    Raises:
        EMAValueError: both or neither of ``sigma_rel``/``gamma``, NaN, ``sigma_rel <= 0``
            or above ``SIGMA_REL_MAX`` (no gamma), ``gamma < GAMMA_MIN``.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = KarrasEMA(net, sigma_rel=0.1, update_every=1)
        >>> round(ema.gamma, 3)
        6.937
        >>> for _ in range(3):
        ...     ema.update()
        >>> round(ema.get_current_decay(), 5)  # (1 - 1/3) ** (gamma + 1)
        0.04002
    """

    def __init__(
        self,
        model: nn.Module,
        sigma_rel: float | None = None,
        gamma: float | None = None,
        ema_model: nn.Module | Callable[[], nn.Module] | None = None,
        update_every: int = 100,
        frozen: bool = False,
        param_or_buffer_names_no_ema: Iterable[str] = (),
        ignore_names: Iterable[str] = (),
        ignore_startswith_names: Iterable[str] = (),
        allow_different_devices: bool = False,
        move_ema_to_online_device: bool = False,
        *,
        use_foreach: bool | None = None,
        ema_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        device: torch.device | str | None = None,
        async_update: bool | None = None,
        share_frozen: bool = False,
        partition: bool = False,
        watch_model: bool = False,
    ) -> None:
        self.sigma_rel, self.gamma = resolve_profile(sigma_rel, gamma)
        boolean("frozen", frozen)
        super().__init__(
            model,
            ema_model=ema_model,
            update_after_step=0,
            update_every=update_every,
            include_online_model=False,  # as ema-pytorch's KarrasEMA
            param_or_buffer_names_no_ema=param_or_buffer_names_no_ema,
            ignore_names=ignore_names,
            ignore_startswith_names=ignore_startswith_names,
            allow_different_devices=allow_different_devices,
            use_foreach=use_foreach,
            move_ema_to_online_device=move_ema_to_online_device,
            ema_dtype=ema_dtype,
            skip_nonfinite=skip_nonfinite,
            device=device,
            async_update=async_update,
            share_frozen=share_frozen,
            partition=partition,
            watch_model=watch_model,
        )
        self.frozen = frozen
        self.t_from_step = False  # see _load_own_state
        self.tracker.rule = DecayRule(
            [PowerDecay(self.gamma, power_function_beta)],
            update_every=self.update_every,
            update_after_step=0,
            frozen=frozen,
        )

    # -- decay ----------------------------------------------------------------------------

    @property  # type: ignore[override]
    def beta(self) -> float:
        """The decay of the most recent averaging update (ema-pytorch's ``KarrasEMA.beta``)."""
        return self.get_current_decay()

    @beta.setter
    def beta(self, value: float) -> None:
        # EMA stores the ceiling of its inverse-gamma warm-up here; the power-function
        # decay has none, so the value is only kept for reference.
        self._beta_ceiling = value

    @property
    def t(self) -> int:
        """The step the averaging profile ends at: the last update that touched the weights."""
        return self.tracker.last

    def get_current_decay(self) -> float:
        """The decay the most recent averaging update used (0 before any, and for the
        first call's copy).

        .. math:: \\beta = \\Big(1 - \\frac{\\Delta t}{t}\\Big)^{\\gamma + 1}

        with ``t`` the call that updated and ``dt`` the calls since the update before.
        """
        t = self.tracker
        if t.gap <= 0:
            return 0.0
        return power_function_beta(t.last, t.gap, self.gamma)

    def current_decays(self) -> dict[str, float]:
        """``{"default": get_current_decay()}`` (a power-function EMA has one group)."""
        return {"default": self.get_current_decay()}

    def _averages(self, name: str) -> bool:
        """Whether the tensor ``name`` of the EMA model is averaged: neither ignored nor
        copied (its dtype aside)."""
        skip = self.param_or_buffer_names_no_ema | self.ignore_names
        return name not in skip and not name.startswith(tuple(self.ignore_startswith_names))

    def averaged_names(self) -> set[str]:
        """Names of the EMA model's parameters that are averaged (floating, neither ignored
        nor copied); a snapshot records the others as copied."""
        params = self.ema_model.named_parameters(remove_duplicate=False)
        return {
            n for n, p in params if (p.is_floating_point() or p.is_complex()) and self._averages(n)
        }

    def shared_names(self) -> frozenset[str]:
        """Names of the EMA model's parameters that are the model's own storage (frozen
        weights shared with it, see ``share_frozen``): their value is the model's, so a
        post-hoc snapshot stores them once for all the steps they stay the same (see
        [`emakit.posthoc.snapshots.frozen`][emakit.posthoc.snapshots.frozen])."""
        online = dict(self.model.named_parameters(remove_duplicate=False))
        return frozenset(
            n
            for n, s in self.ema_model.named_parameters(remove_duplicate=False)
            if n in online and shares(TensorPair(n, s, online[n], True))
        )

    def iter_all_ema_params_and_buffers(self) -> Iterator[Tensor]:
        """The EMA model's averaged tensors: floating parameters and buffers that are
        neither ignored nor copied (ema-pytorch's method)."""
        named = (*self.get_params_iter(self.ema_model), *self.get_buffers_iter(self.ema_model))
        return (t for name, t in named if self._averages(name))

    def catch_up(self) -> None:
        """Average in the current weights if the last averaging update was before the
        current step, so the profile ends exactly at ``step`` (used before a snapshot).

        Exact for the power-function profile: the new sample gets the mass of the gap.
        """
        self.tracker.catch_up()

    # -- state ----------------------------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        t = self.tracker
        _CODEC.encode({"gamma": self.gamma, "t": t.last, "dt": t.gap}, destination, prefix)

    def owns_state_key(self, key: str) -> bool:
        return key in _CODEC.keys or super().owns_state_key(key)

    def _load_own_state(
        self, state_dict: Mapping[str, Any], prefix: str, metadata: dict, missing_keys: list[str]
    ) -> None:
        values = _CODEC.decode(state_dict, prefix, metadata, missing_keys)
        saved = values.get("gamma")
        refuse_other_profiles(
            "KarrasEMA", None if saved is None else [saved], [self.gamma], several=False
        )
        t = self.tracker
        #: Whether t/dt were derived from the step (no metadata: see profile_time).
        self.t_from_step = "t" not in values
        if "t" in values:
            t.last, t.gap = values["t"], values.get("dt", 0)
        else:  # ema-pytorch's states carry only the step
            t.last, t.gap = profile_time(t.step, int(self.update_every))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The EMA state, versioned; the online model is left out.

        Layout (``version`` 1, ``karras_version`` 1), for ``KarrasEMA(nn.Linear(2, 2), sigma_rel=0.1)``::

            {
                "version": tensor(1),             # EMA layout version
                "step": tensor(1000),             # update() calls so far
                "initted": tensor(True),
                "karras_version": tensor(1),      # layout of the keys below
                "gamma": tensor(6.9372, dtype=torch.float64),
                "t": tensor(901),                 # step of the last averaging update
                "dt": tensor(100),                # the gap that update covered
                "ema_model.weight": tensor(...),
                "ema_model.bias": tensor(...),
            }

        Loading checks ``gamma`` against this EMA's. ema-pytorch 0.8.3 ``KarrasEMA``
        states (no ``t``) load too.
        """
        return super().state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"sigma_rel={self.sigma_rel:.6g}, gamma={self.gamma:.6g}, update_every={self.update_every}"
