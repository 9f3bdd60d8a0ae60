"""Checkpoints of other EMA libraries (and emakit's own) loaded into an emakit EMA.

* :func:`load_foreign_state` loads the state of ema-pytorch, timm, torch_ema,
  ``torch.optim.swa_utils.AveragedModel`` and diffusers ``EMAModel`` into an emakit EMA,
  from the object their ``state_dict()`` returns or from a torch or safetensors file.
* :func:`detect_format` guesses which of :data:`FOREIGN_FORMATS` a checkpoint is in.

Every failure (missing, truncated or corrupt file, unknown format, a checkpoint of another
model) raises an :class:`~emakit.EMAError` that names the source and what is wrong.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._safetensors import read_safetensors, require_file
from .checkpoint import WEIGHTS_FORMAT, check_ema, int_meta, load_weights
from .ema import EMA
from .errors import EMAError, EMAStateError, EMATypeError, EMAValueError

__all__ = ["FOREIGN_FORMATS", "detect_format", "load_foreign_state"]

#: Formats :func:`load_foreign_state` accepts (besides ``"auto"``).
FOREIGN_FORMATS = (
    "emakit",
    "ema_pytorch",
    "timm",
    "torch_ema",
    "averaged_model",
    "diffusers",
    "state_dict",
)


def _load_file(path: Path) -> tuple[Any, dict[str, str] | None]:
    """A checkpoint file's content and, for safetensors, its header metadata."""
    require_file(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then the JSON header
        return read_safetensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only" in str(e):
            raise EMAStateError(
                f"{path} holds objects other than tensors and plain containers, which emakit "
                f"does not unpickle; if you trust the file, load it yourself with "
                f"torch.load(path, weights_only=False) and pass the result"
            ) from e
        raise _unreadable(path, e) from e
    except Exception as e:
        raise _unreadable(path, e) from e


def _unreadable(path: Path, e: BaseException) -> EMAStateError:
    return EMAStateError(
        f"{path} is not a readable torch checkpoint ({type(e).__name__}: {e}); it may be "
        f"truncated or corrupt"
    )


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        keys = [str(k) for k in obj]
        return f"a mapping with keys {keys[:12]}{' ...' if len(keys) > 12 else ''}"
    return f"a {type(obj).__name__}"


def _is_tensor_map(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())
    )


def detect_format(obj: Any) -> str | None:
    """Guess the format of a checkpoint object from its keys.

    Args:
        obj: what a library's ``state_dict()`` returned, or what ``torch.load`` gave.

    Returns:
        The :data:`FOREIGN_FORMATS` entry ``obj`` looks like, or None when none fits.

    Example:
        >>> detect_format({"n_averaged": torch.tensor(3), "module.weight": torch.zeros(1)})
        'averaged_model'
    """
    if not isinstance(obj, Mapping):
        return None
    keys = [k for k in obj if isinstance(k, str)]
    if any(isinstance(obj.get(k), Mapping) for k in ("state_dict_ema", "model_ema")):
        return "timm"
    if isinstance(obj.get("shadow_params"), (list, tuple)):
        if "optimization_step" in obj:
            return "diffusers"
        if "num_updates" in obj or "collected_params" in obj:
            return "torch_ema"
        return None
    if "n_averaged" in obj and any(k.startswith("module.") for k in keys):
        return "averaged_model"
    if "version" in obj and any(k.startswith(("ema_model.", "ema.")) for k in keys):
        return "emakit"
    if ("initted" in obj or "step" in obj) and any(k.startswith("ema_model.") for k in keys):
        return "ema_pytorch"
    if _is_tensor_map(obj):
        return "timm" if all(k.startswith("module.") for k in keys) else "state_dict"
    return None


def _require_keys(obj: Any, fmt: str, source: str, keys: tuple[str, ...]) -> None:
    if not isinstance(obj, Mapping) or any(k not in obj for k in keys):
        raise EMAStateError(
            f"format={fmt!r} needs the keys {list(keys)}, but {source} is {_describe(obj)}"
        )


