"""The keywords of :class:`~emakit.EMA`, validated once, and the runner they ask for.

:class:`EMAOptions` turns the constructor's keywords into checked values (each check in
:mod:`emakit._validate`, each error naming the argument, the value and the fix), refuses
combinations that cannot work, and builds the decay rule. ``EMA`` copies the values onto
itself as its public attributes.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import _validate as check
from .decay import DecayRule, ema_rule
from .engine.kernels import Impl
from .engine.runners import Runner, StreamRunner, SyncRunner, ThreadRunner
from .errors import EMATypeError, EMAValueError

__all__ = ["EMAOptions", "as_device", "make_runner"]

_IMPLS: dict[bool | None, Impl] = {None: "flat", True: "foreach", False: "loop"}

#: Keywords that only mean something for a module (refused for a pytree unless default).
_MODULE_ONLY = {
    "param_or_buffer_names_no_ema": frozenset(),
    "ignore_names": frozenset(),
    "ignore_startswith_names": frozenset(),
    "include_online_model": False,
    "update_model_with_ema_every": None,
    "forward_method_names": (),
    "move_ema_to_online_device": False,
    "lazy_init_ema": False,
    "stream": False,
}


def as_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None)."""
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


@dataclass
class EMAOptions:
    """The checked keywords of :class:`~emakit.EMA` (see its docstring for each)."""

    rule: DecayRule
    values: dict[str, Any]
    decay_groups: dict[str, float | Callable[[int], float]] = field(default_factory=dict)

    @classmethod
    def parse(cls, kw: Mapping[str, Any]) -> EMAOptions:
        """Check the keywords (``EMA.__init__``'s ``locals()``)."""
        groups = kw["decay_groups"]
        checked_groups: dict[str, float | Callable[[int], float]] = {}
        if groups is not None:
            if not isinstance(groups, Mapping):
                raise EMATypeError(
                    f"decay_groups must map name patterns to a beta or a schedule, e.g. "
                    f'{{"backbone.*": 0.999, "head.*": 0.99}}, got {type(groups).__name__}'
                )
            for pattern, rule in groups.items():
                if not isinstance(pattern, str):
                    raise EMATypeError(f"decay_groups keys must be str patterns, got {pattern!r}")
                checked_groups[pattern] = (
                    rule
                    if callable(rule)
                    else check.real(f"decay_groups[{pattern!r}]", rule, low=0.0, high=1.0)
                )
        rule = ema_rule(
            beta=kw["beta"],
            update_after_step=kw["update_after_step"],
            update_every=kw["update_every"],
            inv_gamma=kw["inv_gamma"],
            power=kw["power"],
            min_value=kw["min_value"],
            schedule=kw["schedule"],
            groups=list(checked_groups.values()),
        )
        device = as_device(kw["device"])
        async_update = kw["async_update"]
        forward_names = kw["forward_method_names"]
        if isinstance(forward_names, str):
            raise EMATypeError(
                f"forward_method_names must be a tuple of names, got the string "
                f"{forward_names!r}; wrap it: ({forward_names!r},)"
            )
        v: dict[str, Any] = {
            "beta": float(kw["beta"]),
            "update_after_step": kw["update_after_step"],
            "update_every": kw["update_every"],
            "inv_gamma": float(kw["inv_gamma"]),
            "power": float(kw["power"]),
            "min_value": float(kw["min_value"]),
            "schedule": kw["schedule"],
            "allow_different_devices": check.boolean(
                "allow_different_devices", kw["allow_different_devices"]
            )
            or device is not None,
            "use_foreach": check.optional_boolean("use_foreach", kw["use_foreach"]),
            "coerce_dtype": check.boolean("coerce_dtype", kw["coerce_dtype"]),
            "ema_dtype": check.floating_dtype("ema_dtype", kw["ema_dtype"]),
            "skip_nonfinite": check.boolean("skip_nonfinite", kw["skip_nonfinite"]),
            "device": device,
            "async_update": (
                check.boolean("async_update", async_update)
                if async_update is not None
                else device is not None
            ),
            "stream": check.boolean("stream", kw["stream"]),
            "param_or_buffer_names_no_ema": check.names(
                "param_or_buffer_names_no_ema", kw["param_or_buffer_names_no_ema"]
            ),
            "ignore_names": check.names("ignore_names", kw["ignore_names"]),
            "ignore_startswith_names": check.names(
                "ignore_startswith_names", kw["ignore_startswith_names"]
            ),
            "include_online_model": check.boolean(
                "include_online_model", kw["include_online_model"]
            ),
            "update_model_with_ema_every": check.optional_integer(
                "update_model_with_ema_every", kw["update_model_with_ema_every"], low=1
            ),
            "update_model_with_ema_beta": check.real(
                "update_model_with_ema_beta", kw["update_model_with_ema_beta"], low=0.0, high=1.0
            ),
            "move_ema_to_online_device": check.boolean(
                "move_ema_to_online_device", kw["move_ema_to_online_device"]
            ),
            "lazy_init_ema": check.boolean("lazy_init_ema", kw["lazy_init_ema"]),
            "forward_method_names": tuple(check.names("forward_method_names", forward_names)),
        }
        if v["stream"] and (device is not None or async_update):
            raise EMAValueError(
                "stream=True keeps the EMA on the model's GPU and updates it on a side stream; "
                "it cannot be combined with device= or async_update=True (use one or the other)"
            )
        return cls(rule, v, checked_groups)

    @property
    def impl(self) -> Impl:
        """The engine path ``use_foreach`` asks for."""
        return _IMPLS[self.values["use_foreach"]]

    def attributes(self) -> dict[str, Any]:
        """The public attributes of the EMA (ema-pytorch's names)."""
        return dict(self.values)

    def refuse_for_pytree(self) -> None:
        """Raise for keywords that only apply to a module."""
        for name, default in _MODULE_ONLY.items():
            value = self.values[name]
            if value != default and not (name == "forward_method_names" and not value):
                raise EMAValueError(
                    f"{name}={value!r} applies to an EMA of a module, not of a tensor or "
                    f"pytree; leave it at its default ({default!r}) for a pytree"
                )
        if self.decay_groups:
            raise EMAValueError(
                "decay_groups applies to an EMA of a module; give each pytree its own EMA"
            )

    def check_names(self, model: nn.Module) -> None:
        """Raise for names and patterns that match nothing in ``model``."""
        known = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
        for arg in ("param_or_buffer_names_no_ema", "ignore_names"):
            unknown = sorted(self.values[arg] - known)
            if unknown:
                raise EMAValueError(
                    f"{arg} names tensors the model does not have: {unknown}; "
                    f"check the spelling against model.named_parameters()/named_buffers()"
                )
        for prefix in self.values["ignore_startswith_names"]:
            if not any(n.startswith(prefix) for n in known):
                raise EMAValueError(
                    f"ignore_startswith_names has {prefix!r}, which starts no tensor name of "
                    f"the model"
                )
        for method in self.values["forward_method_names"]:
            if not callable(getattr(model, method, None)):
                raise EMAValueError(
                    f"forward_method_names has {method!r}, which is not a method of the model"
                )
        for pattern in self.decay_groups:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in known):
                raise EMAValueError(
                    f"decay_groups pattern {pattern!r} matches no tensor name of the model; "
                    f"patterns are fnmatch globs over named_parameters()/named_buffers() names"
                )


def make_runner(model: Any, device: object, async_update: bool, stream: bool) -> Runner:
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
