"""Ultralytics' ``ModelEMA`` (``ultralytics.utils.torch_utils``: YOLOv8/11, RT-DETR), on emakit.

Change ``from ultralytics.utils.torch_utils import ModelEMA`` to ``from
emakit.compat.ultralytics import ModelEMA``: the same signature, defaults and attributes
(``ema``, ``updates``, ``enabled``, ``decay(updates)``), ``update(model)`` and
``update_attr(model, include, exclude)``, and the same averaged model, so the trainer's
checkpoints (``{"ema": half-precision copy of ema.ema, "updates": ema.updates}``) are
written and resumed as before. Ultralytics is not imported.

Ultralytics' trainer builds its EMA from the name ``ModelEMA`` of the module
``ultralytics.engine.trainer`` (at setup and again when it resumes); one line, after
importing it, makes it build this class instead::

    ultralytics.engine.trainer.ModelEMA = emakit.compat.ultralytics.ModelEMA

Ultralytics 8.4.103 and later average with ``torch._foreach_lerp_`` (``formula="lerp"``,
the default); earlier releases, YOLOv5 and the many copies of its class compute
``v *= d; v += (1 - d) * m``, which rounds differently (``formula="mul_add"``; for the
trainer of such a release, rebind ``functools.partial(ModelEMA, formula="mul_add")``).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Collection
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .. import _validate as check
from ..decay import Action
from ..ema import EMA, unwrap_model
from ..errors import EMATypeError, EMAValueError

__all__ = ["ModelEMA", "ramp_decay"]

Formula = Literal["lerp", "mul_add"]
_FORMULAS = ("lerp", "mul_add")
#: The most bytes of ``(1 - d) * m`` products one ``mul_add`` kernel call allocates.
_CHUNK_BYTES = 64 * 2**20


def ramp_decay(updates: int, decay: float, tau: float) -> float:
    """Ultralytics' decay of update number ``updates`` (counted from 1): an exponential
    ramp from 0 towards ``decay`` with time constant ``tau`` updates.

    .. math:: d(n) = \\text{decay} \\cdot (1 - e^{-n / \\tau})

    Computed as Ultralytics computes it, so the float is the same.

    >>> round(ramp_decay(2000, 0.9999, 2000), 6)
    0.632057
    """
    return decay * (1 - math.exp(-updates / tau))


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside compile and parallel wrappers: emakit's unwrapping (DDP,
    DataParallel, a DeepSpeed engine, ``torch.compile``), then, as Ultralytics does, any
    ``_orig_mod`` or ``module`` attribute that is a module."""
    model = unwrap_model(model)
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _mul_add_(groups: list[tuple[list[Tensor], list[Tensor]]], d: float) -> None:
    """``v *= d; v += (1 - d) * m`` for every pair, three separately rounded products and
    sums as in Ultralytics < 8.4.103, with one multi-tensor call per chunk of each.

    Run in inference mode, as the engine's updates are: below autograd, whose per-tensor
    bookkeeping for the model's parameters would cost more than the arithmetic on the CPU.
    """
    with torch.inference_mode():
        _mul_add_groups_(groups, d)


def _mul_add_groups_(groups: list[tuple[list[Tensor], list[Tensor]]], d: float) -> None:
    for shadows, onlines in groups:
        products = torch._foreach_mul(onlines, 1 - d)
        if shadows[0].dtype in (torch.float32, torch.float64):
            torch._foreach_mul_(shadows, d)
            torch._foreach_add_(shadows, products)
        else:  # the CPU's in-place _foreach_mul_ rounds d to float16 first; `v *= d` does not
            kept = torch._foreach_mul(shadows, d)
            torch._foreach_add_(kept, products)
            torch._foreach_copy_(shadows, kept)