def _positional(ema: EMA, shadow: Any, source: str, fmt: str) -> dict[str, Tensor]:
    """torch_ema/diffusers ``shadow_params`` (a list in ``model.parameters()`` order) as
    named weights. Buffers, which those libraries do not track, keep the EMA's values."""
    if not isinstance(shadow, (list, tuple)) or not all(isinstance(t, Tensor) for t in shadow):
        raise EMAStateError(f"{source} ({fmt}): shadow_params must be a list of tensors")
    ema_model: nn.Module = ema.ema_model  # load_foreign_state built it
    params = list(ema_model.named_parameters())
    if len(shadow) != len(params):
        raise EMAStateError(
            f"{source} ({fmt}) holds {len(shadow)} shadow_params but the model has "
            f"{len(params)} parameters; the checkpoint must come from the same model's "
            f".parameters() (in that order, with no filtering)"
        )
    weights = dict(ema_model.state_dict())
    aliases: dict[int, list[str]] = {}
    for name, p in ema_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for i, ((name, p), t) in enumerate(zip(params, shadow, strict=True)):
        if t.shape != p.shape:
            raise EMAStateError(
                f"{source} ({fmt}): shadow_params[{i}] has shape {tuple(t.shape)} but parameter "
                f"{i} of the model, {name!r}, has shape {tuple(p.shape)}; it was saved from "
                f"another model"
            )
        for alias in aliases[id(p)]:
            weights[alias] = t
    return weights


def _as_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        return int(value.item())
    return int(value)


