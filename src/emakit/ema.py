"""``EMA``: an exponential moving average of a module's weights, ema-pytorch compatible.

The wrapper keeps only bookkeeping (the call counter, the configuration, which tensors
are tracked, the state dict); the arithmetic lives in :mod:`emakit.engine`, which walks
the model once into a :class:`~emakit.engine.Plan` and then touches only its pre-grouped
tensor lists on every update.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from . import distributed as _dist
from .engine import Plan, TensorPair, build_plan
from .engine.flat import rehome_
from .engine.kernels import Impl
from .engine.offload import BackgroundWorker, StreamWorker
from .errors import EMARuntimeError, EMAStateError, EMATypeError, EMAValueError
from .schedules import inverse_gamma_float32

__all__ = ["EMA", "STATE_VERSION"]

#: Version of the layout that :meth:`EMA.state_dict` writes (see its docstring).
STATE_VERSION = 1
_META_KEYS = ("version", "step", "initted", "num_skipped_nonfinite")


class _Handles:
    """Several hook handles removed together."""

    def __init__(self, *handles: Any, on_remove: Callable[[], None] | None = None) -> None:
        self.handles = handles
        self.on_remove = on_remove

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.on_remove is not None:
            self.on_remove()


def _as_device(device: object) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as e:
            raise EMAValueError(
                f"device must name a torch device such as 'cpu', got {device=!r}"
            ) from e
    raise EMATypeError(f"device must be a str or torch.device, got {device=!r}")


class _Step(int):
    """The call counter: an ``int`` that also answers ``.item()`` like ema-pytorch's tensor."""

    def item(self) -> int:
        return int(self)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that holds the weights: strips DDP/DataParallel ``.module`` and
    ``torch.compile``'s ``_orig_mod`` wrappers (in any nesting)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


