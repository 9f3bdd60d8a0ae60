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

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import _validate as check
from ._files.reading import open_regular, parse_json, torch_load
from ._files.safetensors_file import read_safetensors
from .checkpoint import check_ema, emakit_header, load_weights, tied_names
from .ema import EMA
from .errors import EMAError, EMAStateError, EMATypeError, EMAValueError

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

#: What diffusers' ``ModelMixin.save_pretrained`` names its files (``diffusers.utils``
#: constants), most preferred first, as ``from_pretrained`` prefers them: an index of
#: shards, or a single file.
_DIFFUSERS_WEIGHTS = (
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin.index.json",
    "diffusion_pytorch_model.bin",
)


def _load_file(path: Path) -> tuple[Any, dict[str, str] | None]:
    """A checkpoint file's content and, for safetensors, its header metadata (the file's
    first bytes tell which it is); a torch file is read with ``weights_only=True``."""
    with open_regular(path, "checkpoint file") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then JSON
        return read_safetensors(path)
    return torch_load(path, "checkpoint file", yours=True), None


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return f"a mapping with keys {check.few([str(k) for k in obj], 12)}"
    return f"a {type(obj).__name__}"


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
        content, _ = _load_file(path)  # safetensors, or weights_only=True
        return _tensor_map(content, path), opt_step
    raise EMAStateError(
        f"{folder} has a diffusers EMAModel config.json but no weights file ({found}); {expected}"
    )


def _tensor_map(content: Any, path: Path) -> dict[str, Tensor]:
    """``content``, read from ``path``, if it is a mapping of names to tensors."""
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
        content, _ = _load_file(path)  # safetensors, or weights_only=True
        tensors = _tensor_map(content, path)
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


def detect_format(obj: Any) -> str | None:
    """Guess the format of a checkpoint object from its keys.

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
    keys = [k for k in obj if isinstance(k, str)]
    if all(isinstance(obj.get(k), Mapping) for k in _LIGHTNING_KEYS):
        return "lightning"
    if any(isinstance(obj.get(k), Mapping) for k in _TIMM_KEYS):
        return "timm"
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
    if _is_tensor_map(obj):
        return "timm" if all(k.startswith("module.") for k in keys) else "state_dict"
    return None


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


def _refuse_lightning_without_average(obj: Any, source: str) -> None:
    """A Lightning checkpoint with no average in it: say what it holds and the calls."""
    if not isinstance(obj, Mapping) or "pytorch-lightning_version" not in obj:
        return
    if "emakit_ema" in obj:
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
            path of a diffusers ``EMAModel.save_pretrained`` folder.
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
    if fmt is None:
        _refuse_lightning_without_average(obj, source)
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
