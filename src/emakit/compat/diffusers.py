"""diffusers' ``EMAModel``, kept by emakit's engine: change one import.

.. code-block:: python

    from emakit.compat.diffusers import EMAModel  # was: from diffusers.training_utils import EMAModel

[`EMAModel`][emakit.compat.diffusers.EMAModel] has the signature, defaults, methods and
attributes of ``diffusers.training_utils.EMAModel`` (0.42), the same decay at every step
and the same files: its ``state_dict()`` and the folder ``save_pretrained()`` writes load in
diffusers, and diffusers' load in it, ``optimization_step`` included. The weights agree
with diffusers' to float32 rounding, not bit for bit: diffusers computes
``s - (1 - d) * (s - p)`` and emakit ``torch.lerp`` (which fuses the multiply-add), so the
last bit differs now and then, as it does between diffusers' own ``foreach=False`` and
``foreach=True`` paths. This module imports no peer: ``model_cls`` is the caller's class.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Mapping, Set
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _validate as check
from .._core.state import tensor_list_like
from .._files.atomic import atomic_folder
from ..ema import EMA
from ..errors import EMARuntimeError, EMATypeError, EMAValueError, user_stacklevel

__all__ = ["EMAModel"]

#: The settings ``state_dict()`` holds beside ``shadow_params`` (and ``save_pretrained``
#: writes into the model's ``config.json``), as diffusers names them.
_SETTINGS = (
    "decay",
    "min_decay",
    "optimization_step",
    "update_after_step",
    "use_ema_warmup",
    "inv_gamma",
    "power",
)
#: diffusers' deprecated keywords: ``max_value`` is ``decay``, ``min_value`` ``min_decay``,
#: ``device`` a ``to(device)`` after construction.
_DEPRECATED = {"max_value": "decay", "min_value": "min_decay", "device": "to(device)"}
#: A weights file of ``ModelMixin.save_pretrained``, its stem in group 1: ``<stem>.safetensors``
#: or ``.bin``, a shard ``<stem>-00001-of-00003.safetensors``, an index
#: ``<stem>.safetensors.index.json``.
_WEIGHTS_FILE = re.compile(r"(.+?)(?:-\d{5}-of-\d{5})?\.(?:safetensors|bin)(?:\.index\.json)?")


def _checked(values: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in ``values`` checked (each present one), as diffusers keeps them."""
    out = dict(values)
    for name in ("decay", "min_decay"):
        if name in out:
            out[name] = check.real(name, out[name], low=0.0, high=1.0)
    for name in ("inv_gamma", "power"):
        if name in out:
            check.real(name, out[name], low=0.0, low_open=True)  # kept as given: int or float
    for name in ("update_after_step", "optimization_step"):
        if name in out:
            out[name] = check.count(name, out[name])
    if "use_ema_warmup" in out:
        check.boolean("use_ema_warmup", out["use_ema_warmup"])
    return out


def _parameter_list(parameters: Iterable[Tensor] | nn.Module, method: str) -> list[Tensor]:
    """``parameters`` as a list; a module (diffusers' deprecated form) gives its parameters."""
    if isinstance(parameters, nn.Module):
        warnings.warn(
            f"passing a module to EMAModel{method} is deprecated in diffusers; pass "
            f"module.parameters()",
            FutureWarning,
            stacklevel=user_stacklevel(),  # the user's call, of any method
        )
        parameters = parameters.parameters()
    if isinstance(parameters, Tensor) or not isinstance(parameters, Iterable):
        raise EMATypeError(
            f"parameters must be an iterable of tensors (model.parameters()), got "
            f"{type(parameters).__name__}"
        )
    params = list(parameters)
    if not params or not all(isinstance(p, Tensor) for p in params):
        raise EMATypeError(
            f"parameters must be a non-empty iterable of tensors (model.parameters()), got "
            f"{[type(p).__name__ for p in params][:5]}"
        )
    return params


