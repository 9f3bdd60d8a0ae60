"""``EMAModuleWrapper``: feed the outputs of EMA submodules into the online model's forward.

Self-distillation and teacher-student setups (BYOL, DINO-style targets, consistency
models) run the EMA "teacher" on the same input and hand some of its intermediate outputs
to the online "student". The wrapper does the plumbing with forward hooks: a hook on each
chosen EMA submodule captures its output during an EMA forward (no grad, eval mode), and a
pre-hook on the matching online submodule passes it in as a keyword argument. Keyword- and
behaviour-compatible with ``ema_pytorch.EMAModuleWrapper`` 0.8.3.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from ._core.forward import eval_call
from .ema import EMA
from .errors import EMATypeError, EMAValueError

__all__ = ["EMAModuleWrapper", "ModuleKwargSpec", "parse_module_kwargs"]


@dataclass(frozen=True)
class ModuleKwargSpec:
    """The online submodule at ``receiver_path`` receives, as keyword ``kwarg_name``, the
    output of the EMA submodule at ``ema_path`` (passed through ``transform`` if given)."""

    receiver_path: str
    ema_path: str
    kwarg_name: str = "ema_output"
    transform: Callable[[Any], Any] | None = None


def _submodule(model: nn.Module, path: str) -> nn.Module:
    return model if path in ("", ".") else model.get_submodule(path)


def parse_module_kwargs(
    model: nn.Module, spec: Mapping[str, Any] | Iterable[str] | None, default_kwarg: str
) -> list[ModuleKwargSpec]:
    """The specs of ``ema_module_kwargs`` (every form ema-pytorch accepts).

    * paths (a list, tuple or set): each online submodule receives the output of the EMA
      submodule at the same path, as ``default_kwarg``;
    * ``{receiver: ema_path}`` or ``{receiver: kwarg_name}`` (a string that is not a
      submodule path names the keyword; the EMA path is then the receiver's own);
    * ``{receiver: (ema_path, kwarg_name, transform)}`` (trailing items optional, None
      for the default);
    * ``{receiver: {"ema_path" or "ema_module_path": ..., "kwarg_name" or "ema_kwarg":
      ..., "transform": ...}}``.
    """
    if spec is None:
        return []
    if isinstance(spec, (list, tuple, set, frozenset)):
        return [ModuleKwargSpec(p, p, default_kwarg) for p in spec]
    if not isinstance(spec, Mapping):
        raise EMATypeError(
            f"ema_module_kwargs must be a list of submodule paths or a dict, got "
            f"{type(spec).__name__}"
        )
    out = []
    for receiver, value in spec.items():
        if isinstance(value, str):
            try:  # a submodule path names the EMA submodule, anything else the keyword
                _submodule(model, value)
                out.append(ModuleKwargSpec(receiver, value, default_kwarg))
            except AttributeError:
                out.append(ModuleKwargSpec(receiver, receiver, value))
        elif isinstance(value, (tuple, list)):
            ema_path, kwarg, transform = (*value, None, None, None)[:3]
            out.append(
                ModuleKwargSpec(receiver, ema_path or receiver, kwarg or default_kwarg, transform)
            )
        elif isinstance(value, Mapping):
            out.append(
                ModuleKwargSpec(
                    receiver,
                    value.get("ema_module_path", value.get("ema_path", receiver)),
                    value.get("ema_kwarg", value.get("kwarg_name", default_kwarg)),
                    value.get("transform"),
                )
            )
        else:
            raise EMATypeError(
                f"ema_module_kwargs[{receiver!r}] must be a path, a keyword name, a tuple or "
                f"a dict, got {type(value).__name__}"
            )
    return out


class EMAModuleWrapper(nn.Module):
    """An [`EMA`][emakit.EMA] whose submodule outputs feed the online model's forward.

    Args:
        model: the online model.
        ema: an existing [`EMA`][emakit.EMA] of ``model``. Default None: one is built with
            ``**ema_kwargs``.
        ema_module_kwargs: which EMA submodule outputs go to which online submodules (see
            `parse_module_kwargs()`). Default None: none (a plain EMA).
        default_ema_kwarg: the keyword name when a spec gives none. Default
            ``"ema_output"``.
        forward_online_during_train: while the model trains and specs exist, ``wrapper(x)``
            runs the EMA then the online model (see [`forward()`][emakit.wrapper.EMAModuleWrapper.forward]);
            otherwise it runs the EMA model. Default True.
        **ema_kwargs: keywords of [`EMA`][emakit.EMA].

    Example:
        >>> class Head(torch.nn.Linear):
        ...     def forward(self, x, ema_output=None):
        ...         return super().forward(x if ema_output is None else x + ema_output)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), Head(4, 2))
        >>> wrapper = EMAModuleWrapper(net, ema_module_kwargs={"1": "0"}, update_every=1)
        >>> y = wrapper(torch.randn(3, 4))  # training: EMA "0" feeds online "1" as ema_output
    """

    def __init__(
        self,
        model: nn.Module,
        ema: EMA | None = None,
        ema_module_kwargs: Mapping[str, Any] | Iterable[str] | None = None,
        default_ema_kwarg: str = "ema_output",
        forward_online_during_train: bool = True,
        **ema_kwargs: Any,
    ) -> None:
        super().__init__()
        if ema is not None and not isinstance(ema, EMA):
            raise EMATypeError(f"ema must be an emakit EMA, got {type(ema).__name__}")
        self.ema = ema if ema is not None else EMA(model, **ema_kwargs)
        self.ema_module_kwargs = ema_module_kwargs
        self.default_ema_kwarg = default_ema_kwarg
        self.forward_online_during_train = forward_online_during_train
        self._hook_handles: list[Any] = []
        self._captured: dict[str, Any] = {}
        self.register_ema_module_hooks()

    @property
    def model(self) -> nn.Module:
        """The online model."""
        return self.ema.model

    @property
    def ema_model(self) -> nn.Module:
        """The EMA model."""
        return self.ema.ema_model

    def update(self) -> None:
        """[`emakit.EMA.update()`][emakit.EMA.update]."""
        self.ema.update()

    def update_model_with_ema(self, decay: float | None = None) -> None:
        """[`emakit.EMA.update_model_with_ema()`][emakit.EMA.update_model_with_ema]."""
        self.ema.update_model_with_ema(decay=decay)

    def eval(self) -> EMAModuleWrapper:
        """Put the EMA model in eval mode."""
        self.ema.eval()
        self.training = False
        return self

    def forward_eval(self, *args: Any, **kwargs: Any) -> Any:
        """The EMA model in eval mode, without grad (`emakit.EMA.forward_eval()`)."""
        return self.ema.forward_eval(*args, **kwargs)

    # -- hooks -------------------------------------------------------------------------

    def remove_ema_module_hooks(self) -> None:
        """Remove the capture and injection hooks."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def register_ema_module_hooks(self) -> None:
        """(Re)install a capture hook per EMA submodule and an injection pre-hook per
        online submodule, as ``ema_module_kwargs`` says.

        Raises:
            EMAValueError: an online submodule's ``forward`` does not accept the keyword.
        """
        self.remove_ema_module_hooks()
        ema_model = self.ema.ema_model
        if self.ema_module_kwargs is None or ema_model is None:
            return
        for spec in parse_module_kwargs(self.model, self.ema_module_kwargs, self.default_ema_kwarg):
            receiver = _submodule(self.model, spec.receiver_path)
            params = inspect.signature(receiver.forward).parameters
            if spec.kwarg_name not in params and not any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            ):
                raise EMAValueError(
                    f"submodule {spec.receiver_path!r} must accept the keyword "
                    f"{spec.kwarg_name!r} in its forward to receive the EMA output of "
                    f"{spec.ema_path!r}; add it (or **kwargs), or name another keyword"
                )
            source = _submodule(ema_model, spec.ema_path)
            self._hook_handles.append(source.register_forward_hook(partial(self._capture, spec)))
            self._hook_handles.append(
                receiver.register_forward_pre_hook(partial(self._inject, spec), with_kwargs=True)
            )

    def _capture(self, spec: ModuleKwargSpec, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook on an EMA submodule: keep its (transformed) output."""
        self._captured[spec.ema_path] = output if spec.transform is None else spec.transform(output)

    def _inject(
        self, spec: ModuleKwargSpec, module: nn.Module, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """Forward pre-hook on an online submodule: pass the kept output as a keyword."""
        if spec.ema_path in self._captured:
            kwargs[spec.kwarg_name] = self._captured[spec.ema_path]
        return args, kwargs

    # -- forward -----------------------------------------------------------------------

    def forward(
        self,
        *args: Any,
        forward_online: bool | None = None,
        only_online: bool = False,
        only_ema: bool = False,
        ema_args: Any = None,
        ema_kwargs: dict[str, Any] | None = None,
        auto_normalize_ema_args: bool = True,
        **kwargs: Any,
    ) -> Any:
        """While the model trains and specs exist (``forward_online=None``, the default),
        or with ``forward_online=True``: run the EMA model (no grad, eval mode) to capture
        its outputs, then the online model, which receives them. ``only_online``/
        ``only_ema`` run just one of them; ``ema_args``/``ema_kwargs`` give the EMA other
        inputs (a dict for ``ema_args`` means keywords; one non-tuple value one positional
        argument). Otherwise: the EMA model."""
        if forward_online is None:
            forward_online = (
                self.ema_module_kwargs is not None
                and self.model.training
                and self.forward_online_during_train
            )
        if only_online and only_ema:
            raise EMAValueError("only_online and only_ema cannot both be True")
        if (only_online or only_ema) and (ema_args is not None or ema_kwargs is not None):
            raise EMAValueError("ema_args/ema_kwargs apply only when both models run")
        if only_ema or not (only_online or forward_online):
            return self.ema.ema_model(*args, **kwargs)
        self._captured.clear()
        if only_online:
            return self.model(*args, **kwargs)
        ema_model = self.ema.ema_model
        if ema_model is None:
            raise EMAValueError("the EMA model does not exist yet (lazy_init_ema): update() first")
        if auto_normalize_ema_args and ema_args is not None:
            if isinstance(ema_args, dict):
                ema_kwargs, ema_args = {**ema_args, **(ema_kwargs or {})}, ()
            elif not isinstance(ema_args, tuple):
                ema_args = (ema_args,)
        ema_args = args if ema_args is None else ema_args
        eval_call(ema_model, ema_model, ema_args, kwargs if ema_kwargs is None else ema_kwargs)
        try:
            return self.model(*args, **kwargs)
        finally:
            self._captured.clear()

    def forward_online(self, *args: Any, **kwargs: Any) -> Any:
        """[`forward(..., forward_online=True)`][emakit.wrapper.EMAModuleWrapper.forward]:
        the EMA model, then the online model fed its outputs (same keywords)."""
        return self.forward(*args, forward_online=True, **kwargs)
