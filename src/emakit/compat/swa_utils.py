"""``torch.optim.swa_utils``' ``AveragedModel`` and its EMA functions, on emakit.

Change ``from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn`` to
``from emakit.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn``: the same
signatures, ``update_parameters(model)``, ``.module``, the ``n_averaged`` buffer and the
same state dict (``n_averaged``, ``module.*``), so states load both ways. ``SWALR`` and
``update_bn`` are torch's own (``emakit.update_bn`` works too).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate as check
from .._engine.pairs import TensorPair, pair_tensors
from ..decay import COPY, Action
from ..ema import EMA, unwrap_model
from ..errors import EMAValueError
from .averaged_module import AveragedModule, HostCount, version_of

__all__ = ["AveragedModel", "get_ema_avg_fn", "get_ema_multi_avg_fn"]

#: ``avg_fn(averaged, current, n_averaged) -> new averaged`` (one tensor)
AvgFn = Callable[[Tensor, Tensor, Any], Tensor]
#: ``multi_avg_fn(averaged_list, current_list, n_averaged)`` (in place, one device and dtype)
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Any], None]


class _EMAMultiAvgFn:
    """What `get_ema_multi_avg_fn()` returns: torch's function, with its decay readable,
    so that `AveragedModel` runs it on emakit's engine."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __repr__(self) -> str:
        return f"get_ema_multi_avg_fn(decay={self.decay!r})"

    @torch.no_grad()
    def __call__(self, ema: list[Tensor], current: list[Tensor], num_averaged: Any) -> None:
        if ema[0].is_floating_point() or ema[0].is_complex():
            torch._foreach_lerp_(ema, current, 1 - self.decay)
        else:
            for e, c in zip(ema, current, strict=True):
                e.copy_(e * self.decay + c * (1 - self.decay))


