"""Checkpoints of other EMA libraries (and emakit's own) loaded into an emakit EMA.

* [`load_foreign_state()`][emakit.foreign.load_foreign_state] loads the state of ema-pytorch, timm, torch_ema,
  ``torch.optim.swa_utils.AveragedModel``, diffusers ``EMAModel`` and Lightning's
  ``EMAWeightAveraging`` into an emakit EMA, from the object their ``state_dict()``
  returns (a Lightning checkpoint), from a torch or safetensors file, or from the folder
  diffusers' ``EMAModel.save_pretrained`` writes.
* [`detect_format()`][emakit.foreign.detect_format] guesses which of `FOREIGN_FORMATS` a checkpoint is in.

Every failure (missing, truncated or corrupt file, unknown format, a checkpoint of another
model) raises an [`EMAError`][emakit.errors.EMAError] that names the source and what is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
from torch import Tensor, nn

from . import _validate as check
from ._files.reading import open_regular, parse_json, refusal_reason, torch_load
from ._files.safetensors_file import read_safetensors
from .checkpoint import check_ema, emakit_header, load_state, load_weights, tied_names
from .ema import EMA
from .errors import EMAStateError, EMATypeError, EMAValueError

__all__ = ["FOREIGN_FORMATS", "detect_format", "load_foreign_state"]

#: Formats `load_foreign_state()` accepts (besides ``"auto"``).
FOREIGN_FORMATS = (
    "emakit",
    "ema_pytorch",
    "timm",
    "torch_ema",
    "averaged_model",
    "diffusers",
    "lightning",
    "state_dict",
)

#: Where the formats that are not a state dict of the model keep their weights and their
#: update count: ``format -> (the key they must have, the counter's key)``. torch_ema and
#: diffusers keep a list in ``model.parameters()`` order under ``shadow_params``;
#: AveragedModel keeps ``module.*`` names beside ``n_averaged``.
_LAYOUTS = {
    "torch_ema": ("shadow_params", "num_updates"),
    "diffusers": ("shadow_params", "optimization_step"),
    "averaged_model": ("n_averaged", "n_averaged"),
}
#: The entries of a Lightning checkpoint that ``EMAWeightAveraging`` (``WeightAveraging``)
#: wrote: the average with the module's names, and ``{"n_averaged": tensor}``.
_LIGHTNING_KEYS = ("state_dict", "averaging_state")

#: What to add to a format's update count to get emakit's ``step``, which counts the
#: initializing copy as a call: torch_ema's update ``n`` (from 1) already averages with the
#: weights it was built with, which is emakit's call ``n + 1`` (the decay of
#: ``schedules.torch_ema_warmup`` then matches torch_ema's update for update).
_STEP_OFFSET = {"torch_ema": 1}
#: The entries of a timm training checkpoint that hold the EMA's state dict.
_TIMM_KEYS = ("state_dict_ema", "model_ema")
#: The formats an EMA state is told by from its own keys, wherever it sits in a checkpoint
#: (``{"model": ..., "ema": torch_ema_state}``, torchvision's ``checkpoint["model_ema"]``).
_SELF_DESCRIBING = ("emakit", "ema_pytorch", "torch_ema", "averaged_model", "diffusers")
#: Classes a training checkpoint holds as data besides tensors and plain containers: timm's
#: and torchvision's ``train.py`` save their command line, an ``argparse.Namespace`` of
#: plain values. Nothing else is accepted.
_DATA_CLASSES: tuple[type, ...] = (argparse.Namespace,)
#: Modules whose classes an Ultralytics (or YOLOv5) checkpoint pickles: the whole EMA model.
_ULTRALYTICS_GLOBAL = re.compile(r"GLOBAL (ultralytics\.[\w.]+|models\.yolo\.[\w.]+)")
#: How to turn an Ultralytics checkpoint into a state emakit reads, and load that.
_ULTRALYTICS_LOAD = "ckpt = torch.load(path, weights_only=False)  # only if you trust it"
_ULTRALYTICS_STATE = "state = {'ema': ckpt['ema'].float().state_dict(), 'updates': ckpt['updates']}"
_ULTRALYTICS_CALL = (
    "the step of Ultralytics' next update (its number updates + 1; emakit's first call "
    "copies): load_foreign_state(ema, state['ema'], step=state['updates'] + 1)"
)

#: What diffusers' ``ModelMixin.save_pretrained`` names its files (``diffusers.utils``
#: constants), most preferred first, as ``from_pretrained`` prefers them: an index of
#: shards, or a single file.
_DIFFUSERS_WEIGHTS = (
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin.index.json",
    "diffusion_pytorch_model.bin",
)


def read_training_checkpoint(
    source: str | os.PathLike[str] | IO[bytes], what: str = "checkpoint file"
) -> Any:
    """``torch.load(source, map_location="cpu", weights_only=True)`` of a file name or a
    binary file object, with an ``argparse.Namespace`` (timm's and torchvision's
    ``train.py`` save their arguments as one) accepted as data and nothing else.

    The Namespace is allowed through torch's ``safe_globals`` context for this one load
    (never ``add_safe_globals``, which is process-wide), and only where it is not allowed
    already, so a registration of the caller's is kept. torch 2.4 lacks the context: a
    Namespace is refused there.

    Raises:
        EMAFileNotFoundError: ``source`` names no file.
        EMAStateError: torch refuses or cannot read it (the message names the file, why,
            and how to load a file you trust).
    """
    import torch.serialization as serialization

    scope: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if hasattr(serialization, "safe_globals"):
        allowed = set(serialization.get_safe_globals())
        scope = serialization.safe_globals([c for c in _DATA_CLASSES if c not in allowed])
    with scope:
        if isinstance(source, (str, os.PathLike)):
            return torch_load(source, what, yours=True)
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except Exception as e:
            raise EMAStateError(
                f"the {what} given as a file object could not be read as a torch file with "
                f"weights_only=True ({refusal_reason(e)}); emakit never runs pickled code"
            ) from e


def _load_file(path: Path) -> tuple[Any, dict[str, str] | None]:
    """A checkpoint file's content and, for safetensors, its header metadata (the file's
    first bytes tell which it is); a torch file is read by `read_training_checkpoint()`,
    and an Ultralytics one, which pickles its model, is refused saying how to read it."""
    with open_regular(path, "checkpoint file") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then JSON
        return read_safetensors(path)
    try:
        return read_training_checkpoint(path), None
    except EMAStateError as e:
        found = _ULTRALYTICS_GLOBAL.search(str(e.__cause__))
        if found is None:
            raise
        raise EMAStateError(
            f"{path} is an Ultralytics (YOLO) training checkpoint: it pickles the whole EMA "
            f"model ({found.group(1)}), and emakit reads torch files with weights_only=True, "
            f"never running pickled code; if you trust the file, turn it into a state dict "
            f"yourself:\n    {_ULTRALYTICS_LOAD}\n    {_ULTRALYTICS_STATE}\nthen load it with "
            f"{_ULTRALYTICS_CALL}"
        ) from e


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return f"a mapping with keys {check.few([str(k) for k in obj], 12)}"
    if obj is None:
        return "None"
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _read_json(path: Path) -> Any:
    try:
        return parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and malformed JSON included
        raise EMAStateError(
            f"{path} is not a readable JSON file ({type(e).__name__}: {e}); the folder may "
            f"be incomplete or corrupt"
        ) from e


def _diffusers_folder(folder: Path) -> tuple[dict[str, Tensor], int]:
    """The weights (model names) and ``optimization_step`` of a folder written by
    diffusers' ``EMAModel.save_pretrained``, or an error naming the folder and what it
    holds."""
    config_path = folder / "config.json"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    found = f"found {check.few(names, 12) if names else 'nothing'}"
    expected = (
        "expected what diffusers' EMAModel.save_pretrained(path) writes: config.json with "
        "the EMA's optimization_step, and diffusion_pytorch_model.safetensors (or .bin, or "
        "shards with an .index.json)"
    )
    if not config_path.is_file():
        raise EMAStateError(
            f"{folder} is not a diffusers EMAModel folder: it has no config.json ({found}); "
            f"{expected}"
        )
    config = _read_json(config_path)
    if not isinstance(config, dict) or "optimization_step" not in config:
        keys = f"keys {sorted(config)[:12]}" if isinstance(config, dict) else _describe(config)
        raise EMAStateError(
            f"{folder} is not a diffusers EMAModel folder: its config.json has no "
            f"'optimization_step' (found {keys}), so it is a plain model folder rather than "
            f"EMAModel.save_pretrained output; to load its weights as EMA weights, pass the "
            f"weights file with format='state_dict' and step="
        )
    opt_step = config["optimization_step"]
    if isinstance(opt_step, bool) or not isinstance(opt_step, int):
        raise EMAStateError(
            f"{config_path}: optimization_step must be an int >= 0, got {opt_step!r}"
        )
    opt_step = check.stored_count(str(config_path), "optimization_step", opt_step)
    for name in _DIFFUSERS_WEIGHTS:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            return _diffusers_shards(folder, path), opt_step
        return _read_tensors(path), opt_step
    raise EMAStateError(
        f"{folder} has a diffusers EMAModel config.json but no weights file ({found}); {expected}"
    )


def _read_tensors(path: Path) -> dict[str, Tensor]:
    """The mapping of names to tensors that the file ``path`` of a diffusers folder holds
    (safetensors, or read with ``weights_only=True``)."""
    content, _ = _load_file(path)
    if not _is_tensor_map(content):
        raise EMAStateError(
            f"{path} (diffusers EMAModel folder) holds {_describe(content)}, not a mapping "
            f"of parameter names to tensors"
        )
    return dict(content)


def _diffusers_shards(folder: Path, index_path: Path) -> dict[str, Tensor]:
    """The weights of a sharded diffusers folder, each tensor read from the shard its
    index names. A shard that lacks a tensor mapped to it, or holds one the index maps
    elsewhere (a copy in a second shard included) or not at all, is refused: the folder
    mixes files of two saves, and no rule tells which copy is the right one."""
    index = _read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise EMAStateError(f"{index_path} has no 'weight_map' of tensor names to shard files")
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, set()).add(tensor)
    weights: dict[str, Tensor] = {}
    for shard, mapped in sorted(by_shard.items()):
        if Path(shard).name != shard or shard in (".", ".."):
            raise EMAStateError(
                f"{index_path} names the shard {shard!r}, which is not a file name inside {folder}"
            )
        path = folder / shard
        tensors = _read_tensors(path)
        missing = sorted(mapped - tensors.keys())
        if missing:
            raise EMAStateError(
                f"{path} has no tensor {missing[0]!r}, which {index_path.name} maps to "
                f"{shard!r} (missing: {check.few(missing, 4)}); the "
                f"folder mixes files of different saves, or a shard is damaged"
            )
        extra = sorted(tensors.keys() - mapped)
        if extra:
            where = weight_map.get(extra[0])
            says = "does not list it" if where is None else f"maps it to {where!r}"
            raise EMAStateError(
                f"{path} holds the tensor {extra[0]!r}, but {index_path.name} {says} "
                f"(not mapped to it: {check.few(extra, 4)}); the folder mixes files "
                f"of different saves"
            )
        weights.update(tensors)
    return weights


def _is_tensor_map(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items())
    )


def _layout_version(obj: Mapping[Any, Any]) -> int:
    """The root module's version in torch's state-dict metadata (``_metadata[""]``): emakit
    writes its layout version there from layout 2 on (layout 1 wrote a ``version`` key);
    other modules, ema-pytorch's EMA included, have torch's default 1. 0 when absent."""
    metadata = getattr(obj, "_metadata", None)
    root = metadata.get("") if isinstance(metadata, Mapping) else None
    version = root.get("version") if isinstance(root, Mapping) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def nested_states(
    obj: Mapping[Any, Any], accept: Callable[[Any], bool], *, depth: int = 3, path: str = ""
) -> list[tuple[str, Any]]:
    """``(key path, value)`` of each value that ``accept`` takes inside ``obj``'s mappings,
    ``depth`` levels down, in order; an accepted value is not searched further.

    Example:
        >>> nested_states({"model": {}, "train": {"ema": [1]}}, lambda v: v == [1])
        [("['train']['ema']", [1])]
    """
    found: list[tuple[str, Any]] = []
    for key, value in obj.items():
        here = f"{path}[{key!r}]"
        if accept(value):
            found.append((here, value))
        elif isinstance(value, Mapping) and depth > 1:
            found += nested_states(value, accept, depth=depth - 1, path=here)
    return found


def _state_format(obj: Any) -> str | None:
    """The `_SELF_DESCRIBING` format ``obj`` is in, told by its own keys, or None."""
    if not isinstance(obj, Mapping):
        return None
    keys = [k for k in obj if isinstance(k, str)]
    if isinstance(obj.get("shadow_params"), (list, tuple)):
        if "optimization_step" in obj:
            return "diffusers"
        if "num_updates" in obj or "collected_params" in obj:
            return "torch_ema"
        return None
    if "n_averaged" in obj and any(k.startswith("module.") for k in keys):
        return "averaged_model"
    ema_keys = any(k.startswith(("ema_model.", "ema.")) for k in keys)
    if ema_keys and ("version" in obj or _layout_version(obj) >= 2):
        return "emakit"
    if ("initted" in obj or "step" in obj) and any(k.startswith("ema_model.") for k in keys):
        return "ema_pytorch"
    return None


def detect_format(obj: Any) -> str | None:
    """Guess the format of a checkpoint object from its keys.

    Only ``obj``'s own keys are read: an EMA state nested in a training checkpoint
    (torchvision's ``checkpoint["model_ema"]``, a Lightning checkpoint's ``"ema"``) gives
    None here, and [`load_foreign_state()`][emakit.foreign.load_foreign_state] finds it.

    Args:
        obj: what a library's ``state_dict()`` returned, or what ``torch.load`` gave.

    Returns:
        The `FOREIGN_FORMATS` entry ``obj`` looks like, or None when none fits.

    Example:
        >>> detect_format({"n_averaged": torch.tensor(3), "module.weight": torch.zeros(1)})
        'averaged_model'
    """
    if not isinstance(obj, Mapping):
        return None
    if all(isinstance(obj.get(k), Mapping) for k in _LIGHTNING_KEYS):
        return "lightning"
    if any(isinstance(obj.get(k), Mapping) and _state_format(obj[k]) is None for k in _TIMM_KEYS):
        return "timm"  # torchvision's "model_ema" is an AveragedModel state: found nested
    fmt = _state_format(obj)
    if fmt is None and _is_tensor_map(obj):
        return "timm" if all(k.startswith("module.") for k in obj) else "state_dict"
    return fmt


def _require_keys(obj: Any, fmt: str, source: str, keys: tuple[str, ...]) -> None:
    if not isinstance(obj, Mapping) or any(k not in obj for k in keys):
        raise EMAStateError(
            f"format={fmt!r} needs the keys {list(keys)}, but {source} is {_describe(obj)}"
        )


def _positional(ema: EMA, shadow: Any, source: str) -> dict[str, Tensor]:
    """torch_ema/diffusers ``shadow_params`` (a list in ``model.parameters()`` order) as
    named weights. Buffers, which those libraries do not track, keep the EMA's values."""
    if not isinstance(shadow, (list, tuple)) or not all(isinstance(t, Tensor) for t in shadow):
        raise EMAStateError(f"{source}: shadow_params must be a list of tensors")
    ema_model: nn.Module = ema.ema_model  # load_foreign_state built it
    params = list(ema_model.named_parameters())
    if len(shadow) != len(params):
        raise EMAStateError(
            f"{source} holds {len(shadow)} shadow_params but the model has "
            f"{len(params)} parameters; the checkpoint must come from the same model's "
            f".parameters() (in that order, with no filtering)"
        )
    weights = dict(ema_model.state_dict())
    tied = {names[0]: names for names in tied_names(ema)}  # a parameter's first name leads
    for i, ((name, p), t) in enumerate(zip(params, shadow, strict=True)):
        if t.shape != p.shape:
            raise EMAStateError(
                f"{source}: shadow_params[{i}] has shape {tuple(t.shape)} but parameter "
                f"{i} of the model, {name!r}, has shape {tuple(p.shape)}; it was saved from "
                f"another model"
            )
        weights.update(dict.fromkeys(tied[name], t))
    return weights


