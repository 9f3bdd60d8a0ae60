"""EMA weights on disk: safetensors export/import and checkpoints of other EMA libraries.

* :func:`save_ema_weights` writes the EMA model's weights as a safetensors file that loads
  straight into the model class (``model.load_state_dict(load_file(path))``), with the EMA
  settings in the header. The file is streamed tensor by tensor (no second copy of the
  model in memory) and written atomically.
* :func:`load_ema_weights` reads such a file back into an EMA, keeping the shadow dtype.
* :func:`load_foreign_state` loads the state of ema-pytorch, timm, torch_ema,
  ``torch.optim.swa_utils.AveragedModel`` and diffusers ``EMAModel`` into an emakit EMA.

Every failure (missing, truncated or corrupt file, unknown format, a checkpoint of another
model) raises an :class:`~emakit.EMAError` that names the file and what is wrong.
safetensors carries no checksum: truncation and damage to the header are caught, a flipped
bit inside tensor data is not.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from . import _validate as check
from ._io import atomic_path, atomic_write
from ._validate import not_newer
from .ema import EMA, STATE_VERSION, _EMABase
from .errors import (
    EMAError,
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)
from .pytree import EMAPytree, _leaves

__all__ = [
    "FOREIGN_FORMATS",
    "WEIGHTS_FORMAT",
    "WEIGHTS_FORMAT_VERSION",
    "EMAFileNotFoundError",
    "atomic_path",
    "atomic_write",
    "detect_format",
    "load_ema_weights",
    "load_foreign_state",
    "save_ema_weights",
]

#: ``format`` entry in the header of files written by :func:`save_ema_weights`.
WEIGHTS_FORMAT = "emakit.ema_weights"
#: Version of that header layout.
WEIGHTS_FORMAT_VERSION = 1

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

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


# -- safetensors, streamed ------------------------------------------------------------------

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def _write_safetensors(
    f: IO[bytes],
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``tensors`` in the safetensors layout, one tensor in host memory at a time.

    Layout: 8-byte little-endian header length, a JSON header (padded with spaces to a
    multiple of 8) mapping each name to ``dtype``/``shape``/``data_offsets``, then the raw
    little-endian bytes. Tensors are written widest element first, so each starts aligned
    to its element size. Tensors sharing storage (tied weights, views into one flat
    buffer) are each written in full, which ``safetensors.torch.save_file`` refuses to do.
    Floating tensors are cast to ``dtype`` (when given) one at a time, on the way out.
    """

    def out_dtype(t: Tensor) -> torch.dtype:
        return dtype if (dtype is not None and t.is_floating_point()) else t.dtype

    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in use
        raise EMARuntimeError("save_ema_weights needs a little-endian host")
    sizes = {n: torch.empty(0, dtype=out_dtype(t)).element_size() for n, t in tensors.items()}
    order = sorted(tensors, key=lambda n: -sizes[n])
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t, dt = tensors[name], out_dtype(tensors[name])
        if dt not in _ST_DTYPES:
            raise EMATypeError(f"tensor {name!r} has dtype {dt}, which safetensors cannot store")
        nbytes = t.numel() * sizes[name]
        header[name] = {
            "dtype": _ST_DTYPES[dt],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in order:
        t = tensors[name].detach()
        t = t.to("cpu", out_dtype(t)).contiguous().reshape(-1)
        if t.numel():
            f.write(t.view(torch.uint8).numpy().data)


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file, or an error naming ``path``."""
    from safetensors import safe_open

    _require_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:
        raise EMAStateError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
            f"truncated, corrupt or of another format"
        ) from e
    return tensors, metadata


def _require_file(path: Path) -> None:
    if not path.exists():
        raise EMAFileNotFoundError(f"checkpoint file {path} does not exist")
    if not path.is_file():
        raise EMAValueError(f"path must be a file, got path={str(path)!r}, which is a folder")


def _as_path(name: str, value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise EMATypeError(
            f"{name} must be a str or os.PathLike file name, got {name}={value!r} "
            f"({type(value).__name__})"
        )
    return Path(value)


def _check_ema(ema: object) -> _EMABase:
    if not isinstance(ema, _EMABase):
        raise EMATypeError(
            f"ema must be an emakit EMA or EMAPytree, got ema={type(ema).__name__}; "
            f"wrap the model first: ema = emakit.EMA(model)"
        )
    return ema


def _shadow_tensors(ema: _EMABase) -> dict[str, Tensor]:
    """The EMA weights by the names the model class uses."""
    if isinstance(ema, EMAPytree):
        return _leaves(ema.ema_pytree)
    assert isinstance(ema, EMA)
    if ema.ema_model is None:
        raise EMARuntimeError(
            "the EMA model does not exist yet (lazy_init_ema=True): call update() first"
        )
    return ema.ema_model.state_dict()


def _schedule_name(schedule: Any) -> str:
    if schedule is None:
        return "inverse_gamma"
    doc = (getattr(schedule, "__doc__", None) or "").strip()
    if doc and "\n" not in doc and len(doc) <= 200:
        return doc  # emakit's schedule factories set a one-line repr-like docstring
    return str(getattr(schedule, "__qualname__", None) or type(schedule).__name__)


def _header(
    ema: _EMABase, tensors: Mapping[str, Tensor], dtype: torch.dtype | None
) -> dict[str, str]:
    from ._version import __version__

    schedule = getattr(ema, "schedule", None)
    inner = ema.ema_pytree if isinstance(ema, EMAPytree) else ema.ema_model
    return {
        "format": WEIGHTS_FORMAT,
        "format_version": str(WEIGHTS_FORMAT_VERSION),
        "emakit_version": __version__,
        "kind": "pytree" if isinstance(ema, EMAPytree) else "module",
        "model_class": type(inner).__name__,
        "step": str(int(ema.step)),
        "initted": "true" if bool(ema.initted) else "false",
        "decay": repr(float(ema.get_current_decay())),
        "beta": repr(ema.beta),
        "update_after_step": str(ema.update_after_step),
        "update_every": str(ema.update_every),
        "inv_gamma": repr(ema.inv_gamma),
        "power": repr(ema.power),
        "min_value": repr(ema.min_value),
        "schedule": _schedule_name(schedule),
        "dtypes": ",".join(
            sorted(
                {
                    str(dtype if dtype is not None and t.is_floating_point() else t.dtype)
                    for t in tensors.values()
                }
            )
        ).replace("torch.", ""),
    }


def save_ema_weights(
    ema: _EMABase,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write the EMA weights to ``path`` as safetensors, atomically.

    The file holds the EMA model's ``state_dict()`` under the model's own names (integer
    buffers included; tied weights stored under each of their names), so it loads straight
    into the model class::

        model.load_state_dict(safetensors.torch.load_file(path))

    The header metadata records ``format`` (``"emakit.ema_weights"``), ``format_version``,
    ``emakit_version``, ``step``, ``initted``, the current ``decay`` and the decay settings
    (``beta``, ``update_after_step``, ``update_every``, ``inv_gamma``, ``power``,
    ``min_value``, ``schedule``). A crash during the save leaves any previous file whole.

    Args:
        ema: the :class:`~emakit.EMA` (or :class:`~emakit.EMAPytree`, saved under its leaf
            paths) to export.
        path: the destination file; its folder is created if missing.
        dtype: cast floating tensors to this dtype on the way out (e.g. ``torch.bfloat16``
            for deployment). Default None keeps the shadow dtype.
        metadata: extra ``str -> str`` header entries; they may not reuse emakit's keys.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import tempfile, safetensors.torch
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = EMA(net)
        >>> path = save_ema_weights(ema, tempfile.mkdtemp() + "/ema.safetensors")
        >>> _ = net.load_state_dict(safetensors.torch.load_file(path))
    """
    ema = _check_ema(ema)
    dest = _as_path("path", path)
    dtype = check.floating_dtype("dtype", dtype)
    tensors = _shadow_tensors(ema)
    header = _header(ema, tensors, dtype)
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise EMATypeError(f"metadata must be a mapping of str to str, got {metadata=!r}")
        clash = sorted(set(metadata) & set(header))
        if clash:
            raise EMAValueError(f"metadata may not override emakit's header keys, got {clash}")
        header.update(metadata)
    atomic_write(dest, lambda f: _write_safetensors(f, tensors, header, dtype))
    return dest


def _int_meta(metadata: Mapping[str, str], key: str, path: Path) -> int | None:
    if key not in metadata:
        return None
    try:
        return int(metadata[key])
    except ValueError:
        raise EMAStateError(
            f"{path}: header entry {key}={metadata[key]!r} is not an integer; the file is corrupt"
        ) from None


def load_ema_weights(
    ema: _EMABase,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    restore_step: bool = True,
) -> dict[str, str]:
    """Load EMA weights written by :func:`save_ema_weights` (or any safetensors file of the
    model's ``state_dict``) into ``ema``.

    Values are copied into the existing shadow tensors, so the shadow keeps its dtype (an
    fp32 shadow stays fp32 when the file holds bf16). Names are paired strictly.

    Args:
        ema: the :class:`~emakit.EMA` or :class:`~emakit.EMAPytree` to load into.
        path: the safetensors file.
        strict: with True (default) a missing or extra tensor name is an error listing
            them; with False, tensors absent from the file keep their values.
        restore_step: take ``step`` and ``initted`` from the header when the file was
            written by emakit (default True). Otherwise, and for files without them, the
            EMA keeps its step and counts as initialized, so the next ``update()`` does not
            re-initialize it from the model (a step still inside the warm-up,
            ``step <= update_after_step``, copies the model as usual).

    Returns:
        The header metadata (``{}`` for a file without any).

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAStateError: the file is truncated, corrupt, newer than this emakit, or holds
            another model's weights (the message names the file and the mismatch).
    """
    ema = _check_ema(ema)
    src = _as_path("path", path)
    check.boolean("strict", strict)
    check.boolean("restore_step", restore_step)
    tensors, metadata = _read_safetensors(src)
    step: int | None = None
    initted = True
    if metadata.get("format") == WEIGHTS_FORMAT:
        version = _int_meta(metadata, "format_version", src)
        not_newer(str(src), "format_version", version, WEIGHTS_FORMAT_VERSION)
        kind = "pytree" if isinstance(ema, EMAPytree) else "module"
        if metadata.get("kind", kind) != kind:
            raise EMAStateError(
                f"{src} holds the weights of an EMA of a {metadata['kind']}, but ema is an "
                f"EMA of a {kind}"
            )
        if restore_step:
            step = _int_meta(metadata, "step", src)
            initted = metadata.get("initted", "true") == "true"
    _load_weights(ema, tensors, step=step, initted=initted, strict=strict, source=str(src))
    return metadata


def _load_weights(
    ema: _EMABase,
    weights: Mapping[str, Tensor],
    *,
    step: int | None,
    initted: bool,
    strict: bool,
    source: str,
    what: str = "",
) -> None:
    """Copy ``weights`` (model names) into the shadow, set step/initted, pairing strictly."""
    if isinstance(ema, EMAPytree):
        expected = set(_leaves(ema.ema_pytree))
        prefix = "ema."
    else:
        assert isinstance(ema, EMA)
        if ema.ema_model is None:
            ema.init_ema()
        assert ema.ema_model is not None
        expected = set(ema.ema_model.state_dict())
        prefix = "ema_model."
    weights = _align_keys(weights, expected)
    if isinstance(ema, EMA):
        weights = _fill_tied(ema, weights)
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if strict and (missing or extra):
        raise EMAStateError(
            f"{source}{what} does not match the EMA model by name: missing {_few(missing)}, "
            f"unexpected {_few(extra)}; it was saved from another model (or pass strict=False)"
        )
    bad = [
        f"{k}: {tuple(v.shape)} in the checkpoint vs {tuple(cur.shape)} in the model"
        for k, v, cur in _shapes(ema, weights, expected, f"{source}{what}")
    ]
    if bad:
        raise EMAStateError(
            f"{source}{what} has tensors of other shapes than the model: {_few(bad)}"
        )
    state: dict[str, Any] = {
        "version": torch.tensor(STATE_VERSION),
        "step": torch.tensor(int(ema.step) if step is None else step),
        "initted": torch.tensor(initted),
    }
    state.update({prefix + k: v for k, v in weights.items() if k in expected})
    try:
        ema.load_state_dict(state, strict=False)
    except EMAError as e:
        raise EMAStateError(f"{source}{what}: {e}") from e


def _fill_tied(ema: EMA, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Give names missing from ``weights`` the value of a tied name that is present.

    ``safetensors.torch.save_model`` and other exporters store a tied tensor once; the
    model still has it under each name.
    """
    assert ema.ema_model is not None
    out = dict(weights)
    groups: dict[int, list[str]] = {}
    model = ema.ema_model
    named = (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    )
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    for names in groups.values():
        present = [n for n in names if n in out]
        if present:
            for n in names:
                out.setdefault(n, out[present[0]])
    return out


def _shapes(
    ema: _EMABase, weights: Mapping[str, Tensor], expected: set[str], source: str
) -> list[tuple[str, Tensor, Tensor]]:
    current = _shadow_tensors(ema)
    out = []
    for k in sorted(expected & set(weights)):
        v = weights[k]
        if not isinstance(v, Tensor):
            raise EMAStateError(f"{source}: entry {k!r} is a {type(v).__name__}, not a tensor")
        if v.shape != current[k].shape:
            out.append((k, v, current[k]))
    return out


def _few(items: list[str], n: int = 10) -> str:
    return f"{items[:n]}{' ...' if len(items) > n else ''} ({len(items)})" if items else "none"


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p) :], True
    return key


def _align_keys(weights: Mapping[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """``weights`` as is, or with DDP/compile/AveragedModel prefixes stripped when that
    matches the model's names better (a model may own a submodule called ``module``)."""
    raw = dict(weights)
    if set(raw) == expected:
        return raw
    stripped = {_strip(k): v for k, v in raw.items()}
    if len(stripped) == len(raw) and len(set(stripped) & expected) > len(set(raw) & expected):
        return stripped
    return raw


# -- foreign checkpoints --------------------------------------------------------------------


def _load_file(path: Path) -> tuple[Any, dict[str, str] | None]:
    """A checkpoint file's content and, for safetensors, its header metadata."""
    _require_file(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":  # u64 header length, then the JSON header
        return _read_safetensors(path)
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
    assert ema.ema_model is not None
    params = list(ema.ema_model.named_parameters())
    if len(shadow) != len(params):
        raise EMAStateError(
            f"{source} ({fmt}) holds {len(shadow)} shadow_params but the model has "
            f"{len(params)} parameters; the checkpoint must come from the same model's "
            f".parameters() (in that order, with no filtering)"
        )
    weights = dict(ema.ema_model.state_dict())
    aliases: dict[int, list[str]] = {}
    for name, p in ema.ema_model.named_parameters(remove_duplicate=False):
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
    ema: _EMABase,
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
    ema = _check_ema(ema)
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
            st_step = _int_meta(metadata, "step", path)
    elif not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
        source = f"{type(obj).__name__}.state_dict()"
        obj = obj.state_dict()
    fmt = detect_format(obj) if format == "auto" else format
    if fmt is None:
        raise EMAStateError(
            f"{source} is not a checkpoint format emakit knows: found {_describe(obj)}; "
            f"accepted formats: {', '.join(FOREIGN_FORMATS)} (pass format= to choose one)"
        )
    if isinstance(ema, EMAPytree) and fmt != "emakit":
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

    assert isinstance(ema, EMA)
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
    _load_weights(
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


def _warn_if_warming_up(ema: _EMABase, source: str) -> None:
    if int(ema.step) <= int(ema.update_after_step or 0):
        warnings.warn(
            f"after loading {source}, ema.step={int(ema.step)} <= update_after_step="
            f"{ema.update_after_step}: the next update() calls copy the model over the "
            f"loaded EMA weights (warm-up); pass step= with the training step, or lower "
            f"update_after_step",
            stacklevel=3,
        )