class _EMABase(nn.Module):
    """Bookkeeping shared by :class:`EMA` and :class:`~emakit.EMAPytree`: the step logic,
    the decay, the plan, ``swap()`` and the versioned state."""

    _plan: Plan | None

    def _configure(
        self,
        *,
        beta: float,
        update_after_step: int,
        update_every: int,
        inv_gamma: float,
        power: float,
        min_value: float,
        allow_different_devices: bool,
        use_foreach: bool | None,
        coerce_dtype: bool,
        ema_dtype: torch.dtype | None,
        schedule: Callable[[int], float] | None,
        skip_nonfinite: bool = False,
        async_update: bool = False,
    ) -> None:
        self.beta = check.real("beta", beta, low=0.0, high=1.0)
        self.update_after_step = check.integer("update_after_step", update_after_step, low=0)
        self.update_every = check.integer("update_every", update_every, low=1)
        self.inv_gamma = check.real("inv_gamma", inv_gamma, low=0.0, low_open=True)
        self.power = check.real("power", power, low=0.0, low_open=True)
        self.min_value = check.real("min_value", min_value, low=0.0, high=1.0)
        if self.min_value > self.beta and schedule is None:
            raise EMAValueError(
                f"min_value must not exceed beta, got {min_value=} > {beta=}; lower min_value"
            )
        self.allow_different_devices = check.boolean(
            "allow_different_devices", allow_different_devices
        )
        self.use_foreach = check.optional_boolean("use_foreach", use_foreach)
        self.coerce_dtype = check.boolean("coerce_dtype", coerce_dtype)
        self.ema_dtype = check.floating_dtype("ema_dtype", ema_dtype)
        if schedule is not None and not callable(schedule):
            raise EMATypeError(
                f"schedule must be a callable t -> decay (see emakit.schedules), got {schedule=!r}"
            )
        self.schedule = schedule
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        self.num_skipped_nonfinite = 0
        self.async_update = check.boolean("async_update", async_update)
        # (plan, parameter plan, buffer plan) once an optimizer pre-step hook allows
        # zero-copy background updates (see add_to_optimizer_post_step_hook); else None.
        self._live: tuple[Any, Any, Any] | None = None
        self._worker: BackgroundWorker | StreamWorker | None = (
            BackgroundWorker() if self.async_update else None
        )
        # Decay functions by decay group; group 0 is the default (beta/inv_gamma/power or
        # schedule). EMA(decay_groups=...) appends more.
        self._group_decays: list[Callable[[int], float] | float | None] = [None]
        # beta == 1 freezes the EMA; with a schedule, beta is unused and the schedule rules.
        self.is_frozen = self.beta == 1.0 and schedule is None
        impls: dict[bool | None, Impl] = {None: "flat", True: "foreach", False: "loop"}
        self._impl: Impl = impls[self.use_foreach]
        self._step = 0
        self._guards: list[tuple[dict, str, Tensor]] = []
        self._initted = False
        self._swapped = False
        self._plan = None

    # -- counters -------------------------------------------------------------------

    @property
    def step(self) -> _Step:
        """Number of ``update()`` calls so far (an ``int``; ``.item()`` also works)."""
        return _Step(self._step)

    @property
    def initted(self) -> Tensor:
        """Whether the first ``update()`` has copied the model into the EMA."""
        return torch.tensor(self._initted)

    # -- decay ----------------------------------------------------------------------

    def _decay_at(self, step: int, group: int = 0) -> float:
        t = max(step - self.update_after_step - 1, 0)
        rule = self._group_decays[group] if group else self.schedule
        if rule is None or isinstance(rule, float):
            beta = self.beta if rule is None else rule
            if beta == 1.0 and group:
                return 1.0  # a frozen group
            return inverse_gamma_float32(
                t,
                beta=beta,
                inv_gamma=self.inv_gamma,
                power=self.power,
                min_value=min(self.min_value, beta),
            )
        if t <= 0:
            return 0.0
        decay = float(rule(t))
        if not 0.0 <= decay <= 1.0:  # also catches NaN
            raise EMAValueError(
                f"the decay schedule {rule!r} returned {decay!r} at t={t}; a decay must be in [0, 1]"
            )
        if getattr(rule, "per_optimizer_step", False):
            decay **= self.update_every
        return min(max(decay, self.min_value), 1.0)

    def _weights_at(self, step: int) -> list[float]:
        return [1.0 - self._decay_at(step, g) for g in range(len(self._group_decays))]

    def get_current_decay(self) -> float:
        """The decay the most recent update used (ema-pytorch's definition).

        .. math:: t = \\max(\\text{step} - \\text{update\\_after\\_step} - 1, 0),\\quad
           \\text{decay} = \\text{clamp}(1 - (1 + t / \\text{inv\\_gamma})^{-\\text{power}},
           \\text{min\\_value}, \\beta)

        and 0 while ``t == 0``. With ``schedule=`` set, ``schedule(t)`` replaces the formula.
        With ``decay_groups``, this is the default group's decay (see :meth:`current_decays`).
        """
        return self._decay_at(self._step)

    def current_decays(self) -> dict[str, float]:
        """The decay of every decay group at the current step: ``{"default": d, pattern: d}``."""
        labels = ["default", *getattr(self, "_group_patterns", [])]
        return {label: self._decay_at(self._step, g) for g, label in enumerate(labels)}

    # -- plan -----------------------------------------------------------------------

    def _pairs(self) -> list[TensorPair]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _buffer_guards(self) -> list[tuple[dict, str, Tensor]]:
        return []

    def _ensure_plan(self) -> Plan:
        plan = self._plan
        if plan is None or self._stale(plan):
            self._sync()
            plan = self._plan = build_plan(
                self._pairs(), self._impl, staged=self._worker is not None
            )
            self._guards = self._buffer_guards()
        return plan

    def _stale(self, plan: Plan) -> bool:
        if any(d.get(n) is not t for d, n, t in self._guards):
            return True
        return plan.stale()

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        # .to()/.cuda()/.half() replace storages: the plan is rebuilt on next use.
        self._sync()
        self._plan = None
        return super()._apply(fn, recurse)

    def _before_update(self) -> None:
        """Hook run on updates that touch the weights (after the skip test)."""

    # -- the update -----------------------------------------------------------------

    def update(self) -> None:
        """Advance the EMA by one training step; call it after every ``optimizer.step()``.

        The first call copies the model into the EMA. After that, a call does work only
        when ``(step - 1) % update_every == 0`` (``step`` counted after the call): a plain
        copy while ``step - 1 <= update_after_step``, then
        ``ema.lerp_(model, 1 - decay)``. Skipped calls cost one integer compare; no call
        reads a value back from an accelerator.
        """
        if self._swapped:
            raise EMARuntimeError("update() was called inside swap(); leave the swap() block first")
        step = self._step
        # Straight into the instance dict: nn.Module.__setattr__ would cost ~1.5 us, most of
        # a skipped call.
        self.__dict__["_step"] = step + 1
        if not self._initted:
            self._first_update()
            return
        if step % self.update_every:
            return
        self._before_update()
        plan = self._ensure_plan()
        if self.skip_nonfinite and not self._online_finite(plan):
            return
        worker = self._worker
        weights = None if step <= self.update_after_step else self._weights_at(step + 1)
        if worker is None:
            if weights is None:
                plan.copy_to_shadow()
            elif not self.is_frozen:
                plan.lerp_shadow(weights)
        elif weights is None or not self.is_frozen:
            if self._live is not None and isinstance(worker, BackgroundWorker):
                self._submit_live(plan, weights)
            else:
                worker.submit(plan, weights)
        if weights is not None:
            self._after_average(step)

    def _submit_live(self, plan: Plan, weights: list[float] | None) -> None:
        # Zero-copy background update, possible once an optimizer pre-step hook guarantees
        # that no step writes the weights while the worker reads them: buffers (which the
        # next forward may write, e.g. BatchNorm statistics) are updated here and now, the
        # parameters on the worker straight from the live tensors.
        live = self._live
        if live is None or live[0] is not plan or live[1].stale() or live[2].stale():
            params = [p for p in plan.pairs if not p.buffer]
            buffers = [p for p in plan.pairs if p.buffer]
            live = self._live = (
                plan,
                build_plan(params, self._impl),
                build_plan(buffers, self._impl),
            )
        _, params_plan, buffers_plan = live
        worker: BackgroundWorker = self._worker  # type: ignore[assignment]
        worker.wait()
        if weights is None:
            buffers_plan.copy_to_shadow()
            worker.run(params_plan.copy_to_shadow)
        else:
            buffers_plan.lerp_shadow(weights)
            worker.run(params_plan.lerp_shadow, weights)

    def _sync(self) -> None:
        """Wait for a background update in flight (``async_update=True``); no-op otherwise."""
        worker = self.__dict__.get("_worker")
        if worker is not None and worker.pending:
            worker.wait()

    def _online_finite(self, plan: Plan) -> bool:
        if plan.online_finite():
            return True
        self.num_skipped_nonfinite += 1
        if self.num_skipped_nonfinite == 1:
            warnings.warn(
                f"skipped an EMA update at step {self._step}: the model's weights hold NaN or Inf "
                f"(skip_nonfinite=True; further skips are counted in num_skipped_nonfinite)",
                RuntimeWarning,
                stacklevel=3,
            )
        return False

    def _after_average(self, step: int) -> None:
        """Hook run after an averaging update (pre-increment ``step``)."""

    def _first_update(self) -> None:
        self._sync()
        self._before_update()
        plan = self._ensure_plan()
        if self.skip_nonfinite and not self._online_finite(plan):
            return
        plan.copy_to_shadow()
        self._initted = True

    def copy_params_from_model_to_ema(self) -> None:
        """Copy every tracked tensor of the model into the EMA (ignored names untouched)."""
        self._sync()
        self._ensure_plan().copy_to_shadow()

    def copy_params_from_ema_to_model(self) -> None:
        """Copy every tracked tensor of the EMA into the model (ignored names untouched)."""
        self._sync()
        self._ensure_plan().copy_to_online()

    # -- swap -----------------------------------------------------------------------

    @contextlib.contextmanager
    def swap(self) -> Iterator[None]:
        """Inside the block the online model holds the EMA weights; afterwards its own.

        Tensors whose shadow has the same dtype and device are swapped by reference
        (``.data`` re-pointing): no weight is copied and no memory is allocated. Tensors
        whose shadow differs (``ema_dtype``, another device) are cast into a temporary.
        The original weights come back on exit, also when the block raises.

        Example:
            >>> net = torch.nn.Linear(2, 2)
            >>> ema = EMA(net, beta=0.9)
            >>> with ema.swap():
            ...     _ = net(torch.zeros(1, 2))  # runs on the EMA weights
        """
        if self._swapped:
            raise EMARuntimeError("swap() blocks cannot be nested")
        self._sync()
        plan = self._ensure_plan()
        stash: list[tuple[Tensor, Tensor]] = []
        try:
            with torch.no_grad():
                for p in plan.pairs:
                    online, shadow = p.online, p.shadow
                    if _dist.is_dtensor(online):
                        continue  # FSDP2 gathers from its own storage: swap_sharded copies
                    stash.append((online, online.data))
                    if online.dtype == shadow.dtype and online.device == shadow.device:
                        online.data = shadow.data
                    else:
                        online.data = shadow.data.to(online.device, online.dtype)
            with _dist.swap_sharded(getattr(self, "model", None), plan.pairs):
                self._swapped = True
                yield
        finally:
            for online, data in reversed(stash):
                online.data = data
            self._swapped = False

    # -- state ------------------------------------------------------------------------

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._sync()
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "version"] = torch.tensor(STATE_VERSION)
        destination[prefix + "step"] = torch.tensor(self._step)
        destination[prefix + "initted"] = torch.tensor(self._initted)
        if self.skip_nonfinite:
            destination[prefix + "num_skipped_nonfinite"] = torch.tensor(self.num_skipped_nonfinite)

    def _load_meta(
        self, state_dict: Mapping[str, Any], prefix: str, missing_keys: list[str]
    ) -> None:
        check.not_newer("state_dict", "version", state_dict.get(prefix + "version"), STATE_VERSION)
        for key in ("step", "initted"):
            if prefix + key not in state_dict:
                missing_keys.append(prefix + key)
        if prefix + "step" in state_dict:
            self._step = int(state_dict[prefix + "step"])
        if prefix + "initted" in state_dict:
            self._initted = bool(state_dict[prefix + "initted"])
        if prefix + "num_skipped_nonfinite" in state_dict:
            self.num_skipped_nonfinite = int(state_dict[prefix + "num_skipped_nonfinite"])

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        self._sync()
        self._load_meta(state_dict, prefix, missing_keys)
        before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        ours = {prefix + k for k in _META_KEYS}
        unexpected_keys[before:] = [
            k
            for k in unexpected_keys[before:]
            if k not in ours and not self._ignorable_key(k[len(prefix) :])
        ]

    def _ignorable_key(self, key: str) -> bool:
        return False

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state written by :meth:`state_dict` (or by ema-pytorch 0.8.3).

        Values are copied into the existing shadow tensors, so the shadow keeps its dtype
        (an fp32 shadow stays fp32 when loading an fp16 checkpoint). With ``strict=True``
        (default) any missing or unexpected key raises :class:`~emakit.EMAStateError`
        listing them.
        """
        if not isinstance(state_dict, Mapping):
            raise EMATypeError(
                f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
            )
        if assign:
            raise EMAValueError(
                "assign=True is not supported: the EMA keeps its own shadow storage"
            )
        try:
            result = super().load_state_dict(state_dict, strict=strict)
        except RuntimeError as e:
            raise EMAStateError(
                f"{e}\nThe EMA's own keys are: {sorted(self.state_dict())[:20]}"
            ) from e
        self._plan = None
        return result

    def __getstate__(self) -> dict:
        self._sync()
        state = self.__dict__.copy()
        state["_plan"] = None  # rebuilt on first use; it only holds references
        state["_live"] = None  # a copy has no optimizer hooks
        state["_guards"] = []
        state["_swapped"] = False
        return state


class EMA(_EMABase):
    """An exponential moving average of a module's parameters and buffers.

    Keyword-compatible with ``ema_pytorch.EMA`` 0.8.3: the same names, defaults and
    numbers for the same sequence of calls. Call :meth:`update` after every optimizer
    step; call the wrapper (``ema(x)``) to run the EMA model in eval mode without grad;
    use :meth:`swap` to evaluate the online model on the EMA weights in place.

    Args:
        model: the online (training) module. DDP/DataParallel and ``torch.compile``
            wrappers are unwrapped. A tensor or a nested dict/list/tuple of tensors makes
            an :class:`~emakit.EMAPytree` instead.
        ema_model: a module to hold the EMA weights, or a zero-argument factory returning
            one. Default None: a copy of ``model`` (parameters and buffers only; gradients
            are not copied).
        beta: the ceiling of the decay, in [0, 1]; ``1.0`` freezes the EMA (a frozen
            teacher). Default 0.9999.
        update_after_step: while ``step <= update_after_step`` an update copies the model
            instead of averaging. Default 100.
        update_every: only every ``update_every``-th call does work. Default 10.
        inv_gamma: warm-up scale, > 0. Default 1.0.
        power: warm-up exponent, > 0. Default 2/3.
        min_value: the floor of the decay. Default 0.0.
        param_or_buffer_names_no_ema: names copied from the model on every update instead
            of averaged. Default ().
        ignore_names: names never touched by any path. Default ().
        ignore_startswith_names: name prefixes never touched by any path. Default ().
        include_online_model: also save the online model in :meth:`state_dict` (keys
            ``online_model.*``). Default False (ema-pytorch defaults to True).
        allow_different_devices: allow EMA tensors on another device than the model's
            (e.g. a CPU shadow of a GPU model). Default False.
        use_foreach: ``False`` the reference per-tensor loop, ``True`` one foreach call
            per group, ``None`` the fastest correct path (coalesced flat spans). Default None.
        update_model_with_ema_every: every N calls that averaged, pull the model toward
            the EMA (see :meth:`update_model_with_ema`). Default None (never).
        update_model_with_ema_beta: fraction of the model kept when doing so; 0 copies the
            EMA into the model. Default 0.0.
        forward_method_names: methods of the EMA model exposed on the wrapper (e.g.
            ``("generate",)``). Default ().
        move_ema_to_online_device: move the EMA model to the model's device at update
            time when they differ. Default False.
        coerce_dtype: allow EMA tensors of another dtype than the model's; online values
            are cast before averaging. Default False.
        lazy_init_ema: create the EMA copy at the first :meth:`update` instead of now.
            Default False.
        ema_dtype: keyword-only; keep floating EMA tensors in at least this dtype, e.g.
            ``torch.float32`` for a bf16 model, so small updates at beta 0.9999 are not
            rounded away (a wider tensor, e.g. a float64 buffer, keeps its own dtype).
            Default None (the model's dtypes).
        schedule: keyword-only; a callable ``t -> decay`` (see :mod:`emakit.schedules`)
            replacing the beta/inv_gamma/power warm-up (``beta``, ``inv_gamma`` and
            ``power`` are then unused; ``min_value`` still floors the decay). A decay
            outside [0, 1] (or NaN) raises. Default None.
        decay_groups: keyword-only; "layered EMA": fnmatch patterns over tensor names
            mapped to a beta (the same warm-up with that ceiling) or a schedule, e.g.
            ``{"backbone.*": 0.999, "head.*": 0.99}``. The first matching pattern wins;
            unmatched names use ``beta``/``schedule``. Each group is laid out contiguously,
            so it is still updated in as few kernels as its tensors allow. Default None.
        stream: keyword-only; for a GPU model with a GPU shadow: snapshot the weights on the
            current stream and average on a CUDA side stream ordered by events, with no
            host sync; readers wait on the GPU. Not for CUDA-graph capture: the decay is a
            Python float, so a captured update would replay the decay of the capture.
            Default False.
        device: keyword-only; keep the EMA on this device, e.g. ``"cpu"`` for a GPU model
            (offload: pinned memory, non-blocking copies). Implies
            ``allow_different_devices=True``. Default None (the model's device).
        async_update: keyword-only; run the arithmetic of each update on a background
            thread, overlapping the next forward/backward: ``update()`` only snapshots the
            weights into a reusable staging buffer. Everything that reads the EMA waits for
            the pending update first. Default None: True when ``device`` is given.
        skip_nonfinite: keyword-only; skip any update whose model weights hold NaN or Inf
            (counted in ``num_skipped_nonfinite``, warned once). Costs one fused reduction
            and one host read per update that touches the weights. Default False.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> ema = EMA(net, beta=0.999, update_after_step=0, update_every=1)
        >>> for _ in range(3):
        ...     net(torch.randn(8, 4)).pow(2).mean().backward()
        ...     opt.step(); opt.zero_grad(); ema.update()
        >>> int(ema.step)
        3
        >>> y = ema(torch.randn(2, 4))  # the EMA model, eval mode, no grad
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if cls is EMA and model is not None and not isinstance(model, nn.Module):
            from .pytree import EMAPytree

            return EMAPytree(model, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        ema_model: nn.Module | Callable[[], nn.Module] | None = None,
        beta: float = 0.9999,
        update_after_step: int = 100,
        update_every: int = 10,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        min_value: float = 0.0,
        param_or_buffer_names_no_ema: Iterable[str] = (),
        ignore_names: Iterable[str] = (),
        ignore_startswith_names: Iterable[str] = (),
        include_online_model: bool = False,
        allow_different_devices: bool = False,
        use_foreach: bool | None = None,
        update_model_with_ema_every: int | None = None,
        update_model_with_ema_beta: float = 0.0,
        forward_method_names: Sequence[str] = (),
        move_ema_to_online_device: bool = False,
        coerce_dtype: bool = False,
        lazy_init_ema: bool = False,
        *,
        ema_dtype: torch.dtype | None = None,
        schedule: Callable[[int], float] | None = None,
        decay_groups: Mapping[str, float | Callable[[int], float]] | None = None,
        skip_nonfinite: bool = False,
        device: torch.device | str | None = None,
        async_update: bool | None = None,
        stream: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise EMATypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._configure(
            beta=beta,
            update_after_step=update_after_step,
            update_every=update_every,
            inv_gamma=inv_gamma,
            power=power,
            min_value=min_value,
            allow_different_devices=allow_different_devices,
            use_foreach=use_foreach,
            coerce_dtype=coerce_dtype,
            ema_dtype=ema_dtype,
            schedule=schedule,
            skip_nonfinite=skip_nonfinite,
            async_update=(
                check.boolean("async_update", async_update)
                if async_update is not None
                else device is not None
            ),
        )
        self.device = _as_device(device)
        if self.device is not None:
            self.allow_different_devices = True
        self.stream = check.boolean("stream", stream)
        if self.stream:
            self._worker = self._stream_worker(model, device, async_update)
        self.param_or_buffer_names_no_ema = check.names(
            "param_or_buffer_names_no_ema", param_or_buffer_names_no_ema
        )
        self.ignore_names = check.names("ignore_names", ignore_names)
        self.ignore_startswith_names = check.names(
            "ignore_startswith_names", ignore_startswith_names
        )
        self.include_online_model = check.boolean("include_online_model", include_online_model)
        self.update_model_with_ema_every = check.optional_integer(
            "update_model_with_ema_every", update_model_with_ema_every, low=1
        )
        self.update_model_with_ema_beta = check.real(
            "update_model_with_ema_beta", update_model_with_ema_beta, low=0.0, high=1.0
        )
        self.move_ema_to_online_device = check.boolean(
            "move_ema_to_online_device", move_ema_to_online_device
        )
        self.lazy_init_ema = check.boolean("lazy_init_ema", lazy_init_ema)
        if isinstance(forward_method_names, str):
            raise EMATypeError(
                f"forward_method_names must be a tuple of names, got the string "
                f"{forward_method_names!r}; wrap it: ({forward_method_names!r},)"
            )
        self.forward_method_names = tuple(check.names("forward_method_names", forward_method_names))

        model = unwrap_model(model)
        self._set_decay_groups(model, decay_groups)
        if include_online_model:
            self.online_model = model
        else:
            self._online = [model]  # a list hides it from the module tree and state_dict

        self._check_names(model)
        self.ema_model: nn.Module | None = None
        if ema_model is not None and not isinstance(ema_model, nn.Module):
            if not callable(ema_model):
                raise EMATypeError(
                    f"ema_model must be a Module or a zero-argument factory, got {type(ema_model).__name__}"
                )
            ema_model = ema_model()
            if not isinstance(ema_model, nn.Module):
                raise EMATypeError(
                    f"the ema_model factory must return a Module, it returned {type(ema_model).__name__}"
                )
        if lazy_init_ema:
            if ema_model is not None:
                raise EMAValueError(
                    "lazy_init_ema=True creates the EMA copy at the first update(); "
                    "do not also pass ema_model (or set lazy_init_ema=False)"
                )
        else:
            self.init_ema(ema_model)

    def _ema(self) -> nn.Module:
        """The EMA model, which exists after construction (or the first update when lazy)."""
        ema_model = self.ema_model
        if ema_model is None:
            raise EMARuntimeError(
                "the EMA model does not exist yet (lazy_init_ema=True): call update() first"
            )
        return ema_model

    def __getattr__(self, name: str) -> Any:
        if name == "ema_model":
            # Reading the EMA model must not race a background update.
            worker = self.__dict__.get("_worker")
            if worker is not None and worker.pending:
                worker.wait()
        return super().__getattr__(name)

    # -- construction -------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The online (training) model."""
        return self.online_model if self.include_online_model else self._online[0]

    def _tracked(self, module: nn.Module) -> dict[str, Tensor]:
        """Parameters and buffers by name, minus ignored names."""
        out: dict[str, Tensor] = {}
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            if name in self.ignore_names or any(
                name.startswith(p) for p in self.ignore_startswith_names
            ):
                continue
            out[name] = t
        return out

    def _check_names(self, model: nn.Module) -> None:
        known = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
        for arg in ("param_or_buffer_names_no_ema", "ignore_names"):
            unknown = sorted(getattr(self, arg) - known)
            if unknown:
                raise EMAValueError(
                    f"{arg} names tensors the model does not have: {unknown}; "
                    f"check the spelling against model.named_parameters()/named_buffers()"
                )
        for prefix in self.ignore_startswith_names:
            if not any(n.startswith(prefix) for n in known):
                raise EMAValueError(
                    f"ignore_startswith_names has {prefix!r}, which starts no tensor name of the model"
                )
        for method in self.forward_method_names:
            if not callable(getattr(model, method, None)):
                raise EMAValueError(
                    f"forward_method_names has {method!r}, which is not a method of the model"
                )

    @staticmethod
    def _stream_worker(model: nn.Module, device: object, async_update: bool | None) -> StreamWorker:
        if device is not None or async_update:
            raise EMAValueError(
                "stream=True keeps the EMA on the model's GPU and updates it on a side stream; "
                "it cannot be combined with device= or async_update=True (use one or the other)"
            )
        first = next((t for t in (*model.parameters(), *model.buffers()) if t.is_cuda), None)
        if first is None or not torch.cuda.is_available():
            raise EMAValueError(
                "stream=True needs a model on a CUDA device (got one with no CUDA tensors); "
                "leave stream=False on CPU"
            )
        return StreamWorker(first.device)

    def _set_decay_groups(
        self, model: nn.Module, decay_groups: Mapping[str, float | Callable[[int], float]] | None
    ) -> None:
        self._group_patterns: list[str] = []
        if decay_groups is None:
            return
        if not isinstance(decay_groups, Mapping):
            raise EMATypeError(
                f"decay_groups must map name patterns to a beta or a schedule, e.g. "
                f'{{"backbone.*": 0.999, "head.*": 0.99}}, got {type(decay_groups).__name__}'
            )
        names = [n for n, _ in (*model.named_parameters(), *model.named_buffers())]
        for pattern, rule in decay_groups.items():
            if not isinstance(pattern, str):
                raise EMATypeError(f"decay_groups keys must be str patterns, got {pattern!r}")
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise EMAValueError(
                    f"decay_groups pattern {pattern!r} matches no tensor name of the model; "
                    f"patterns are fnmatch globs over named_parameters()/named_buffers() names"
                )
            if callable(rule):
                self._group_decays.append(rule)
            else:
                beta = check.real(f"decay_groups[{pattern!r}]", rule, low=0.0, high=1.0)
                self._group_decays.append(beta)
            self._group_patterns.append(pattern)
        # A group whose beta is 1 is frozen; the whole EMA is frozen only if all are.
        if any(not (isinstance(r, float) and r == 1.0) for r in self._group_decays[1:]):
            self.is_frozen = False

    def _group_of(self, name: str) -> int:
        for g, pattern in enumerate(self._group_patterns, start=1):
            if fnmatch.fnmatchcase(name, pattern):
                return g
        return 0

    def _shadow_dtype(self, t: Tensor) -> torch.dtype | None:
        # ema_dtype only ever widens: a float64 buffer stays float64 under ema_dtype=float32.
        if self.ema_dtype is None or not t.is_floating_point():
            return None
        return torch.promote_types(t.dtype, self.ema_dtype)

    def _copy_model(self, model: nn.Module) -> nn.Module:
        # Deep-copy the module structure with every parameter and buffer replaced by an
        # empty placeholder (so neither weights nor gradients are duplicated), then give
        # the placeholders their data in one flat buffer per (device, dtype).
        memo: dict[int, Any] = {}
        for t in (*model.parameters(), *model.buffers()):
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if type(t) is nn.Parameter:
                memo[id(t)] = nn.Parameter(empty, requires_grad=False)
            elif type(t) is Tensor:
                memo[id(t)] = empty
        try:
            copy = _dist.copy_module(model, memo, dtype_for=self._shadow_dtype)  # FSDP2: sharded
        except Exception as e:
            raise EMATypeError(
                f"the model could not be deep-copied ({type(e).__name__}: {e}); pass ema_model= "
                f"a Module with the same structure, or a zero-argument factory that builds one"
            ) from e
        # Ignored tensors are not tracked but the copy still needs them to run.
        online = dict((*model.named_parameters(), *model.named_buffers()))
        tracked = self._tracked(copy)
        with torch.no_grad():
            for name, t in (*copy.named_parameters(), *copy.named_buffers()):
                if name not in tracked and t.numel() != online[name].numel():
                    t.data = online[name].detach().clone()
        return copy

    def init_ema(self, ema_model: nn.Module | None = None) -> None:
        """Create (or adopt) the EMA model and build the update plan.

        Called by the constructor, or by the first :meth:`update` when
        ``lazy_init_ema=True``.
        """
        fresh = ema_model is None
        if ema_model is None:
            ema_model = self._copy_model(self.model)
        for p in ema_model.parameters():
            p.requires_grad_(False)
        self.ema_model = ema_model
        for name in self.forward_method_names:
            setattr(self, name, getattr(ema_model, name))
        pairs = self._pair(self.model, ema_model, placeholders=fresh)
        for pair in pairs:
            self._check_pair(pair)
        self._layout_shadow(pairs, from_online=fresh)
        self._plan = None

    def _pair(
        self, model: nn.Module, ema_model: nn.Module, *, placeholders: bool = False
    ) -> list[TensorPair]:
        online, shadow = self._tracked(model), self._tracked(ema_model)
        missing, extra = (
            sorted(online.keys() - shadow.keys()),
            sorted(shadow.keys() - online.keys()),
        )
        if missing or extra:
            raise EMAStateError(
                f"ema_model does not match the model by name: missing from ema_model {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}, not in the model {extra[:10]}"
                f"{' ...' if len(extra) > 10 else ''}; build ema_model with the same structure"
            )
        buffers = {n for n, _ in model.named_buffers()}
        pairs = []
        for name, o in online.items():
            s = shadow[name]
            if s.shape != o.shape and not (placeholders and s.numel() == 0):
                raise EMAStateError(
                    f"tensor {name!r} has shape {tuple(s.shape)} in ema_model but {tuple(o.shape)} "
                    f"in the model; build ema_model with the same structure"
                )
            floating = o.is_floating_point() or o.is_complex()
            average = floating and name not in self.param_or_buffer_names_no_ema
            pairs.append(TensorPair(name, s, o, average, self._group_of(name), name in buffers))
        return pairs

    def _check_pair(self, p: TensorPair) -> None:
        s, o = p.shadow, p.online
        if s.dtype != o.dtype and not (self.coerce_dtype or self.ema_dtype is not None):
            raise EMAStateError(
                f"tensor {p.name!r} is {s.dtype} in the EMA but {o.dtype} in the model; pass "
                f"coerce_dtype=True (cast on update) or ema_dtype={s.dtype} (keep a wider shadow)"
            )
        if (
            s.device != o.device
            and not self.allow_different_devices
            and not self.move_ema_to_online_device
        ):
            raise EMAStateError(
                f"tensor {p.name!r} is on {s.device} in the EMA but on {o.device} in the model; "
                f"pass allow_different_devices=True, or move_ema_to_online_device=True"
            )
        _dist.check_sharded_pair(p.name, s, o)

    def _layout_shadow(self, pairs: list[TensorPair], *, from_online: bool) -> None:
        # Lay the shadow out in the online tensors' memory order, averaged tensors first:
        # when the model itself is flat (see flatten_parameters) each group then updates
        # as one span. DTensor (FSDP2) shards stay in FSDP's storage, filled by copy_module.
        pairs = _dist.unsharded_pairs(pairs, device=self.device)

        def order(p: TensorPair) -> tuple[bool, int, int, int]:
            return (
                not p.average,
                p.group,
                p.online.untyped_storage().data_ptr(),
                int(p.online.storage_offset()),
            )

        ordered = sorted(pairs, key=order)
        device = self.device
        pin = (
            device is not None
            and device.type == "cpu"
            and torch.cuda.is_available()
            and any(p.online.is_cuda for p in ordered)
        )
        rehome_(
            [p.shadow for p in ordered],
            sources=[p.online if from_online else p.shadow for p in ordered],
            dtype_for=[self._shadow_dtype(p.shadow) for p in ordered],
            device=device,
            pin_memory=pin,
        )

    def _pairs(self) -> list[TensorPair]:
        ema_model = self.ema_model
        if ema_model is None:
            self.init_ema()
            ema_model = self._ema()
        pairs = self._pair(self.model, ema_model)
        for p in pairs:
            self._check_pair(p)
        return pairs

    def _buffer_guards(self) -> list[tuple[dict, str, Tensor]]:
        # Buffers are often replaced rather than updated in place (module.to() does it);
        # an identity check per buffer is how the plan notices.
        guards = []
        for root in (self.model, self._ema()):
            for mod in root.modules():
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        guards.append((mod._buffers, name, buf))
        return guards + _dist.sharded_guards(self.model)

    def _before_update(self) -> None:
        if self.ema_model is None:
            self.init_ema()
        if self.move_ema_to_online_device:
            # the plan's tensors are live objects, so a not-yet-revalidated plan can answer
            # this; update() checks staleness right after, once
            pairs = (self._plan or self._ensure_plan()).pairs
            if pairs and pairs[0].online.device != pairs[0].shadow.device:
                ema_model = self._ema()
                ema_model.to(pairs[0].online.device)
                self.init_ema(ema_model)

    # -- model with EMA ---------------------------------------------------------------

    def _after_average(self, step: int) -> None:
        every = self.update_model_with_ema_every
        if every is not None and step % every == 0:
            self.update_model_with_ema()

    def update_model_with_ema(self, decay: float | None = None) -> None:
        """Pull the online model toward the EMA ("hare and tortoise", arXiv:2406.02596).

        .. math:: \\text{model} \\leftarrow b\\,\\text{model} + (1 - b)\\,\\text{ema}

        Args:
            decay: ``b``, the fraction of the model kept, in [0, 1]. Default None uses
                ``update_model_with_ema_beta``; 0 copies the EMA into the model.
        """
        b = (
            self.update_model_with_ema_beta
            if decay is None
            else check.real("decay", decay, low=0.0, high=1.0)
        )
        self._sync()
        if b == 0.0:
            self.copy_params_from_ema_to_model()
        else:
            self._ensure_plan().lerp_online(1.0 - b)

    def add_to_optimizer_post_step_hook(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`update` after every ``optimizer.step()``; returns the hook handle
        (``handle.remove()`` detaches it).

        With ``async_update=True`` on a CPU model this also registers a *pre*-step hook that
        waits for the pending background update. Since no optimizer step can then write the
        weights while the worker reads them, updates stop snapshotting the parameters: the
        worker averages straight from the live tensors, and the training thread only
        updates the (small) buffers, which the next forward may write.
        """
        if not hasattr(optimizer, "register_step_post_hook"):
            raise EMATypeError(
                f"optimizer must be a torch.optim.Optimizer (with register_step_post_hook), "
                f"got {type(optimizer).__name__}"
            )
        post = optimizer.register_step_post_hook(lambda *_: self.update())
        if not isinstance(self._worker, BackgroundWorker):
            return post
        if any(p.is_cuda for p in self.model.parameters()):
            return post  # the staged path already copies non-blocking on the GPU
        pre = optimizer.register_step_pre_hook(lambda *_: self._sync())
        self._live = (None, None, None)

        def detach() -> None:
            self._sync()
            self._live = None  # no pre-step hook any more: back to snapshots

        return _Handles(post, pre, on_remove=detach)

    # -- forward ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the EMA model in eval mode without grad; each submodule's mode is restored."""
        if self.ema_model is None:
            raise EMARuntimeError(
                "the EMA model does not exist yet (lazy_init_ema=True): call update() first"
            )
        modes = [(m, m.training) for m in self.ema_model.modules()]
        self.ema_model.eval()
        try:
            with torch.no_grad():
                return self.ema_model(*args, **kwargs)
        finally:
            for m, mode in modes:
                m.training = mode

    forward_eval = forward

    def eval(self) -> EMA:
        """Put the EMA model in eval mode (the online model is left alone)."""
        if self.ema_model is not None:
            self.ema_model.eval()
        self.training = False
        return self

    def _ignorable_key(self, key: str) -> bool:
        # ema-pytorch saves the online model by default; without include_online_model
        # those keys are accepted and left alone.
        return not self.include_online_model and key.startswith("online_model.")

    def _load_meta(
        self, state_dict: Mapping[str, Any], prefix: str, missing_keys: list[str]
    ) -> None:
        if self.ema_model is None and any(k.startswith(prefix + "ema_model.") for k in state_dict):
            self.init_ema()
        super()._load_meta(state_dict, prefix, missing_keys)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The EMA state, versioned. The online model is left out unless
        ``include_online_model=True``.

        Layout (version 1), for ``EMA(nn.Linear(2, 2))``::

            {
                "version": tensor(1),           # layout version
                "step": tensor(1234),           # update() calls so far
                "initted": tensor(True),        # whether the first update() happened
                "ema_model.weight": tensor(...),  # the EMA weights, in the shadow dtype
                "ema_model.bias": tensor(...),
            }

        ema-pytorch 0.8.3 states (no ``version``, maybe ``online_model.*``) load too.
        """
        return super().state_dict(*args, **kwargs)
