"""mmengine's averaged models (``mmengine.model.averaged_model``, mmengine 0.10), on emakit.

``ExponentialMovingAverage``, ``MomentumAnnealingEMA`` and ``StochasticWeightAverage`` have
mmengine's signatures, defaults, ``update_parameters(model)``, ``avg_func``, ``module``,
``steps`` buffer and state dict (``steps``, ``module.*``), so ``EMAHook`` checkpoints load
both ways. In code, change one import::

    from emakit.compat.mmengine import ExponentialMovingAverage
    # was: from mmengine.model import ExponentialMovingAverage

In a config, change one value: ``EMAHook`` builds its model from ``ema_type`` through
mmengine's ``MODELS`` registry, which imports a dotted path by itself::

    custom_hooks = [
        dict(type="EMAHook", ema_type="emakit.compat.mmengine.ExponentialMovingAverage")
    ]

or, as OpenMMLab's plugins do, import this module first (``custom_imports`` or a plain
import) and use its short name: importing it adds the registry node ``emakit`` (a child of
mmengine's root ``MODELS``, mmengine's API for downstream libraries; no mmengine class is
changed) holding the three classes under mmengine's names::

    custom_imports = dict(imports=["emakit.compat.mmengine"], allow_failed_imports=False)
    custom_hooks = [dict(type="EMAHook", ema_type="emakit.ExponentialMovingAverage")]

``import emakit`` and ``import emakit.compat`` import no mmengine. Without mmengine the
classes work (to read or write its checkpoints) and nothing is registered (`MODELS` is None).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .. import _validate as check
from .._core.tracker import Tracker
from .._engine.plan import Plan
from ..decay import COPY, Action
from ..ema import EMA, unwrap_model
from ..errors import EMAStateError, EMATypeError, EMAValueError, user_stacklevel
from .averaged_module import AveragedModule, HostCount, version_of

__all__ = [
    "MODELS",
    "SCOPE",
    "BaseAveragedModel",
    "ExponentialMovingAverage",
    "MomentumAnnealingEMA",
    "StochasticWeightAverage",
]

#: The scope of emakit's node in mmengine's ``MODELS`` registry: ``ema_type="emakit.<name>"``.
SCOPE = "emakit"


class BaseAveragedModel(AveragedModule):
    """mmengine's ``BaseAveragedModel``: a copy of a model (``.module``) whose weights are
    averaged by ``update_parameters(model)``.

    Call ``n`` of ``update_parameters`` (``n`` = ``steps`` before it) does:

    * ``n == 0``: copy the model (what it averages, and its integer buffers);
    * ``n % interval == 0``: average each floating tensor in with `avg_func`;
    * otherwise nothing;

    and, with ``update_buffers=False``, copies every buffer of the model at every call.
    ``steps`` then grows by one. With ``update_buffers=True`` the tensors of the model's
    state dict are averaged (its integer buffers are copied at the first call only, as
    in mmengine), else its parameters.

    Subclasses give `avg_func`. The three classes of this module also average on
    emakit's engine (tensors paired by name once, one multi-tensor kernel per group); a
    subclass that overrides `avg_func` (mmdet's ``ExpMomentumEMA`` pattern) gets
    mmengine's loop, which calls it tensor by tensor.

    Args:
        model: the model to average (DDP and ``torch.compile`` wrappers are unwrapped, as
            ``EMAHook`` does).
        interval: average every ``interval`` calls. Default 1.
        device: keep ``.module`` and ``steps`` on this device. Default None (the model's).
        update_buffers: average the buffers too (else copy them). Default False.

    Differences from mmengine (none in the numbers, but for tied weights):

    * no host sync per update: mmengine reads ``steps`` back (``steps == 0``, ``%``) on
      every call; here the count is also kept on the host, and ``steps`` is read back
      only at the first update and after it was written or replaced (a loaded state dict,
      ``steps.zero_()``, ``.to()``). A write through ``steps.data`` moves no version
      counter and is not seen. A negative ``steps`` raises `EMAValueError`;
    * tensors are paired by name, strictly: a model of another structure raises
      `EMAStateError` (mmengine raises ``KeyError``, or zips the buffers in order);
    * a weight tied under two names is averaged once per update; mmengine's
      ``update_buffers=True`` loop averages it once per name;
    * bad arguments raise `EMAValueError`/`EMATypeError` naming them (mmengine asserts),
      and a momentum above 0.5 warns with ``warnings.warn`` (mmengine logs).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = ExponentialMovingAverage(net, momentum=0.01)
        >>> ema.update_parameters(net)  # after optimizer.step(): the first call copies
        >>> sorted(ema.state_dict())
        ['module.bias', 'module.weight', 'steps']
    """

    steps: Tensor
    #: The class's own `avg_func`, which `_planned_average` computes on emakit's engine;
    #: None where there is none (a subclass overriding `avg_func` runs mmengine's loop).
    _planned_for: ClassVar[Callable[..., None] | None] = None
    _count: HostCount  # steps on the host
    _lists: tuple[Plan, list[Tensor], list[Tensor], bool] | None  # see _averaged()

    def __init__(
        self,
        model: nn.Module,
        interval: int = 1,
        device: torch.device | str | int | None = None,
        update_buffers: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise EMATypeError(
                f"model must be a torch.nn.Module (the model to average), got "
                f"{type(model).__name__}"
            )
        self.interval = check.integer("interval", interval, low=1)
        self.update_buffers = check.boolean("update_buffers", update_buffers)
        if device is not None and not isinstance(device, (torch.device, str, int)):
            raise EMATypeError(f"device must be a torch.device, str or int, got device={device!r}")
        self.module = copy.deepcopy(unwrap_model(model)).requires_grad_(False)
        if device is not None:
            self.module = self.module.to(device)
        self.register_buffer("steps", torch.tensor(0, dtype=torch.long, device=device))
        self.__dict__.update(_count=HostCount(), _lists=None)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_lists": None}  # the lists hold the online model

    @property
    def avg_parameters(self) -> dict[str, Tensor]:
        """What is averaged, by name: ``.module``'s state dict with ``update_buffers``,
        else its parameters (mmengine's attribute)."""
        if self.update_buffers:
            return self.module.state_dict()
        return dict(self.module.named_parameters())

    def avg_func(self, averaged_param: Tensor, source_param: Tensor, steps: Tensor | int) -> None:
        """Average ``source_param`` into ``averaged_param`` in place, ``steps`` being the
        count before this update; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} must define avg_func()")

    # -- the update ---------------------------------------------------------------------

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Copy ``model`` (first call) or average it in (every ``interval`` calls)."""
        buffer = self.steps
        version = version_of(buffer)
        n = self._host_steps()
        tracker = self._engine_for(model).tracker
        tracker.set_counters(step=n + 1)
        if n == 0:
            tracker.apply(COPY)
            self._copy_held(model)
        elif n % self.interval == 0:
            if self._runs_planned():
                self._planned_average(tracker, n)
            else:
                self._call_avg_func(tracker.plan())
        elif not self.update_buffers:
            tracker.plan().copy_unaveraged()  # the buffers
        buffer += 1  # on its device: no host sync
        self._count.advanced(buffer, version)

    def _runs_planned(self) -> bool:
        """Whether averaging runs the class's own `avg_func` on the engine: not when a
        subclass overrides it, nor when one is set on the instance."""
        planned = type(self)._planned_for
        own = type(self).avg_func is planned and "avg_func" not in self.__dict__
        return planned is not None and own

    def _planned_average(self, tracker: Tracker, n: int) -> None:
        """The averaging call ``n`` of the class's own `avg_func`, on the engine."""
        raise NotImplementedError  # pragma: no cover - only classes with _planned_for

    def _averaged(self, plan: Plan) -> tuple[list[Tensor], list[Tensor]]:
        """The averaged tensors of ``plan`` and the model's, on the average's devices;
        listed once per plan (a plan is rebuilt when the model changes)."""
        cached = self._lists
        if cached is None or cached[0] is not plan:
            # the tensors themselves, as the plan holds them: a `.data` swap is seen
            shadows = [p.shadow for p in plan.pairs if p.average]
            onlines = [p.online for p in plan.pairs if p.average]
            moved = any(s.device != o.device for s, o in zip(shadows, onlines, strict=True))
            cached = (plan, shadows, onlines, moved)
            self.__dict__["_lists"] = cached
        _, shadows, onlines, moved = cached
        if moved:  # mmengine's `.to(device)` of each model tensor
            onlines = [o.to(s.device) for s, o in zip(shadows, onlines, strict=True)]
        return shadows, onlines

    def _call_avg_func(self, plan: Plan) -> None:
        """mmengine's loop: `avg_func` on each averaged tensor (then copy the buffers)."""
        steps = self.steps
        for shadow, online in zip(*self._averaged(plan), strict=True):
            self.avg_func(shadow.detach(), online.detach(), steps)
        if not self.update_buffers:
            plan.copy_unaveraged()

    def _host_steps(self) -> int:
        """``steps`` as a host int, read back only when it was written or replaced."""
        buffer, count = self.steps, self._count
        if count.changed(buffer):
            count.read(buffer)
        if count.value < 0:
            raise EMAValueError(
                f"steps must be >= 0, got steps={count.value}; fill it with 0 "
                f"(ema.steps.zero_()) to copy the model at the next update"
            )
        return count.value

    def _engine_for(self, model: nn.Module) -> EMA:
        """The engine EMA of ``model`` into ``.module`` (built again for another model)."""
        online = unwrap_model(model)
        engine = self._engine
        if engine is not None and online is engine.model and engine.ema_model is self.module:
            return engine
        if self.update_buffers:
            # mmengine averages the state dict's floating tensors; its integer buffers are
            # copied at the first call only (`_copy_held`), non-persistent buffers never
            saved = online.state_dict()
            held = {k for k, v in saved.items() if not v.is_floating_point()}
            unsaved = {k for k, _ in online.named_buffers() if k not in saved}
            roles: dict[str, Any] = {"ignore_names": held | unsaved}
        else:
            roles = {"param_or_buffer_names_no_ema": {k for k, _ in online.named_buffers()}}
        try:
            return self.attach_engine(
                online,
                self._count.value,
                allow_different_devices=True,
                share_frozen=False,  # mmengine averages every weight, trained or not
                **roles,
            )
        except EMAStateError as e:
            raise EMAStateError(
                f"{type(self).__name__}.update_parameters(model) takes the model it was "
                f"built from, or one with the same tensor names (ema_model below is "
                f".module): {e}"
            ) from None

    def _copy_held(self, model: nn.Module) -> None:
        """Copy the integer entries of the state dict (``update_buffers=True``: the
        engine leaves them alone after this first copy)."""
        if not self.update_buffers:
            return
        mine = self.module.state_dict()
        for name, value in unwrap_model(model).state_dict().items():
            if not value.is_floating_point():
                mine[name].copy_(value)


class ExponentialMovingAverage(BaseAveragedModel):
    """mmengine's ``ExponentialMovingAverage``: an EMA of a model (``.module``).

    .. math:: W^{\\text{ema}} \\leftarrow (1 - \\text{momentum})\\, W^{\\text{ema}}
       + \\text{momentum}\\, W

    computed as mmengine does, ``ema.lerp_(w, momentum)`` (its numbers bit for bit), with
    one multi-tensor ``lerp_`` per group of tensors on emakit's engine. ``momentum`` is
    the weight of the *new* value (``1 - decay`` of other libraries). See
    `BaseAveragedModel` for the call sequence and the differences from mmengine.

    Args:
        model: the model to average.
        momentum: the weight of the model at each average, in (0, 1). Default 0.0002.
        interval: average every ``interval`` calls. Default 1.
        device: keep the average on this device. Default None.
        update_buffers: average the buffers too (else copy them). Default False.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = ExponentialMovingAverage(net, momentum=0.001, update_buffers=True)
        >>> for _ in range(3):
        ...     ema.update_parameters(net)
        >>> int(ema.steps)
        3
    """

    def __init__(
        self,
        model: nn.Module,
        momentum: float = 0.0002,
        interval: int = 1,
        device: torch.device | str | int | None = None,
        update_buffers: bool = False,
    ) -> None:
        super().__init__(model, interval, device, update_buffers)
        check.real(
            "momentum",
            momentum,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
            hint="mmengine's momentum is the weight of the new value (1 - decay), e.g. 0.0002",
        )
        if momentum > 0.5:
            warnings.warn(
                f"momentum={momentum!r} is the weight of the model's new weights in "
                f"mmengine's EMA (1 - decay), usually a small number such as 0.0002; "
                f"check that this is meant",
                UserWarning,
                stacklevel=user_stacklevel(),  # the user's line, from a subclass too
            )
        self.momentum = momentum

    def momentum_at(self, steps: int) -> float:
        """emakit's: the momentum of the average made when ``steps`` is ``steps``
        (constant here)."""
        return self.momentum

    def avg_func(self, averaged_param: Tensor, source_param: Tensor, steps: Tensor | int) -> None:
        """``averaged_param.lerp_(source_param, momentum)``."""
        averaged_param.lerp_(source_param, self.momentum)

    _planned_for = avg_func

    def _planned_average(self, tracker: Tracker, n: int) -> None:
        tracker.apply(Action("lerp", (self.momentum_at(n),), n + 1))


class MomentumAnnealingEMA(ExponentialMovingAverage):
    """mmengine's ``MomentumAnnealingEMA``: an EMA whose momentum starts large and anneals.

    .. math:: m_n = \\max\\Big(\\text{momentum}, \\frac{\\gamma}{\\gamma + n}\\Big)

    at the update made when ``steps == n`` (the raw count, ``interval`` or not), then
    ``ema.lerp_(w, m_n)`` as in `ExponentialMovingAverage` (mmengine's numbers bit for
    bit; the momentum is computed from the host count, with no ``steps.item()``).

    Args:
        model: the model to average.
        momentum: the floor of the momentum, in (0, 1). Default 0.0002.
        gamma: the annealing scale, > 0. Default 100.
        interval: average every ``interval`` calls. Default 1.
        device: keep the average on this device. Default None.
        update_buffers: average the buffers too (else copy them). Default False.

    Example:
        >>> ema = MomentumAnnealingEMA(torch.nn.Linear(2, 2), momentum=0.001, gamma=10)
        >>> ema.momentum_at(90)
        0.1
    """

    def __init__(
        self,
        model: nn.Module,
        momentum: float = 0.0002,
        gamma: int = 100,
        interval: int = 1,
        device: torch.device | str | int | None = None,
        update_buffers: bool = False,
    ) -> None:
        super().__init__(
            model=model,
            momentum=momentum,
            interval=interval,
            device=device,
            update_buffers=update_buffers,
        )
        check.real("gamma", gamma, low=0.0, low_open=True, hint="e.g. gamma=100")
        self.gamma = gamma  # kept as given: 100 / (100 + n) is mmengine's float

    def momentum_at(self, steps: int) -> float:
        """emakit's: ``max(momentum, gamma / (gamma + steps))``, the momentum of the
        average made when ``steps`` is ``steps``."""
        return max(self.momentum, self.gamma / (self.gamma + steps))

    def avg_func(self, averaged_param: Tensor, source_param: Tensor, steps: Tensor | int) -> None:
        """``averaged_param.lerp_(source_param, momentum_at(self.steps))`` (as mmengine,
        from the ``steps`` buffer, not the argument)."""
        averaged_param.lerp_(source_param, self.momentum_at(int(self.steps)))

    _planned_for = avg_func


class StochasticWeightAverage(BaseAveragedModel):
    """mmengine's ``StochasticWeightAverage``: the equal average of the weights (SWA).

    .. math:: W^{\\text{swa}} \\leftarrow W^{\\text{swa}} + \\frac{W - W^{\\text{swa}}}
       {\\lfloor n / \\text{interval} \\rfloor + 1}

    at the update made when ``steps == n``, computed as mmengine computes it (the
    difference, then ``add_`` with ``alpha``: its numbers bit for bit, where ``lerp_``
    rounds differently), with two multi-tensor kernels per update over the engine's
    planned pairs. See `BaseAveragedModel` for the call sequence.

    Args:
        model: the model to average.
        interval: average every ``interval`` calls. Default 1.
        device: keep the average on this device. Default None.
        update_buffers: average the buffers too (else copy them). Default False.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> swa = StochasticWeightAverage(net)
        >>> swa.update_parameters(net)
        >>> torch.equal(swa.module.weight, net.weight)
        True
    """

    def avg_func(self, averaged_param: Tensor, source_param: Tensor, steps: Tensor | int) -> None:
        """``averaged_param += (source_param - averaged_param) / (steps // interval + 1)``."""
        averaged_param.add_(
            source_param - averaged_param, alpha=1 / float(steps // self.interval + 1)
        )

    _planned_for = avg_func

    def _planned_average(self, tracker: Tracker, n: int) -> None:
        plan = tracker.plan()
        shadows, onlines = self._averaged(plan)
        if shadows:
            differences = torch._foreach_sub(onlines, shadows)
            torch._foreach_add_(shadows, differences, alpha=1 / float(n // self.interval + 1))
        if not self.update_buffers:
            plan.copy_unaveraged()


def _register() -> Any:
    """emakit's node ``emakit`` in mmengine's ``MODELS`` registry, holding the three
    classes under mmengine's names (None without mmengine)."""
    try:  # mmengine has no type information: Any
        from mmengine import registry  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    node = registry.MODELS.children.get(SCOPE)
    if node is None:
        node = registry.Registry("model", parent=registry.MODELS, scope=SCOPE)
    for cls in (ExponentialMovingAverage, MomentumAnnealingEMA, StochasticWeightAverage):
        node.register_module(module=cls, force=True)  # force: a reload replaces its own
    return node


#: emakit's node of mmengine's ``MODELS`` registry (scope ``"emakit"``), or None without
#: mmengine: ``MODELS.build(dict(type="emakit.ExponentialMovingAverage", model=net))``.
MODELS = _register()
