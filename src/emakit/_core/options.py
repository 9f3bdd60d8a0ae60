"""The checks of [`EMA`][emakit.EMA]'s keywords that need more than the value: against the
model (names that match nothing, methods, decay-group patterns), against the kind of
source (module-only keywords for a pytree), and the runner the keywords ask for.

Each single value is checked where ``EMA.__init__`` assigns it, by `emakit._validate`.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._dist.deepspeed import zero3_params
from .._engine.runners import Runner, StreamRunner, SyncRunner, ThreadRunner
from ..errors import EMAValueError

__all__ = ["MODULE_ONLY", "check_names", "make_runner", "refuse_for_pytree"]

#: Keywords that only mean something for a module, with their defaults (a pytree EMA
#: refuses any other value).
MODULE_ONLY: dict[str, object] = {
    "param_or_buffer_names_no_ema": frozenset(),
    "ignore_names": frozenset(),
    "ignore_startswith_names": frozenset(),
    "update_model_with_ema_every": None,
    "forward_method_names": (),
    "move_ema_to_online_device": False,
    "lazy_init_ema": False,
    "stream": False,
    "partition": False,
}


def refuse_for_pytree(ema: Any, group_patterns: list[str]) -> None:
    """Raise for keywords of ``ema`` that only apply to a module (see `MODULE_ONLY`)."""
    for name, default in MODULE_ONLY.items():
        value = getattr(ema, name)
        if value != default:
            raise EMAValueError(
                f"{name}={value!r} applies to an EMA of a module, not of a tensor or "
                f"pytree; leave it at its default ({default!r}) for a pytree"
            )
    if group_patterns:
        raise EMAValueError(
            "decay_groups applies to an EMA of a module; give each pytree its own EMA"
        )


def check_names(ema: Any, model: nn.Module, group_patterns: Iterable[str]) -> None:
    """Warn for tensor names of ``ema``'s keywords that match nothing in ``model`` (yet);
    raise for methods and ``decay_groups`` patterns that match nothing."""
    known = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
    # Names that match nothing *yet* are common in real trainers (a submodule that
    # cannot be deep-copied is removed while the EMA is built, then put back): warn.
    for arg in ("param_or_buffer_names_no_ema", "ignore_names"):
        unknown = sorted(getattr(ema, arg) - known)
        if unknown:
            warnings.warn(
                f"{arg} names tensors the model does not have (yet): {unknown}; they "
                f"apply if such tensors appear later. Check the spelling against "
                f"model.named_parameters()/named_buffers()",
                UserWarning,
                stacklevel=3,
            )
    prefixes = ema.ignore_startswith_names
    unmatched = sorted(p for p in prefixes if not any(n.startswith(p) for n in known))
    if unmatched:
        warnings.warn(
            f"ignore_startswith_names has {unmatched}, which start no tensor name of the "
            f"model (yet); they apply if such tensors appear later",
            UserWarning,
            stacklevel=3,
        )
    names = ema.forward_method_names
    if names and (ema.partition or zero3_params(model)):
        raise EMAValueError(
            f"forward_method_names={names!r} needs an EMA model of its own, which a "
            f"partitioned EMA (DeepSpeed ZeRO-3, or partition=True) does not have: call "
            f"the method on the online model inside ema.swap() instead, e.g. "
            f"with ema.swap(): model.{names[0]}(...)"
        )
    for method in names:
        if not callable(getattr(model, method, None)):
            raise EMAValueError(
                f"forward_method_names has {method!r}, which is not a method of the model"
            )
    for pattern in group_patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in known):
            raise EMAValueError(
                f"decay_groups pattern {pattern!r} matches no tensor name of the model; "
                f"patterns are fnmatch globs over named_parameters()/named_buffers() names"
            )


def make_runner(model: Any, async_update: bool, stream: bool) -> Runner:
    """The runner the keywords ask for: CUDA side stream, background thread, or inline."""
    if stream:
        tensors = [*model.parameters(), *model.buffers()] if isinstance(model, nn.Module) else []
        first = next((t for t in tensors if t.is_cuda), None)
        if first is None or not torch.cuda.is_available():
            raise EMAValueError(
                "stream=True needs a model on a CUDA device (got one with no CUDA tensors); "
                "leave stream=False on CPU"
            )
        return StreamRunner(first.device)
    if async_update:
        return ThreadRunner()
    return SyncRunner()