def _nested_state(obj: Mapping[Any, Any], format: str, source: str) -> tuple[Any, str] | None:
    """``(the state, its source)`` of the one EMA state (of ``format``, or of any
    `_SELF_DESCRIBING` format for ``"auto"``) inside the training checkpoint ``obj``, found
    by its keys three levels down, with a warning naming where; None when there is none,
    or for a Lightning checkpoint of emakit's ``EMACallback`` (whose entry may hold only
    part of a sharded EMA: `_refuse_unknown()` says what to do)."""
    if "emakit_ema" in obj:
        return None
    found = nested_states(
        obj, lambda v: _state_format(v) is not None and format in ("auto", _state_format(v))
    )
    if not found:
        return None
    if len(found) > 1:
        raise EMAStateError(
            f"{source} holds {len(found)} EMA states, at "
            f"{', '.join(path for path, _ in found)}: pass the one to load, e.g. "
            f"checkpoint{found[0][0]}"
        )
    path, state = found[0]
    warnings.warn(
        f"load_foreign_state found the {_state_format(state)} EMA state at {path} of "
        f"{source} (by its keys) and loads it",
        UserWarning,
        stacklevel=3,
    )
    return state, f"{source}{path}"


def _refuse_unknown(obj: Any, source: str) -> NoReturn:
    """Refuse a checkpoint of no known format, saying what it holds. A Lightning checkpoint
    without an average, an Ultralytics checkpoint loaded with ``weights_only=False`` (its
    ``"ema"`` a whole model) and an Ultralytics EMA state (``{"ema": state dict, "updates":
    n}``) are named, with the calls that load what they hold."""
    entries = obj if isinstance(obj, Mapping) else {}
    if "pytorch-lightning_version" in entries:
        if "emakit_ema" in entries:
            how = (
                "it was written by emakit's EMACallback: resume with that callback, or load "
                "checkpoint['emakit_ema']['ema'] with ema.load_state_dict()"
            )
        else:
            how = (
                "its state_dict holds the training weights; to start an EMA from them, pass "
                "checkpoint['state_dict'] with step=checkpoint['global_step']"
            )
        raise EMAStateError(
            f"{source} is a Lightning checkpoint without weight averaging (no "
            f"'averaging_state' entry, as EMAWeightAveraging writes): {how}"
        )
    ema = entries.get("ema") if "updates" in entries else None
    if isinstance(ema, nn.Module):
        raise EMAStateError(
            f"{source} is an Ultralytics (YOLO) checkpoint: its 'ema' entry is a whole "
            f"{type(ema).__name__} model, not a state; turn it into one (ckpt being the "
            f"checkpoint):\n    {_ULTRALYTICS_STATE}\nthen load it with {_ULTRALYTICS_CALL}"
        )
    if _is_tensor_map(ema):
        raise EMAStateError(
            f"{source} is an Ultralytics EMA state ('ema' and 'updates'): load its 'ema' "
            f"entry with {_ULTRALYTICS_CALL}, state being this dict"
        )
    raise EMAStateError(
        f"{source} is not a checkpoint format emakit knows: found {_describe(obj)}; "
        f"accepted formats: {', '.join(FOREIGN_FORMATS)} (pass format= to choose one)"
    )