def load_foreign_state(
    ema: EMA,
    obj: Any,
    format: str = "auto",
    *,
    step: int | None = None,
    strict: bool = True,
) -> str:
    """Load the EMA state of another library (or of emakit) into ``ema``.

    Accepted formats (``format=``), detected from the keys when ``"auto"``:

    ========================  ==============================================================
    ``"emakit"``              :meth:`emakit.EMA.state_dict` (has ``version``)
    ``"ema_pytorch"``         ``ema_pytorch.EMA.state_dict()`` 0.8.3, with or without
                              ``online_model.*`` (those keys are ignored)
    ``"timm"``                a timm training checkpoint (``state_dict_ema``/``model_ema``
                              entry) or ``ModelEmaV2``/``V3.state_dict()`` (``module.*``)
    ``"torch_ema"``           ``torch_ema.ExponentialMovingAverage.state_dict()``
    ``"averaged_model"``      ``torch.optim.swa_utils.AveragedModel.state_dict()``
                              (``module.*`` and ``n_averaged``)
    ``"diffusers"``           ``diffusers.training_utils.EMAModel.state_dict()``
    ``"state_dict"``          a plain ``state_dict()`` of the model (e.g. exported weights)
    ========================  ==============================================================

    Tensors are paired by name, strictly; DDP (``module.``) and ``torch.compile``
    (``_orig_mod.``) prefixes are stripped. torch_ema and diffusers store a list in
    ``model.parameters()`` order: it is paired by position with the EMA model's
    parameters, and a count or shape mismatch is an error; buffers, which they do not
    track, keep the EMA's current values. Values are copied into the existing shadow, so
    its dtype is kept.

    The EMA's ``step`` becomes the source's update count where it has one (ema-pytorch
    ``step``, torch_ema ``num_updates``, diffusers ``optimization_step``,
    ``AveragedModel`` ``n_averaged``); timm and plain state dicts have none, so the EMA
    keeps its step unless ``step=`` is given. The EMA counts as initialized afterwards.
    A warning is given when the resulting step is still inside the warm-up
    (``step <= update_after_step``), where the next ``update()`` would copy the model over
    the loaded weights.

    Args:
        ema: the :class:`~emakit.EMA` to load into (an :class:`~emakit.EMAPytree` accepts
            only the ``"emakit"`` format).
        obj: the checkpoint: a mapping (what the library's ``state_dict()`` returns, or
            what ``torch.load`` gave), an object with a ``state_dict()`` method, or the
            path of a torch or safetensors file (read with ``weights_only=True``).
        format: one of :data:`FOREIGN_FORMATS`, or ``"auto"`` (default) to detect it.
        step: the training step to set (overrides the checkpoint's count). Default None.
        strict: pair names strictly (default True); with False, tensors absent from the
            checkpoint keep their values and extra ones are ignored.

    Returns:
        The format that was loaded.

    Raises:
        EMAStateError: the format is unknown or does not fit, the checkpoint belongs to
            another model, or the file is unreadable (the message names the source, what
            was found and the accepted formats).
        EMAFileNotFoundError: ``obj`` is a path that does not exist.

    Example:
        >>> import torch_ema
        >>> net = torch.nn.Linear(2, 2)
        >>> theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.99)
        >>> theirs.update()
        >>> ema = EMA(net, update_after_step=0)
        >>> load_foreign_state(ema, theirs.state_dict())
        'torch_ema'
    """
    check_ema(ema)
    if not isinstance(format, str):
        raise EMATypeError(
            f"format must be a str, 'auto' or one of {FOREIGN_FORMATS}, got format={format!r}"
        )
    if format != "auto" and format not in FOREIGN_FORMATS:
        raise EMAValueError(
            f"format must be 'auto' or one of {FOREIGN_FORMATS}, got format={format!r}"
        )
    if step is not None:
        step = check.integer("step", step, low=0)
    check.boolean("strict", strict)
    source = "the checkpoint"
    st_step: int | None = None
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        source = str(path)
        obj, metadata = _load_file(path)
        if metadata is not None and metadata.get("format") == WEIGHTS_FORMAT:
            st_step = int_meta(metadata, "step", path)
    elif not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
        source = f"{type(obj).__name__}.state_dict()"
        obj = obj.state_dict()
    fmt = detect_format(obj) if format == "auto" else format
    if fmt is None:
        raise EMAStateError(
            f"{source} is not a checkpoint format emakit knows: found {_describe(obj)}; "
            f"accepted formats: {', '.join(FOREIGN_FORMATS)} (pass format= to choose one)"
        )
    if ema.kind == "pytree" and fmt != "emakit":
        raise EMATypeError(
            f"an EMAPytree loads only emakit state dicts, got format={fmt!r} from {source}"
        )

    if fmt in ("emakit", "ema_pytorch"):
        _require_keys(obj, fmt, source, ("step",))
        state = dict(obj)
        if step is not None:
            state["step"] = torch.tensor(step)
        try:
            ema.load_state_dict(state, strict=strict)
        except EMAError as e:
            raise EMAStateError(f"{source} ({fmt}): {e}") from e
        return fmt

    _require_keys(obj, fmt, source, ())  # a mapping
    if ema.ema_model is None:
        ema.init_ema()
    if fmt == "timm":
        if not _is_tensor_map(obj):
            key = next((k for k in ("state_dict_ema", "model_ema") if k in obj), None)
            if key is None:
                _require_keys(obj, fmt, source, ("state_dict_ema",))
            obj, source = obj[key], f"{source}[{key!r}]"
        weights, found = obj, None
    elif fmt == "averaged_model":
        _require_keys(obj, fmt, source, ("n_averaged",))
        weights = {k: v for k, v in obj.items() if k != "n_averaged"}
        found = _as_int(obj["n_averaged"])
    elif fmt == "torch_ema":
        _require_keys(obj, fmt, source, ("shadow_params",))
        weights = _positional(ema, obj["shadow_params"], source, fmt)
        found = _as_int(obj.get("num_updates"))
    elif fmt == "diffusers":
        _require_keys(obj, fmt, source, ("shadow_params",))
        weights = _positional(ema, obj["shadow_params"], source, fmt)
        found = _as_int(obj.get("optimization_step"))
    else:  # state_dict
        weights, found = obj, st_step
    if not isinstance(weights, Mapping):
        raise EMAStateError(f"{source} ({fmt}) holds {_describe(weights)}, not a state dict")
    load_weights(
        ema,
        weights,
        step=step if step is not None else found,
        initted=True,
        strict=strict,
        source=source,
        what=f" ({fmt})",
    )
    _warn_if_warming_up(ema, source)
    return fmt


def _warn_if_warming_up(ema: EMA, source: str) -> None:
    if int(ema.step) <= int(ema.update_after_step or 0):
        warnings.warn(
            f"after loading {source}, ema.step={int(ema.step)} <= update_after_step="
            f"{ema.update_after_step}: the next update() calls copy the model over the "
            f"loaded EMA weights (warm-up); pass step= with the training step, or lower "
            f"update_after_step",
            stacklevel=3,
        )