def _not_replaced_weights(name: str, written: Set[str]) -> bool:
    """Whether the entry ``name`` of the folder a save replaces is carried into the new
    one: everything but the weights files (shards and indexes included) of a stem the new
    save wrote weights under, which would shadow or mix with the new weights."""
    stems = {m.group(1) for n in written if (m := _WEIGHTS_FILE.fullmatch(n))}
    match = _WEIGHTS_FILE.fullmatch(name)
    return match is None or match.group(1) not in stems


class EMAModel:
    """An EMA of a list of parameters, diffusers' ``EMAModel`` with emakit underneath.

    Call [`step(parameters)`][emakit.compat.diffusers.EMAModel.step] after every optimizer
    step. Step ``n`` (``optimization_step`` after the call) moves every shadow tensor
    toward its parameter with the decay ``get_decay(n)``:

    .. math:: t = \\max(0, n - \\text{update\\_after\\_step} - 1), \\qquad
       d = \\begin{cases} 0 & t = 0 \\ (\\text{a copy}) \\\\
       \\text{clamp}\\big(1 - (1 + t / \\text{inv\\_gamma})^{-\\text{power}},
       \\text{min\\_decay}, \\text{decay}\\big) & \\text{use\\_ema\\_warmup} \\\\
       \\text{clamp}\\big(\\tfrac{1 + t}{10 + t}, \\text{min\\_decay}, \\text{decay}\\big)
       & \\text{otherwise} \\end{cases}

    Underneath, an [`EMA`][emakit.EMA] of the parameter list (``.ema``) does the work
    with a plan made once: one fused ``lerp_`` per dtype and device, no host read.

    Differences from diffusers 0.42, each deliberate:

    * weights within float32 rounding of diffusers' (see the module docstring);
    * a parameter with ``requires_grad=False`` is averaged like the others, where
      diffusers copies it at each step: the same value while it stays frozen;
    * ``load_state_dict`` copies ``shadow_params`` into the existing shadow (its device
      and dtype kept) where diffusers adopts the list, and a list of another length or
      shape raises; ``step()`` with parameters of another count raises where diffusers
      zips silently; unknown keywords raise where diffusers ignores them;
    * under DeepSpeed ZeRO-3, diffusers gathers each parameter; use
      ``emakit.EMA(engine)`` there instead (docs/distributed.md).

    Args:
        parameters: the parameters to track (``model.parameters()``); a module is
            accepted, as in diffusers, with a ``FutureWarning`` and ``use_ema_warmup=True``.
        decay: the ceiling of the decay. Default 0.9999.
        min_decay: the floor of the decay (after the first ``update_after_step + 1``
            steps). Default 0.0.
        update_after_step: steps that copy before averaging starts. Default 0.
        use_ema_warmup: the inverse-gamma warm-up instead of ``(1 + t) / (10 + t)``.
            Default False.
        inv_gamma: warm-up scale, > 0. Default 1.0.
        power: warm-up exponent, > 0. Default 2/3.
        foreach: diffusers' choice of kernels; kept for the signature and the
            attribute: emakit's engine picks its fused path either way. Default False.
        model_cls: the model class (``UNet2DModel`` ...) for ``save_pretrained``.
            Default None.
        model_config: the model's config for ``save_pretrained``. Default None.
        ema_dtype: keyword-only, emakit's; keep the shadow in at least this dtype, e.g.
            ``torch.float32`` for a bf16 model. Default None (the parameters' dtypes).
        skip_nonfinite: keyword-only, emakit's; skip a step whose parameters hold NaN or
            Inf, decided on the device. Default False.
        **kwargs: diffusers' deprecated ``max_value`` (``decay``), ``min_value``
            (``min_decay``) and ``device`` (``to(device)``), each with a ``FutureWarning``.

    Raises:
        EMATypeError, EMAValueError: a setting out of range or of the wrong type, or an
            unknown keyword.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> ema = EMAModel(net.parameters(), decay=0.999, use_ema_warmup=True)
        >>> ema.step(net.parameters())
        >>> ema.optimization_step, ema.cur_decay_value
        (1, 0.0)
        >>> ema.store(net.parameters()); ema.copy_to(net.parameters())  # evaluate on the EMA
        >>> ema.restore(net.parameters())
    """

    def __init__(
        self,
        parameters: Iterable[Tensor] | nn.Module,
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        foreach: bool = False,
        model_cls: Any | None = None,
        model_config: Any | None = None,
        *,
        ema_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_DEPRECATED))
        if unknown:
            raise EMATypeError(
                f"EMAModel got unknown keywords {unknown}; it takes diffusers' keywords "
                f"(and its deprecated {sorted(_DEPRECATED)}) plus emakit's ema_dtype and "
                f"skip_nonfinite"
            )
        for old, new in _DEPRECATED.items():
            if kwargs.get(old) is not None:
                warnings.warn(
                    f"EMAModel({old}=...) is deprecated in diffusers; use {new}",
                    FutureWarning,
                    stacklevel=2,
                )
        decay = kwargs["max_value"] if kwargs.get("max_value") is not None else decay
        min_decay = kwargs["min_value"] if kwargs.get("min_value") is not None else min_decay
        use_ema_warmup = use_ema_warmup or isinstance(parameters, nn.Module)  # as diffusers
        params = _parameter_list(parameters, "()")
        checked = _checked(
            {
                "decay": decay,
                "min_decay": min_decay,
                "update_after_step": update_after_step,
                "use_ema_warmup": use_ema_warmup,
                "inv_gamma": inv_gamma,
                "power": power,
            }
        )
        self.decay: float = checked["decay"]
        self.min_decay: float = checked["min_decay"]
        self.update_after_step: int = checked["update_after_step"]
        self.use_ema_warmup: bool = checked["use_ema_warmup"]
        self.inv_gamma: float = checked["inv_gamma"]
        self.power: float = checked["power"]
        self.foreach = check.boolean("foreach", foreach)
        self.model_cls = model_cls
        self.model_config = model_config
        self.ema_dtype = check.floating_dtype("ema_dtype", ema_dtype)
        self.skip_nonfinite = check.boolean("skip_nonfinite", skip_nonfinite)
        #: The decay of the last `step()` (None before the first).
        self.cur_decay_value: float | None = None
        #: What `store()` saved (on the CPU), until `restore()`.
        self.temp_stored_params: list[Tensor] | None = None
        self._bind(params, None)
        if kwargs.get("device") is not None:
            self.to(device=kwargs["device"])

    def _bind(self, params: list[Tensor], shadow: list[Tensor] | None) -> None:
        """Track ``params`` with an emakit EMA (a copy of them, or ``shadow`` adopted).
        Every call averages with the weight ``1 - get_decay(n)``: emakit's ``t`` is
        ``n - 1``."""
        self._ids = list(map(id, params))  # step() compares, to see other parameters
        self._ema = EMA(
            params,
            ema_model=shadow,
            update_after_step=0,
            update_every=1,
            schedule=self._decay_after,
            allow_different_devices=True,  # to(device) may move the shadow anywhere
            coerce_dtype=True,  # and to(dtype=) give it another dtype
            ema_dtype=self.ema_dtype,
            skip_nonfinite=self.skip_nonfinite,
        )

    def _decay_after(self, t: int) -> float:
        return self.get_decay(t + 1)

    # -- the counters -------------------------------------------------------------------

    @property
    def ema(self) -> EMA:
        """The [`EMA`][emakit.EMA] underneath (of the parameter list), e.g. for
        ``ema.ema.swap()``; rebuilt when `step()` is given other parameter objects."""
        return self._ema

    @property
    def optimization_step(self) -> int:
        """`step()` calls so far (also set by `load_state_dict()`)."""
        return self._ema.tracker.step

    @optimization_step.setter
    def optimization_step(self, value: int) -> None:
        value = check.count("optimization_step", value)
        self._ema.tracker.set_counters(step=value, initted=value > 0)

    @property
    def shadow_params(self) -> list[Tensor]:
        """The EMA tensors, in the order of the parameters (references, as in diffusers)."""
        return list(cast(list[Tensor], self._ema.ema_model))  # the EMA of a list: a list

    def get_decay(self, optimization_step: int) -> float:
        """The decay of step ``optimization_step`` (the class docstring's formula), in
        Python floats as diffusers computes it."""
        t = max(0, optimization_step - self.update_after_step - 1)
        if t <= 0:
            return 0.0
        if self.use_ema_warmup:
            decay = 1 - (1 + t / self.inv_gamma) ** -self.power
        else:
            decay = (1 + t) / (10 + t)
        return max(min(decay, self.decay), self.min_decay)

    # -- the update ---------------------------------------------------------------------

    @torch.no_grad()
    def step(self, parameters: Iterable[Tensor] | nn.Module) -> None:
        """Count one optimizer step and move the shadow toward ``parameters``.

        ``parameters`` are the ones given at construction (``model.parameters()``), in
        the same order; other parameter objects (the same model rebuilt) are paired by
        position and tracked from then on.
        """
        params = _parameter_list(parameters, ".step()")
        if list(map(id, params)) != self._ids:
            self._targets(params, "step")  # the same count, or an error
            saved = self._ema.tracker.snapshot()
            self._bind(params, self.shadow_params)
            self._ema.tracker.restore(saved)
        self._ema.update()
        self.cur_decay_value = self.get_decay(self.optimization_step)

    # -- reading and moving the shadow ----------------------------------------------------

    def _targets(self, parameters: Iterable[Tensor] | nn.Module, method: str) -> list[Tensor]:
        params = _parameter_list(parameters, f".{method}()")
        if len(params) != len(self._ids):
            raise EMAValueError(
                f"{method}() got {len(params)} parameters but the EMA holds "
                f"{len(self._ids)}; pass model.parameters() of the same model"
            )
        return params

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[Tensor] | nn.Module) -> None:
        """Copy the EMA weights into ``parameters`` (by position)."""
        for p, s in zip(self._targets(parameters, "copy_to"), self.shadow_params, strict=True):
            p.detach().copy_(s)

    def store(self, parameters: Iterable[Tensor] | nn.Module) -> None:
        """Keep a CPU copy of ``parameters`` for `restore()`."""
        params = _parameter_list(parameters, ".store()")
        self.temp_stored_params = [p.detach().cpu().clone() for p in params]

    @torch.no_grad()
    def restore(self, parameters: Iterable[Tensor] | nn.Module) -> None:
        """Copy what `store()` kept back into ``parameters``, and forget it.

        Raises:
            EMARuntimeError: nothing was stored.
        """
        stored = self.temp_stored_params
        if stored is None:
            raise EMARuntimeError("restore() needs a store() first: nothing is stored")
        params = _parameter_list(parameters, ".restore()")
        if len(params) != len(stored):
            raise EMAValueError(
                f"restore() got {len(params)} parameters but store() kept {len(stored)}"
            )
        for p, s in zip(params, stored, strict=True):
            p.detach().copy_(s)
        self.temp_stored_params = None

    @torch.no_grad()
    def to(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> None:
        """Move the shadow to ``device`` and give its floating tensors ``dtype``; the
        next `step()` plans for the new place."""
        for s in self.shadow_params:
            s.data = s.data.to(
                device=device,
                dtype=dtype if s.is_floating_point() else None,
                non_blocking=non_blocking,
            )

    def pin_memory(self) -> None:
        """Put the shadow (on the CPU) in pinned memory, for non-blocking copies."""
        for s in self.shadow_params:
            s.data = s.data.pin_memory()

    # -- state and files -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """diffusers' state: the settings and the shadow tensors (references)::

        {"decay": 0.9999, "min_decay": 0.0, "optimization_step": 1234,
         "update_after_step": 0, "use_ema_warmup": False, "inv_gamma": 1.0,
         "power": 0.6667, "shadow_params": [tensor(...), ...]}
        """
        state = {name: getattr(self, name) for name in _SETTINGS}
        state["shadow_params"] = self.shadow_params
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state of `state_dict()` or of diffusers' ``EMAModel`` (or the settings
        alone, as ``from_pretrained`` passes them); absent settings keep their values.

        Everything is checked before anything changes: a bad setting, or
        ``shadow_params`` of another count or shape, raises and leaves the EMA as it was.
        """
        if not isinstance(state_dict, Mapping):
            raise EMATypeError(
                f"state_dict must be a mapping (EMAModel.state_dict()), got "
                f"{type(state_dict).__name__}"
            )
        settings = _checked({k: state_dict[k] for k in _SETTINGS if k in state_dict})
        shadow = state_dict.get("shadow_params")
        ours = self.shadow_params
        if shadow is not None:
            shadow = tensor_list_like("EMAModel.load_state_dict", "shadow_params", shadow, ours)
            for t, s in zip(shadow, ours, strict=True):
                s.copy_(t)
        step = settings.pop("optimization_step", None)
        for name, value in settings.items():
            setattr(self, name, value)
        if step is not None:
            self.optimization_step = step

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        """Write the EMA weights as ``model_cls`` saves a model, with the settings of
        `state_dict()` (``optimization_step`` included) in its ``config.json``: the
        folder diffusers' ``EMAModel.from_pretrained`` reads.

        The folder is replaced as a whole: the model writes a new folder beside ``path``,
        which then takes its place in one atomic exchange (``emakit._files.atomic``), so a reader, or a
        process killed at any moment, finds the previous save or this one, never the
        config of one with the weights of the other. A failed save changes nothing.
        Weights files of an earlier save that this one did not write (the shards and index
        of a sharded save, a ``.bin`` beside a new ``.safetensors``) are gone with the old
        folder; anything else in it (your own files and subfolders) is carried into the
        new one as hard links. The new folder keeps the old one's permission bits; a
        symbolic link at ``path`` stays, and the folder it points to is replaced.

        Where the file system has no atomic exchange of two folders, the old folder is
        first renamed to ``.<name>.emakit-old-XXXXXXXX`` and the new one then to
        ``path``: a process killed between those two renames leaves no folder at
        ``path`` until the next save (of the same ``path``) renames the old one back.
        Each save also deletes the staging folders of killed saves.

        Raises:
            EMAValueError: ``model_cls`` or ``model_config`` was not given.
        """
        model_cls, config = self.model_cls, self.model_config
        if model_cls is None or config is None:
            missing = "model_cls" if model_cls is None else "model_config"
            raise EMAValueError(
                f"save_pretrained needs {missing}= at construction (e.g. model_cls="
                f"UNet2DModel, model_config=unet.config), got {missing}=None"
            )
        model = model_cls.from_config(config)
        model.register_to_config(**{name: getattr(self, name) for name in _SETTINGS})
        self.copy_to(model.parameters())
        with atomic_folder(path, carry=_not_replaced_weights) as staged:
            model.save_pretrained(staged)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], model_cls: Any, foreach: bool = False
    ) -> EMAModel:
        """Read a folder `save_pretrained()` (or diffusers' ``EMAModel``) wrote.

        Args:
            path: the folder.
            model_cls: the model class that wrote it (``UNet2DModel`` ...).
            foreach: as in the constructor. Default False.
        """
        config = model_cls.load_config(path)
        model = model_cls.from_pretrained(path)
        ema = cls(model.parameters(), model_cls=model_cls, model_config=model.config)
        ema.foreach = check.boolean("foreach", foreach)
        if "optimization_step" not in config:
            warnings.warn(
                f"{path} has no optimization_step in its config.json (a model folder, not "
                f"an EMAModel folder): the EMA starts at step 0",
                UserWarning,
                stacklevel=2,
            )
        ema.load_state_dict({k: config[k] for k in _SETTINGS if k in config})
        return ema
