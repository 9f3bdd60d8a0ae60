"""Inputs and outputs of ``ema(x)`` when the shadow's dtype or device differs from the model's.

With ``ema_dtype=torch.float32`` on a bf16 model the EMA model holds fp32 weights, and
with ``device="cpu"`` it lives on the CPU while the model is on a GPU. The model's own
inputs (bf16 activations, CUDA tensors) would then fail inside the EMA model ("mat1 and
mat2 must have the same dtype", "Expected all tensors to be on the same device"). So
``EMA.forward`` maps its arguments through an `IOCast`:

* **inputs**: floating-point tensors are cast to the shadow's dtype (with ``ema_dtype``),
  every tensor is moved to the shadow's device (with ``device=``); integer and bool
  tensors keep their dtype (token ids, masks);
* **outputs**: floating-point tensors in the shadow's dtype are cast back to the model's
  dtype, and tensors on the shadow's device are moved back to the model's device, so
  ``ema(x)`` returns what ``model(x)`` returns, computed with the EMA weights at the
  shadow's precision.

Tensors nested in tuples, lists, named tuples and dicts (and dict-like outputs such as
Hugging Face's ``ModelOutput``) are mapped too; anything else passes through unchanged.
Nothing is mapped when the shadow matches the model (no ``ema_dtype``, no ``device=``):
``ema(x)`` then calls the EMA model with the very objects it was given.

Sharded EMA models (FSDP2) need two more things, both here:

* `eval_call()` runs the EMA model (eval mode, no grad) between two ``reshard()`` of
  its FSDP modules. A root sharded with ``reshard_after_forward=False`` (the usual recipe,
  also inside an ``ema_model=`` factory) keeps its all-gathered weights after a forward;
  the next forward would reuse them although ``update()`` has changed the shards since.
* `ForwardMethod` is what ``forward_method_names`` puts on the wrapper
  (``ema.generate``). For an FSDP2 EMA model the method is registered with
  ``register_fsdp_forward_method`` (so FSDP gathers the root's weights around it, as for
  ``forward``) and runs between two ``reshard()`` as well.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._dist.dtensor import fsdp_modules, reshard


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` (nested tuples, lists, dicts), keeping the
    containers' types; other objects are returned as they are.

    Args:
        obj: a tensor, a container of tensors, or anything else.
        fn: maps one tensor.

    Returns:
        ``obj`` with its tensors mapped (a new container when it is one).
    """
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        items = [map_tensors(x, fn) for x in obj]
        kind: Any = type(obj)
        return kind._make(items) if hasattr(obj, "_fields") else kind(items)
    if isinstance(obj, list):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)  # keeps the class (dict, OrderedDict, ModelOutput, ...)
        for k, v in obj.items():
            out[k] = map_tensors(v, fn)
        return out
    return obj


def _only(values: set[Any]) -> Any:
    return next(iter(values)) if len(values) == 1 else None


@dataclass(frozen=True)
class IOCast:
    """How ``ema(x)`` maps its inputs to the shadow and its outputs back to the model.

    Attributes:
        shadow_dtype: floating inputs are cast to it (None: dtypes are left alone).
        model_dtype: floating outputs in ``shadow_dtype`` are cast back to it (None: left
            in the shadow's dtype, e.g. for a model with several floating dtypes).
        shadow_device: tensors are moved to it (None: devices are left alone).
        model_device: outputs on ``shadow_device`` are moved back to it.
    """

    shadow_dtype: torch.dtype | None
    model_dtype: torch.dtype | None
    shadow_device: torch.device | None
    model_device: torch.device | None

    def _in(self, t: Tensor) -> Tensor:
        dtype = self.shadow_dtype if t.is_floating_point() else None
        return t.to(device=self.shadow_device, dtype=dtype)  # itself when nothing changes

    def _out(self, t: Tensor) -> Tensor:
        dtype = self.model_dtype if t.is_floating_point() and t.dtype == self.shadow_dtype else None
        device = self.model_device if t.device == self.shadow_device else None
        return t.to(device=device, dtype=dtype)

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``(args, kwargs)`` with their tensors cast and moved to the shadow."""
        return map_tensors(args, self._in), map_tensors(kwargs, self._in)

    def outputs(self, out: Any) -> Any:
        """``out`` with its tensors cast and moved back to the model's dtype and device."""
        return map_tensors(out, self._out)