class ModelEMA:
    """Ultralytics' ``ModelEMA``: an EMA of every floating entry of a model's state dict.

    ``ema`` is a copy of the model in eval mode, its parameters not requiring grad. Call
    ``update(model)`` after every optimizer step: update ``n = updates + 1`` averages

    .. math:: d = \\text{decay} \\cdot (1 - e^{-n/\\tau}),\\qquad
       v \\leftarrow d\\,v + (1 - d)\\,m

    into every floating state-dict entry ``v`` of ``ema`` (parameters and buffers such as
    BatchNorm's running statistics) from the model's entry ``m`` of the same name; integer
    entries (``num_batches_tracked``) keep the value they had when the copy was made, as in
    Ultralytics. The numbers are Ultralytics' bit for bit: ``formula="lerp"`` is
    ``v.lerp_(m, 1 - d)`` (Ultralytics >= 8.4.103), ``formula="mul_add"`` the rounding of
    ``v *= d; v += (1 - d) * m`` (earlier releases, YOLOv5).

    Args:
        model: the model to average (compile and parallel wrappers are unwrapped). A model
            with a ``teacher_model`` attribute (distillation) is copied without its teacher,
            as in Ultralytics.
        decay: the ceiling of the decay, in [0, 1]. Default 0.9999.
        tau: the ramp's time constant in updates, > 0. Default 2000.
        updates: updates already made (a resumed run). Default 0.
        formula: keyword-only, emakit's: ``"lerp"`` or ``"mul_add"`` (above). Default
            ``"lerp"``.

    Attributes:
        ema: the averaged model (assigning another module averages into that one).
        updates: ``update()`` calls that averaged so far (settable: the trainer's resume).
        enabled: ``update()`` and ``update_attr()`` do nothing while False. Default True.
        decay: ``decay(n)``, the decay of update ``n`` (see `ramp_decay()`); assigning
            another callable changes the schedule, as in Ultralytics.

    Differences from Ultralytics, none in the numbers of a model whose state dict names
    each tensor once:

    * the update runs on emakit's engine: the tensors are paired by name once, at the
      first ``update()``, and paired again when the model or ``ema`` changes (a replaced
      submodule, ``.to()``, ``.half()``); ``"lerp"`` is one ``lerp_`` per group of tensors
      and ``"mul_add"`` three multi-tensor calls per group, where Ultralytics < 8.4.103
      walks both state dicts and launches three kernels per tensor on every update;
    * a tensor registered under two names (tied weights) is averaged once per update;
      Ultralytics averages it once per name;
    * an ``ema`` in another dtype than the model (after ``ema.half()``) keeps averaging
      with ``"lerp"``, the model's values cast to its dtype, where Ultralytics' multi-tensor
      ``lerp_`` raises (``"mul_add"`` rounds as Ultralytics < 8.4.103 does);
    * bad arguments raise `emakit.errors.EMATypeError`/`EMAValueError` at construction
      (Ultralytics fails at the first update, or not at all), and a model that no longer
      matches ``ema`` raises `emakit.errors.EMAStateError` naming the tensors;
    * the object pickles and deep-copies (Ultralytics' ``decay`` is a lambda, so its
      ``ModelEMA`` does not pickle); the pairing is rebuilt at the next ``update()``.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        >>> ema = ModelEMA(net, decay=0.999, tau=100)
        >>> ema.update(net)  # after optimizer.step()
        >>> ema.updates, round(ema.decay(ema.updates), 6)
        (1, 0.00994)
    """

    enabled: bool
    decay: Callable[[int], float]
    _ema: nn.Module
    _updates: int
    _engine: EMA | None  # built at the first update(): pairs ema with the model
    _groups: tuple[object, list[tuple[list[Tensor], list[Tensor]]]] | None  # mul_add lists

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        tau: float = 2000,
        updates: int = 0,
        *,
        formula: Formula = "lerp",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise EMATypeError(
                f"model must be a torch.nn.Module, got model={model!r} "
                f"({type(model).__name__}); pass the model being trained"
            )
        decay = check.real("decay", decay, low=0.0, high=1.0, hint="typically 0.9999")
        tau = check.real("tau", tau, low=0.0, low_open=True, hint="a number of updates, e.g. 2000")
        if formula not in _FORMULAS:
            raise EMAValueError(
                f"formula must be one of {_FORMULAS}, got {formula=!r}: 'lerp' for "
                "Ultralytics >= 8.4.103, 'mul_add' for earlier releases and YOLOv5"
            )
        self.formula: Formula = formula
        self.updates = updates
        self.decay = functools.partial(ramp_decay, decay=decay, tau=tau)
        self.enabled = True
        ema = copy.deepcopy(_unwrap(model)).eval()
        if hasattr(ema, "teacher_model"):
            ema.teacher_model = None  # type: ignore[assignment]  # distillation: the student only
        for p in ema.parameters():
            p.requires_grad_(False)
        self.ema = ema

    @property
    def ema(self) -> nn.Module:
        """The averaged model."""
        return self._ema

    @ema.setter
    def ema(self, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise EMATypeError(
                f"ema must be a torch.nn.Module, got ema={module!r} ({type(module).__name__})"
            )
        self._ema = module
        self._engine = self._groups = None  # paired with the model at the next update()

    @property
    def updates(self) -> int:
        """``update()`` calls that averaged so far; the next one uses ``decay(updates + 1)``."""
        return self._updates

    @updates.setter
    def updates(self, value: int) -> None:
        self._updates = check.integer("updates", value, low=0)

    def _engine_for(self, model: nn.Module) -> EMA:
        """The engine EMA pairing ``ema`` with ``model`` (built again for another model)."""
        engine = self._engine
        if engine is not None and engine.model is model:
            return engine
        averaged = {k for k, v in self._ema.state_dict().items() if v.is_floating_point()}
        named = [*model.named_parameters(), *model.named_buffers()]
        engine = EMA(
            model,
            ema_model=self._ema,
            update_after_step=0,
            update_every=1,
            include_online_model=False,
            coerce_dtype=True,  # an ema.half() keeps averaging (see the class docstring)
            share_frozen=False,  # frozen weights are averaged too (they stay put under lerp)
            ignore_names={n for n, _ in named if n not in averaged},
        )
        engine.tracker.reset(0)  # initialized: the copy is the starting average
        self._engine, self._groups = engine, None
        return engine

    def _mul_add_groups(self, engine: EMA) -> list[tuple[list[Tensor], list[Tensor]]]:
        """The engine's current pairs as lists for `_mul_add_()`, one per dtype and device,
        cut so that no call allocates more than ``_CHUNK_BYTES``; built again with the plan."""
        plan = engine.tracker.plan()  # a new plan when the model or ema changed
        if self._groups is not None and self._groups[0] is plan:
            return self._groups[1]
        chunks: dict[tuple[Any, ...], list[tuple[list[Tensor], list[Tensor]]]] = {}
        sizes: dict[tuple[Any, ...], int] = {}  # bytes in the last chunk of each kind
        for pair in plan.pairs:
            s, o = pair.shadow, pair.online
            kind, size = (s.device, s.dtype, o.device, o.dtype), o.numel() * o.element_size()
            if kind not in chunks or (sizes[kind] and sizes[kind] + size > _CHUNK_BYTES):
                chunks.setdefault(kind, []).append(([], []))
                sizes[kind] = 0
            chunks[kind][-1][0].append(s)
            chunks[kind][-1][1].append(o)
            sizes[kind] += size
        groups = [chunk for kind_chunks in chunks.values() for chunk in kind_chunks]
        self._groups = (plan, groups)
        return groups

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Average ``model`` into ``ema`` with the decay of the next update (class docstring)."""
        if not self.enabled:
            return
        engine = self._engine_for(_unwrap(model))
        d = self.decay(self._updates + 1)
        if self.formula == "mul_add":
            _mul_add_(self._mul_add_groups(engine), d)
        else:
            tracker = engine.tracker
            tracker.set_counters(step=tracker.step + 1)
            tracker.apply(Action("lerp", (1 - d,), tracker.step))
        self._updates += 1

    def update_attr(
        self, model: nn.Module, include: Collection[str] = (), exclude: Collection[str] = ()
    ) -> None:
        """Set on ``ema`` the attributes of (the unwrapped) ``model``: each entry of its
        ``__dict__`` whose name does not start with ``_``, is in ``include`` (when given)
        and not in ``exclude`` (the trainer passes ``include=["yaml", "nc", "args",
        "names", "stride", "class_weights"]``)."""
        if not self.enabled:
            return
        for name, value in vars(_unwrap(model)).items():
            if name.startswith("_") or name in exclude or (include and name not in include):
                continue
            setattr(self._ema, name, value)

    def __getstate__(self) -> dict[str, Any]:
        # the engine holds the online model: pair again at the next update() instead
        return {**self.__dict__, "_engine": None, "_groups": None}