def _refuse_uncounted(ema: EMA, source: str) -> None:
    """A plain state dict carries no update count: refuse to load it into an EMA whose
    next update would copy the model over it (a fresh EMA at step 0, or in its warm-up)."""
    if int(ema.step) > int(ema.update_after_step or 0):
        return
    raise EMAStateError(
        f"{source} holds weights but no update count, and this EMA is at step "
        f"{int(ema.step)} <= update_after_step={ema.update_after_step}: its next update() "
        f"would copy the model over the loaded weights. Pass step= (the training step the "
        f"weights were saved at, e.g. step=checkpoint['global_step'] for a Lightning "
        f"checkpoint), or for a checkpoint written with Lightning's EMAWeightAveraging "
        f"pass the whole checkpoint (or its path), whose averaging_state has the count"
    )


def _warn_unaveraged_buffers(ema: EMA, source: str) -> None:
    """Say so when ``ema`` averages floating buffers, which torch_ema leaves alone."""
    prefixes = tuple(ema.ignore_startswith_names)
    skipped = ema.param_or_buffer_names_no_ema | ema.ignore_names
    names = sorted(
        n
        for n in ema.buffer_names
        if n not in skipped and not (prefixes and n.startswith(prefixes))
    )
    if names:
        warnings.warn(
            f"{source}: torch_ema averages parameters only, but this EMA also averages the "
            f"floating buffers {check.few(names, 4)} (e.g. BatchNorm statistics): they keep "
            f"their values now and are averaged from the next update on, so the EMA model's "
            f"outputs differ from torch_ema's. For torch_ema's behaviour use "
            f"emakit.compat.torch_ema.ExponentialMovingAverage, or build the EMA with "
            f"param_or_buffer_names_no_ema= those names (copied from the model at every update)",
            stacklevel=3,
        )