def io_cast(model: nn.Module, ema_model: nn.Module, *, dtype: bool, device: bool) -> IOCast | None:
    """The `IOCast` that lets ``ema_model`` take ``model``'s inputs, or None when
    nothing needs mapping.

    Args:
        model: the online model.
        ema_model: its EMA copy.
        dtype: map dtypes (the EMA has an ``ema_dtype``).
        device: map devices (the EMA has a ``device=``).

    Returns:
        None when the EMA model has the model's floating dtype and device (or when neither
        is asked for), else the mapping.
    """
    if not (dtype or device):
        return None
    shadow = [t for t in (*ema_model.parameters(), *ema_model.buffers()) if t.is_floating_point()]
    online = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    shadow_dtype = _only({t.dtype for t in shadow}) if dtype else None
    model_dtype = _only({t.dtype for t in online}) if dtype else None
    shadow_device = _only({t.device for t in shadow}) if device else None
    model_device = _only({t.device for t in online}) if device else None
    if shadow_dtype == model_dtype:
        shadow_dtype = model_dtype = None
    if shadow_device == model_device or model_device is None:
        shadow_device = model_device = None
    if shadow_dtype is None and shadow_device is None:
        return None
    return IOCast(shadow_dtype, model_dtype, shadow_device, model_device)


def eval_call(module: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``module`` in eval mode, without grad, on fresh shards.

    Each submodule's mode is restored afterwards, also when ``fn`` raises. FSDP2 modules of
    ``module`` are resharded before the call (a previous forward may have left gathered
    weights that predate the latest update) and after it (so the module registers its
    DTensor shards again and holds no gathered copy).

    Args:
        module: the EMA model.
        fn: what to call (the module itself, or one of its methods).
        args, kwargs: the call's arguments.

    Returns:
        What ``fn`` returns.
    """
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            return _resharded(module, fn, args, kwargs)
    finally:
        for m, mode in modes:
            m.training = mode


def _resharded(module: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` between two ``reshard()`` of ``module``'s FSDP2 modules."""
    sharded = fsdp_modules(module)
    reshard(sharded)
    try:
        return fn(*args, **kwargs)
    finally:
        reshard(sharded)


class ForwardMethod:
    """A method of the EMA model exposed on the EMA wrapper (``forward_method_names``).

    Calling it waits for a background update in flight (``before``), then calls
    ``module.<name>``. For an FSDP2 module the method is registered with
    ``register_fsdp_forward_method`` first (unless it already is, e.g. because the model's
    was and [`copy_module()`][emakit._core.sharding.copy_module] registered the copy's), and every
    call runs between two ``reshard()``; it is then a collective: call it on every rank.
    The mode (train/eval) and grad mode are the caller's, as in ema-pytorch.

    Args:
        module: the EMA model.
        name: the method's name.
        before: called before each call (the runner's ``wait``).
    """

    def __init__(self, module: nn.Module, name: str, before: Callable[[], object]) -> None:
        self.module = module
        self.name = name
        self.before = before
        if fsdp_modules(module) and not _registered(module, name):
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before()
        return _resharded(self.module, getattr(self.module, self.name), args, kwargs)

    def __repr__(self) -> str:
        return f"<EMA forward method {type(self.module).__name__}.{self.name}>"


def _registered(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is an instance attribute wrapping the module's own method
    (what ``register_fsdp_forward_method`` sets)."""
    value = module.__dict__.get(name)
    inner = getattr(getattr(value, "__func__", None), "__wrapped__", None)
    return getattr(inner, "__self__", None) is module
