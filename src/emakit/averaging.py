"""Weight-space averaging recipes: weighted averages of whole models, and BatchNorm
statistics recomputed for averaged weights.

``interpolate`` mixes several copies of one architecture (an EMA, an SWA average, the
online model, checkpoints of a model soup) into one state dict; ``update_bn`` then gives
the BatchNorm layers of the averaged model the statistics of its own activations, which
an average of running statistics is not.

Example:
    >>> import torch
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> mixed = interpolate([a, b], [0.7, 0.3])
    >>> torch.allclose(mixed["weight"], 0.7 * a.weight + 0.3 * b.weight)
    True
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as tree_utils

from . import _validate as check
from .ema import EMA, unwrap_model
from .errors import EMAStateError, EMATypeError, EMAValueError

__all__ = ["interpolate", "update_bn"]


# -- interpolate ----------------------------------------------------------------------------


def _ema_model(what: str, ema: EMA) -> nn.Module:
    """The EMA model of ``ema`` (the argument ``what``), or an error saying why there is none."""
    ema_model = getattr(ema, "ema_model", None)
    if not isinstance(ema_model, nn.Module):
        raise EMATypeError(
            f"{what} is an {type(ema).__name__} without an EMA model (lazy_init_ema=True "
            f"before the first update(), or an EMAPytree); pass a module or a state dict"
        )
    return ema_model


def _as_state_dict(i: int, source: object) -> Mapping[str, Any]:
    if isinstance(source, EMA):
        return _ema_model(f"models_or_state_dicts[{i}]", source).state_dict()
    if isinstance(source, torch.optim.swa_utils.AveragedModel):
        source = source.module
    if isinstance(source, nn.Module):
        return unwrap_model(source).state_dict()
    if isinstance(source, Mapping):
        return source
    raise EMATypeError(
        f"models_or_state_dicts[{i}] must be an nn.Module, an emakit EMA or a state dict "
        f"(a mapping of names to tensors), got {type(source).__name__}"
    )


def _weights(weights: object, n: int, normalize: bool) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    if isinstance(weights, Tensor):
        weights = weights.detach().cpu().reshape(-1).tolist()
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Iterable):
        raise EMATypeError(
            f"weights must be a sequence of numbers (one per model), got {weights=!r}"
        )
    values = list(weights)
    if len(values) != n:
        raise EMAValueError(
            f"weights must hold one number per model: {n} models but {len(values)} weights, "
            f"got {weights=!r}"
        )
    real = [
        float(w) if isinstance(w, numbers.Real) and not isinstance(w, bool) else w for w in values
    ]
    out = [check.real(f"weights[{i}]", w, low=0.0) for i, w in enumerate(real)]
    total = math.fsum(out)
    if normalize and total == 0:
        raise EMAValueError(
            f"weights must not all be 0 (normalize=True divides by their sum), got {weights=!r}"
        )
    return [w / total for w in out] if normalize else out


def _check_keys(states: Sequence[Mapping[str, Any]]) -> None:
    """Every state has the names of the first, or an error listing the missing and extra."""
    first = states[0].keys()
    for i, sd in enumerate(states[1:], start=1):
        missing, extra = sorted(first - sd.keys()), sorted(sd.keys() - first)
        if missing or extra:
            raise EMAStateError(
                f"models_or_state_dicts[{i}] does not match models_or_state_dicts[0] by name: "
                f"missing {check.few(missing)}, extra {check.few(extra)}; "
                f"average copies of one architecture"
            )


@torch.no_grad()
def interpolate(
    models_or_state_dicts: Sequence[nn.Module | Mapping[str, Any]],
    weights: Sequence[float] | Tensor | None = None,
    *,
    normalize: bool = True,
) -> dict[str, Any]:
    """A weighted average of several models' weights, e.g. ``0.7 * EMA + 0.3 * SWA``.

    .. math:: \\theta = \\sum_i w_i\\, \\theta_i, \\qquad
       w_i \\leftarrow w_i / \\textstyle\\sum_j w_j \\ \\text{ when normalize}

    Tensors are paired by name, strictly: every input must have exactly the keys of the
    first, with the same shapes. Floating (and complex) tensors are averaged in float32,
    or in the widest dtype among the inputs when that is wider (float64 stays float64,
    bf16/fp16 are summed in float32), on the first input's device, and returned in the
    first input's dtype. Integer and bool tensors (``num_batches_tracked``, masks, index
    buffers) are not averaged: the first input's value is taken. Non-tensor entries
    (``_extra_state``) are taken from the first input too.

    The result is a new dict of new tensors; ``model.load_state_dict(result)`` loads it.
    BatchNorm running statistics come out as the same weighted average of the inputs'
    statistics, which is not the statistics of the averaged network: run
    [`update_bn()`][emakit.averaging.update_bn] afterwards.

    Args:
        models_or_state_dicts: the models to average, each an ``nn.Module`` (its
            ``state_dict()``; DDP, ``torch.compile`` and ``AveragedModel`` wrappers are
            unwrapped), an emakit ``EMA`` (its EMA model's weights) or a state dict.
        weights: one finite number >= 0 per model. Default None: equal weights.
        normalize: divide the weights by their sum, so any positive weights give an
            average (``[7, 3]`` is ``[0.7, 0.3]``). With False the weights are used as
            given, for sums other than 1 (e.g. extrapolating a soup). Default True.

    Returns:
        ``{name: tensor}`` in the first input's key order, dtypes and device.

    Raises:
        EMATypeError: an input or a weight of the wrong type.
        EMAValueError: no inputs, a weight count that differs from the model count, a
            negative or non-finite weight, or all-zero weights with ``normalize=True``.
        EMAStateError: the inputs do not have the same names (the message lists the
            missing and extra ones) or the same shapes.

    Example:
        >>> import torch
        >>> a, b = {"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([1.0, 1.0])}
        >>> interpolate([a, b], [3, 1])
        {'w': tensor([0.2500, 1.0000])}
    """
    if isinstance(models_or_state_dicts, (nn.Module, Mapping)) or not isinstance(
        models_or_state_dicts, Iterable
    ):
        raise EMATypeError(
            f"models_or_state_dicts must be a list of models or state dicts, got a "
            f"{type(models_or_state_dicts).__name__}; wrap it: [model]"
        )
    sources = list(models_or_state_dicts)
    if not sources:
        raise EMAValueError("models_or_state_dicts is empty; pass at least one model")
    check.boolean("normalize", normalize)
    states = [_as_state_dict(i, s) for i, s in enumerate(sources)]
    w = _weights(weights, len(states), normalize)
    _check_keys(states)

    out: dict[str, Any] = {}
    for name, first in states[0].items():
        values = [sd[name] for sd in states]
        if not isinstance(first, Tensor):
            out[name] = first
            continue
        for i, v in enumerate(values):
            if not isinstance(v, Tensor):
                raise EMAStateError(
                    f"{name!r} is a tensor in models_or_state_dicts[0] but a "
                    f"{type(v).__name__} in models_or_state_dicts[{i}]"
                )
            if v.shape != first.shape:
                raise EMAStateError(
                    f"{name!r} has shape {tuple(first.shape)} in models_or_state_dicts[0] but "
                    f"{tuple(v.shape)} in models_or_state_dicts[{i}]; average copies of one "
                    f"architecture"
                )
        if not (first.is_floating_point() or first.is_complex()):
            out[name] = first.detach().clone()
            continue
        wide = (v.dtype for v in values if v.is_floating_point() or v.is_complex())
        dtype = functools.reduce(torch.promote_types, wide, torch.float32)
        acc = torch.zeros(first.shape, dtype=dtype, device=first.device)
        for wi, v in zip(w, values, strict=True):
            if wi != 0.0:
                acc.add_(v.detach().to(first.device, dtype), alpha=wi)
        out[name] = acc.to(first.dtype)
    return out


# -- update_bn ------------------------------------------------------------------------------


def _first_input(batch: Any) -> Any:
    if not isinstance(batch, (list, tuple, Mapping)):
        return batch
    if not batch:
        raise EMAValueError(
            f"the loader yielded an empty {type(batch).__name__}; its first element (or "
            f"value) is the input"
        )
    return next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]


class _Moments:
    """Per-channel count, mean and sum of squared deviations of a BatchNorm layer's input,
    merged batch by batch (Chan et al.'s parallel variance) in float64."""

    def __init__(self) -> None:
        self.batches = 0
        self.count = 0
        self.mean: Tensor | None = None
        self.m2: Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        dims = [0, *range(2, x.dim())]
        n = x.numel() // x.shape[1]
        # The batch's moments in (at least) float32, like BatchNorm's own kernels, without
        # a float64 copy of the activations; only the per-channel merge runs in float64.
        var, mean = torch.var_mean(
            x.to(torch.promote_types(x.dtype, torch.float32)), dims, correction=0
        )
        mean, m2 = mean.to(torch.float64), var.to(torch.float64) * n
        self.batches += 1
        if self.mean is None or self.m2 is None:
            self.count, self.mean, self.m2 = n, mean, m2
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        self.count = total


@torch.no_grad()
def update_bn(
    loader: Iterable[Any],
    model: nn.Module,
    device: torch.device | str | None = None,
    *,
    input_fn: Callable[[Any], Any] | None = None,
) -> None:
    """Recompute the BatchNorm running statistics of ``model`` over one pass of ``loader``.

    Averaged weights (EMA, SWA, [`interpolate()`][emakit.averaging.interpolate]) come with running statistics that
    were never measured on the averaged network; this replaces them with the exact
    statistics of the data. Each BatchNorm layer's ``running_mean`` and ``running_var``
    become the mean and unbiased variance (as BatchNorm stores it), per channel, of
    every value that reached that layer's input during the pass (``N`` of them):

    .. math:: \\mu = \\frac{1}{N}\\sum_k x_k, \\qquad
       \\sigma^2 = \\frac{1}{N - 1}\\sum_k (x_k - \\mu)^2

    and ``num_batches_tracked`` the number of batches. For a layer with no BatchNorm
    before it these are the statistics of the whole data set, as if the loader were one
    batch; deeper layers see their inputs as in training, each batch normalized by the
    layers before them with that batch's statistics. (``torch.optim.swa_utils.update_bn``
    averages per-batch statistics instead: the same mean only when all batches have the
    same size, and a variance that misses the spread between batches.) The moments are
    merged batch by batch in float64, in O(channels) memory.

    During the pass the whole model is in training mode (as in training, so dropout is
    active and each layer normalizes with the batch's statistics) and under
    ``torch.no_grad()``; the BatchNorm layers do not touch their buffers
    (``track_running_stats`` is off), so a pass that raises leaves them as they were.
    Afterwards every module's training mode and every BatchNorm setting is restored.
    BatchNorm layers (any ``_BatchNorm``: ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``) that
    keep no running statistics are skipped, and so are layers the pass never reached
    (with a warning). Statistics are those of the data this process sees: under DDP
    give each rank the same data, or all of it.

    Args:
        loader: an iterable of batches (a ``DataLoader``). A batch is the model's input
            (a tensor), a tuple or list whose first element is the input (``(x, y)``),
            or a dict whose first value is the input; ``input_fn`` overrides this.
        model: the network whose statistics to recompute; an emakit ``EMA`` updates its
            EMA model. DDP and ``torch.compile`` wrappers are fine.
        device: move each input there first (tensors, and tensors inside lists, tuples
            and dicts). Default None: inputs are used as given.
        input_fn: keyword-only; ``batch -> input`` to call the model with, for other
            batch layouts. Default None (the rules above).

    Raises:
        EMAValueError: the loader yielded no batches.
        EMAStateError: a lazy BatchNorm layer is not initialized yet.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> data = [(torch.randn(8, 3), torch.zeros(8)) for _ in range(4)]
        >>> update_bn(data, net)
        >>> int(net[1].num_batches_tracked)
        4
    """
    if isinstance(model, EMA):
        model = _ema_model("model", model)
    if not isinstance(model, nn.Module):
        raise EMATypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if input_fn is not None and not callable(input_fn):
        raise EMATypeError(f"input_fn must be a callable batch -> input, got {input_fn=!r}")
    get_input = input_fn if input_fn is not None else _first_input

    layers: list[tuple[str, _BatchNorm]] = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
    ]
    if not layers:
        return
    for name, m in layers:
        if isinstance(m.running_mean, nn.parameter.UninitializedBuffer):
            raise EMAStateError(
                f"BatchNorm layer {name!r} is lazy and not initialized yet; run one forward "
                f"pass through the model before update_bn"
            )

    modes = [(m, m.training) for m in model.modules()]
    moments = [_Moments() for _ in layers]
    handles = [
        m.register_forward_pre_hook(mom) for (_, m), mom in zip(layers, moments, strict=True)
    ]
    batches = 0
    try:
        for _, m in layers:
            m.track_running_stats = False
        model.train()
        for batch in loader:
            x = get_input(batch)
            if device is not None:  # the tensors in it, however nested (torch's pytrees)
                x = tree_utils.tree_map_only(Tensor, lambda t: t.to(device, non_blocking=True), x)
            model(x)
            batches += 1
    finally:
        for h in handles:
            h.remove()
        for _, m in layers:
            m.track_running_stats = True
        for module, mode in modes:
            module.training = mode
    if batches == 0:
        raise EMAValueError("the loader yielded no batches; update_bn needs data to measure")

    skipped = []
    for (name, m), mom in zip(layers, moments, strict=True):
        if mom.mean is None or mom.m2 is None:
            skipped.append(name)
            continue
        running_mean, running_var = m.running_mean, m.running_var
        if running_mean is None or running_var is None:  # pragma: no cover - filtered above
            continue
        running_mean.copy_(mom.mean)
        running_var.copy_(mom.m2 / max(mom.count - 1, 1))
        if m.num_batches_tracked is not None:
            m.num_batches_tracked.fill_(mom.batches)
    if skipped:
        warnings.warn(
            f"update_bn: the pass never reached the BatchNorm layers {skipped}; their "
            f"running statistics were left as they were",
            RuntimeWarning,
            stacklevel=2,
        )