class _EMAAvgFn:
    """What `get_ema_avg_fn()` returns: ``decay * averaged + (1 - decay) * current``."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __repr__(self) -> str:
        return f"get_ema_avg_fn(decay={self.decay!r})"

    @torch.no_grad()
    def __call__(self, averaged: Tensor, current: Tensor, num_averaged: Any) -> Tensor:
        return self.decay * averaged + (1 - self.decay) * current


def get_ema_multi_avg_fn(decay: float = 0.999) -> MultiAvgFn:
    """torch's EMA function over lists of tensors: ``ema.lerp_(current, 1 - decay)``.

    .. math:: W^{\\text{EMA}}_{t+1} = \\text{decay}\\, W^{\\text{EMA}}_t
       + (1 - \\text{decay})\\, W^{\\text{model}}_{t+1}

    Passed to `AveragedModel` (``multi_avg_fn=``), it runs as an emakit planned update.

    Args:
        decay: the decay, in [0, 1]. Default 0.999.
    """
    return _EMAMultiAvgFn(check.real("decay", decay, low=0.0, high=1.0))


def get_ema_avg_fn(decay: float = 0.999) -> AvgFn:
    """torch's EMA function of one tensor: ``decay * averaged + (1 - decay) * current``
    (rounded as that expression rounds: `AveragedModel` calls it tensor by tensor).

    Args:
        decay: the decay, in [0, 1]. Default 0.999.
    """
    return _EMAAvgFn(check.real("decay", decay, low=0.0, high=1.0))


class AveragedModel(AveragedModule):
    """torch's ``AveragedModel``: SWA (an equal average) or an EMA of a model (``.module``).

    The first `update_parameters()` copies the model; update ``k + 1`` after that is

    .. math:: W \\leftarrow W + w_k (W^{\\text{model}} - W), \\quad
       w_k = \\frac{1}{k + 1}\\ \\text{(SWA, default)} \\quad\\text{or}\\quad
       1 - \\text{decay}\\ \\text{(}get\\_ema\\_multi\\_avg\\_fn\\text{)}

    over the parameters (and the buffers with ``use_buffers=True``; otherwise the buffers
    are copied from the model at every update), ``k`` being ``n_averaged``. The default
    SWA and `get_ema_multi_avg_fn()` run on emakit's engine: `get_ema_multi_avg_fn()`
    gives torch's numbers bit for bit; SWA agrees to float32 rounding (torch lerps with
    ``1 / (k + 1)`` on CUDA, as here, but computes ``W + (W' - W) / (k + 1)`` on the CPU).
    Any other ``avg_fn``/``multi_avg_fn`` (torch's own included) is called as torch calls
    it, with torch's numbers.

    Args:
        model: the model to average.
        device: keep the averaged model (and ``n_averaged``) on this device. Default None.
        avg_fn: ``(averaged, current, n_averaged) -> new averaged``, per tensor. Default None.
        multi_avg_fn: ``(averaged_list, current_list, n_averaged)``, in place, per device
            and dtype. Default None (SWA). Not both.
        use_buffers: average the buffers too. Default False.

    Differences from torch's:

    * no host sync per update: torch reads ``n_averaged`` (a tensor on ``device``) back on
      every call; here the count is kept on the host too, and ``n_averaged`` is read back
      only at the first update and after it was written or replaced (``fill_(0)`` as in
      torchvision's warm-up, ``copy_``, ``+=``, a loaded state dict, ``.to()``, an
      assignment): the next update then sees it as torch's does. A write through
      ``n_averaged.data`` moves no version counter and is not seen;
    * a negative ``n_averaged`` raises `EMAValueError` (torch then skips averaging);
    * the tensors are paired by name, strictly (torch zips them in order and stops at the
      shorter list): a model of another structure raises `EMAStateError`;
    * integer buffers (``num_batches_tracked``) with ``use_buffers=True`` and an engine
      function (SWA, `get_ema_multi_avg_fn()`) are copied from the model: torch averages
      them in floating point and truncates the result into the integer, so its count lags
      the model's.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.99))
        >>> ema.update_parameters(net)  # after optimizer.step()
        >>> sorted(ema.state_dict())
        ['module.bias', 'module.weight', 'n_averaged']
    """

    n_averaged: Tensor
    _count: HostCount  # n_averaged on the host

    def __init__(
        self,
        model: nn.Module,
        device: int | torch.device | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
        use_buffers: bool = False,
    ) -> None:
        super().__init__()
        if avg_fn is not None and multi_avg_fn is not None:
            raise EMAValueError(
                "pass avg_fn or multi_avg_fn, not both (got both); multi_avg_fn is faster"
            )
        self.module = copy.deepcopy(model)
        if device is not None:
            self.module = self.module.to(device)
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=device))
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = check.boolean("use_buffers", use_buffers)
        self.__dict__["_count"] = HostCount()

    def _weight(self, n: int) -> float | None:
        """The lerp weight of an update after ``n`` averaged, or None for a user function."""
        fn = self.multi_avg_fn
        if fn is None and self.avg_fn is None:
            return 1.0 / (n + 1)
        return 1.0 - fn.decay if isinstance(fn, _EMAMultiAvgFn) else None

    def _engine_for(self, model: nn.Module) -> EMA:
        engine = self._engine
        if engine is None or unwrap_model(model) is not engine.model:
            buffers = {n for n, _ in model.named_buffers()}
            engine = self.attach_engine(
                model,
                self._count.value,
                allow_different_devices=True,
                param_or_buffer_names_no_ema=() if self.use_buffers else buffers,
                share_frozen=False,
            )
        return engine

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Average ``model`` in: the first call copies it (see the class docstring)."""
        buffer, count = self.n_averaged, self._count
        version = version_of(buffer)
        if count.changed(buffer):  # written or replaced since
            count.read(buffer)
            if self._engine is not None:
                self._engine.tracker.reset(count.value)
        n = count.value
        if n < 0:
            raise EMAValueError(
                f"n_averaged must be >= 0, got n_averaged={n}; "
                "fill it with 0 to copy the model at the next update"
            )
        weight = self._weight(n)
        if weight is not None:
            tracker = self._engine_for(model).tracker
            tracker.set_counters(step=n + 1)
            tracker.apply(COPY if n == 0 else Action("lerp", (weight,), n + 1))
        else:
            self._call_user_fn(model, n)
        self.n_averaged += 1  # on its device: no host sync
        count.advanced(buffer, version)

    def _call_user_fn(self, model: nn.Module, n: int) -> None:
        """torch's update with the user's ``avg_fn``/``multi_avg_fn``, over the tensors
        paired by name (torch pairs them by position)."""
        model = unwrap_model(model)
        pairs = self._pairs(model, params=True, buffers=self.use_buffers)
        mine = [p.shadow.detach() for p in pairs]
        theirs = [p.online.detach().to(m.device) for p, m in zip(pairs, mine, strict=True)]
        if n == 0:
            for m, t in zip(mine, theirs, strict=True):
                m.copy_(t)
        elif self.multi_avg_fn is not None:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
            for m, t in zip(mine, theirs, strict=True):
                group = groups.setdefault((m.device, m.dtype), ([], []))
                group[0].append(m)
                group[1].append(t)
            for (device, _), (ms, ts) in groups.items():
                self.multi_avg_fn(ms, ts, self.n_averaged.to(device))
        elif self.avg_fn is not None:
            for m, t in zip(mine, theirs, strict=True):
                m.copy_(self.avg_fn(m, t, self.n_averaged.to(m.device)))
        if not self.use_buffers:
            for p in self._pairs(model, params=False, buffers=True):
                p.shadow.detach().copy_(p.online.detach().to(p.shadow.device))

    def _pairs(self, model: nn.Module, *, params: bool, buffers: bool) -> list[TensorPair]:
        """``.module``'s parameters and/or buffers and ``model``'s, paired by name,
        strictly."""

        def named(module: nn.Module) -> dict[str, Tensor]:
            return dict(
                itertools.chain(
                    module.named_parameters() if params else (),
                    module.named_buffers() if buffers else (),
                )
            )

        return pair_tensors(
            named(model),
            named(self.module),
            average=lambda name, t: True,
            cast=True,
            other_devices=True,
            shadow_arg="the averaged model (.module)",
        )