def _foreign_weights(ema: EMA, obj: Any, fmt: str, source: str) -> tuple[Any, int | None, str]:
    """``(weights by name, the update count found or None, the source named)`` of a foreign
    checkpoint ``obj`` of format ``fmt`` (not emakit's nor ema-pytorch's), or of the
    diffusers folder ``obj``."""
    if isinstance(obj, Path):
        weights, opt_step = _diffusers_folder(obj)
        return weights, opt_step, f"{source} (diffusers EMAModel.save_pretrained folder)"
    _require_keys(obj, fmt, source, ())  # a mapping
    if fmt == "timm" and not _is_tensor_map(obj):
        key = next((k for k in _TIMM_KEYS if k in obj), _TIMM_KEYS[0])
        _require_keys(obj, fmt, source, (key,))
        return obj[key], None, f"{source}[{key!r}] ({fmt})"
    if fmt == "lightning":
        _require_keys(obj, fmt, source, _LIGHTNING_KEYS)
        source = f"{source}['state_dict'] (Lightning weight averaging)"
        averaging = obj["averaging_state"]
        if not isinstance(averaging, Mapping):
            raise EMAStateError(f"{source}: averaging_state is {_describe(averaging)}")
        count = averaging.get("n_averaged")
        found = None if count is None else check.stored_count(source, "n_averaged", count)
        return obj["state_dict"], found, source
    if fmt not in _LAYOUTS:  # a state dict of the model (timm's module.* included)
        return obj, None, f"{source} ({fmt})"
    key, counter = _LAYOUTS[fmt]
    _require_keys(obj, fmt, source, (key,))
    source = f"{source} ({fmt})"
    found = None if obj.get(counter) is None else check.stored_count(source, counter, obj[counter])
    if found is not None:
        found += _STEP_OFFSET.get(fmt, 0)
    if key == "shadow_params":
        return _positional(ema, obj[key], source), found, source
    return {k: v for k, v in obj.items() if k != key}, found, source


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
    ``"emakit"``              [`emakit.EMA.state_dict()`][emakit.EMA.state_dict] (its layout version in torch's
                              state-dict metadata, or a ``version`` key in layout 1; a
                              rebuilt dict loses the metadata and reads as
                              ``"ema_pytorch"``, which loads the same way)
    ``"ema_pytorch"``         ``ema_pytorch.EMA.state_dict()`` 0.8.3, with or without
                              ``online_model.*`` (those keys are ignored)
    ``"timm"``                a timm training checkpoint (``state_dict_ema``/``model_ema``
                              entry) or ``ModelEmaV2``/``V3.state_dict()`` (``module.*``)
    ``"torch_ema"``           ``torch_ema.ExponentialMovingAverage.state_dict()``
    ``"averaged_model"``      ``torch.optim.swa_utils.AveragedModel.state_dict()``
                              (``module.*`` and ``n_averaged``)
    ``"diffusers"``           ``diffusers.training_utils.EMAModel.state_dict()``, or the
                              folder its ``save_pretrained(path)`` writes
    ``"lightning"``           a Lightning checkpoint written with ``EMAWeightAveraging``
                              (or ``WeightAveraging``): the average in ``state_dict``,
                              the update count in ``averaging_state``
    ``"state_dict"``          a plain ``state_dict()`` of the model (e.g. exported weights)
    ========================  ==============================================================

    A training checkpoint that holds one EMA state told by its keys (emakit, ema-pytorch,
    torch_ema, ``AveragedModel``, diffusers) under an entry of its own, up to three levels
    down, is read as that state, with a warning naming the entry: torchvision's reference
    ``checkpoint.pth`` (``checkpoint["model_ema"]``, an ``AveragedModel`` state with its
    ``n_averaged``), a Lightning checkpoint with a torch_ema state under ``"ema"`` (as
    sgmse's ``on_save_checkpoint`` stores it), ``{"model": ..., "ema": ema.state_dict()}``.
    With ``format=`` one of those formats, only a state of that format is looked for.
    Several such states are an error naming each entry: pass the one to load. A Lightning
    checkpoint of emakit's ``EMACallback`` is not searched (its entry may hold only part of
    a sharded EMA): resume with the callback.

    Torch files are read with ``weights_only=True``; an ``argparse.Namespace`` (the ``args``
    that timm's and torchvision's ``train.py`` save) is accepted as data, for that one load,
    and no other class. An Ultralytics (YOLO) ``last.pt``/``best.pt`` pickles its whole EMA
    model: it is refused, and the message gives the lines that turn it into a state dict
    (``{"ema": ckpt["ema"].float().state_dict(), "updates": ckpt["updates"]}``) and the
    call that loads it, ``load_foreign_state(ema, state["ema"], step=state["updates"] + 1)``.

    Tensors are paired by name, strictly; DDP (``module.``) and ``torch.compile``
    (``_orig_mod.``) prefixes are stripped. torch_ema and diffusers store a list in
    ``model.parameters()`` order: it is paired by position with the EMA model's
    parameters, and a count or shape mismatch is an error; buffers, which they do not
    track, keep the EMA's current values. Values are copied into the existing shadow, so
    its dtype is kept.

    A folder is read as what diffusers' ``EMAModel.save_pretrained(path)`` writes: a
    ``config.json`` holding the EMA's settings (``optimization_step``, ``decay``, ...) and
    the EMA weights saved as the model's ``save_pretrained`` saves them
    (``diffusion_pytorch_model.safetensors``, or ``.bin`` read with ``weights_only=True``,
    possibly in shards listed by an ``.index.json``). Those are paired by name, and the
    model's buffers take the folder's values (the freshly built model's: ``EMAModel``
    averages parameters only).

    The EMA's ``step`` becomes the source's update count where it has one (ema-pytorch
    ``step``, torch_ema ``num_updates + 1``, diffusers ``optimization_step``,
    ``AveragedModel`` and Lightning ``n_averaged``: the updates the average has had; with
    Lightning's ``update_every_n_steps=k``, pass ``step=checkpoint["global_step"]`` to an EMA
    that counts training steps); timm and plain state dicts have none, so the EMA
    keeps its step unless ``step=`` is given (timm's ``train.py`` passes its
    ``num_updates`` as the step: give the same number). The EMA counts as initialized
    afterwards. torch_ema's update ``n`` already averages with the weights it was built
    with, which is emakit's call ``n + 1`` (its first call copies): with the ``+ 1``, an
    ``EMA(schedule=schedules.torch_ema_warmup(d), update_after_step=0, update_every=1)``
    continues with torch_ema's decays, update for update. torch_ema averages parameters
    only: when the EMA also averages floating buffers (BatchNorm statistics), a warning
    says so (`emakit.compat.torch_ema.ExponentialMovingAverage` keeps torch_ema's
    behaviour).
    A warning is given when the resulting step is still inside the warm-up
    (``step <= update_after_step``), where the next ``update()`` would copy the model over
    the loaded weights; a plain state dict (``format="state_dict"``, e.g. a Lightning
    checkpoint's ``checkpoint["state_dict"]``) that would land there without ``step=`` is
    refused instead.

    Args:
        ema: the [`EMA`][emakit.EMA] to load into (an [`EMAPytree`][emakit.EMAPytree] accepts
            only the ``"emakit"`` format).
        obj: the checkpoint: a mapping (what the library's ``state_dict()`` returns, or
            what ``torch.load`` gave), an object with a ``state_dict()`` method, the
            path of a torch or safetensors file (read with ``weights_only=True``), or the
            path of a diffusers ``EMAModel.save_pretrained`` folder; a training checkpoint
            holding one of these states under an entry of its own (see above).
        format: one of `FOREIGN_FORMATS`, or ``"auto"`` (default) to detect it.
        step: the training step to set (overrides the checkpoint's count). Default None.
        strict: pair names strictly (default True); with False, tensors absent from the
            checkpoint keep their values and extra ones are ignored.

    Returns:
        The format that was loaded.

    Raises:
        EMAStateError: the format is unknown or does not fit, the checkpoint belongs to
            another model, or the file is unreadable (the message names the source, what
            was found and the accepted formats).
        EMAFileNotFoundError: ``obj`` is a path that does not exist (or a shard a
            diffusers index lists is missing).

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
    if not isinstance(format, str) or format not in ("auto", *FOREIGN_FORMATS):
        error = EMAValueError if isinstance(format, str) else EMATypeError
        raise error(f"format must be 'auto' or one of {FOREIGN_FORMATS}, got format={format!r}")
    step = check.optional_integer("step", step, low=0)
    check.boolean("strict", strict)
    source, found = "the checkpoint", None
    folder = Path(obj) if isinstance(obj, (str, os.PathLike)) and Path(obj).is_dir() else None
    fmt: str | None = "diffusers"
    if folder is not None:
        if format not in ("auto", "diffusers"):
            raise EMAValueError(
                f"{folder} is a folder, which load_foreign_state reads only as a diffusers "
                f"EMAModel.save_pretrained folder, got format={format!r}; pass format='auto' "
                f"or 'diffusers', or the path of the checkpoint file inside it"
            )
        source, obj = str(folder), folder
    else:
        if isinstance(obj, (str, os.PathLike)):
            source = str(obj)
            obj, metadata = _load_file(Path(obj))
            header = None if metadata is None else emakit_header(metadata, source)
            found = None if header is None else header[0]  # the step save_ema_weights kept
        elif not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
            source = f"{type(obj).__name__}.state_dict()"
            obj = obj.state_dict()
        fmt = detect_format(obj) if format == "auto" else format
        missing = fmt is None or (fmt in _SELF_DESCRIBING and _state_format(obj) != fmt)
        if missing and isinstance(obj, Mapping):  # a training checkpoint: look inside
            nested = _nested_state(obj, format, source)
            if nested is not None:
                obj, source = nested
                fmt = _state_format(obj)
    if fmt is None:
        _refuse_unknown(obj, source)
    if ema.kind == "pytree" and fmt != "emakit":
        raise EMATypeError(
            f"an EMAPytree loads only emakit state dicts, got format={fmt!r} from {source}"
        )

    if fmt in ("emakit", "ema_pytorch"):
        _require_keys(obj, fmt, source, ("step",))
        state = dict(obj)
        if step is not None:
            state["step"] = torch.tensor(step)
        load_state(ema, state, strict=strict, source=f"{source} ({fmt})")
        return fmt

    if ema.ema_model is None:
        ema.init_ema()
    weights, counted, source = _foreign_weights(ema, obj, fmt, source)
    found = found if counted is None else counted
    if not isinstance(weights, Mapping):
        raise EMAStateError(f"{source} holds {_describe(weights)}, not a state dict")
    if fmt == "state_dict" and step is None and found is None:
        _refuse_uncounted(ema, source)
    found = step if step is not None else found
    load_weights(ema, weights, step=found, initted=True, strict=strict, source=source)
    if fmt == "torch_ema":
        _warn_unaveraged_buffers(ema, source)
    if int(ema.step) <= int(ema.update_after_step or 0):
        warnings.warn(
            f"after loading {source}, ema.step={int(ema.step)} <= update_after_step="
            f"{ema.update_after_step}: the next update() calls copy the model over the "
            f"loaded EMA weights (warm-up); pass step= with the training step, or lower "
            f"update_after_step",
            stacklevel=2,
        )
    return fmt
