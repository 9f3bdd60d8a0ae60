"""EMA files: the weights file of any EMA, and crash-safe training checkpoints.

One verb family (the sharded DCP checkpoint pair is in [`emakit.distributed`][emakit.distributed]):

* [`save_ema_weights()`][emakit.checkpoint.save_ema_weights] writes the EMA model's weights
  as one safetensors file that loads straight into the model class
  (``model.load_state_dict(load_file(path))``), with the EMA settings in the header,
  streamed tensor by tensor (no second copy of the model in memory) and atomically. For
  a sharded EMA (FSDP2, DeepSpeed ZeRO-3, ``partition=True``) it is a collective: rank 0
  writes the whole model, gathered one tensor at a time (`emakit._files.export`).
* [`load_ema_weights()`][emakit.checkpoint.load_ema_weights] reads such a file back into
  any EMA, keeping the shadow dtype (a partitioned EMA: a collective, each rank keeping
  its own partition, on any number of ranks).
* [`save_checkpoint()`][emakit.checkpoint.save_checkpoint] is ``torch.save`` made
  crash-safe, for the training checkpoint that holds ``ema.state_dict()``.

Checkpoints of other EMA libraries load with [`emakit.foreign.load_foreign_state()`][emakit.foreign.load_foreign_state].

Every failure (missing, truncated or corrupt file, a checkpoint of another model) raises an
[`EMAError`][emakit.errors.EMAError] that names the file and what is wrong.
safetensors carries no checksum: truncation and damage to the header are caught (the header
is validated in full, and a header that has emakit's entries but a damaged ``format`` is
refused rather than read as a plain state dict without its step), a flipped bit inside
tensor data is not. A file is read from the one file emakit opened
(`emakit._files.safetensors_file`), so a load that races a save sees exactly one of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import _validate as check
from ._core.tree import leaves
from ._dist.collectives import AGREE_TIMEOUT_S, agree_on, dist_ready
from ._dist.deepspeed import WORLD_KEY, ZeroPartitions
from ._dist.dtensor import fsdp_module_type, is_dtensor
from ._files import export
from ._files.atomic import atomic_path, atomic_write
from ._files.reading import as_path, writable_path, write_errors
from ._files.safetensors_file import near_format, out_dtype, read_safetensors
from ._validate import few
from .ema import EMA
from .errors import (
    EMAError,
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)
from .posthoc.snapshots.frozen import frozen_tensors

__all__ = [
    "WEIGHTS_FORMAT",
    "WEIGHTS_FORMAT_VERSION",
    "EMAFileNotFoundError",
    "atomic_path",
    "atomic_write",
    "load_ema_weights",
    "save_checkpoint",
    "save_ema_weights",
]

#: ``format`` entry in the header of files written by `save_ema_weights()`.
WEIGHTS_FORMAT = "emakit.ema_weights"
#: Version of that header layout.
WEIGHTS_FORMAT_VERSION = 1
#: ``format`` of the other safetensors files emakit writes (post-hoc snapshots, synthesized
#: weights): they hold a model state dict and load as plain weights.
OTHER_EMAKIT_FORMATS = (
    "emakit.posthoc.snapshot",
    "emakit.posthoc.snapshot-shard",
    "emakit.posthoc.synthesized",
    "emakit.posthoc.frozen",  # a snapshot folder's side file of frozen weights
)
#: Header entries only emakit's files have.
_EMAKIT_ENTRIES = ("format_version", "emakit_version")

#: DDP's, torch.compile's and AveragedModel's prefixes, however nested.
_WRAPPER_PREFIXES = re.compile(r"^(?:module\.|_orig_mod\.)+")

#: ``(name, dtype) -> the tensor whole on rank 0`` (None elsewhere): a collective.
Gather = Callable[[str, torch.dtype | None], Tensor | None]


def check_ema(ema: object) -> EMA:
    """``ema`` if it is an emakit EMA or EMAPytree, or an error saying how to wrap a model."""
    if not isinstance(ema, EMA):
        raise EMATypeError(
            f"ema must be an emakit EMA or EMAPytree, got ema={type(ema).__name__}; "
            f"wrap the model first: ema = emakit.EMA(model)"
        )
    return ema


def _full_tensors(ema: EMA) -> tuple[dict[str, Tensor], Gather | None]:
    """The EMA weights by the names the model class uses and, for a sharded EMA, the
    collective that brings each one whole to rank 0 (None: they are whole here).

    A DTensor is described by its global shape; a partitioned EMA (DeepSpeed ZeRO-3,
    ``partition=True``) by meta tensors of the full shapes
    ([`ZeroPartitions.layout()`][emakit._dist.deepspeed.ZeroPartitions.layout]).
    """
    if ema.kind == "pytree":
        return leaves(ema.ema_pytree), None
    model = ema.ema_model
    if model is None:
        raise EMARuntimeError(
            "the EMA model does not exist yet (lazy_init_ema=True): call update() first"
        )
    if isinstance(model, ZeroPartitions):
        return model.layout(), lambda name, dtype: model.gathered(name, dtype, to_writer=True)
    tensors = model.state_dict()
    if not any(is_dtensor(t) for t in tensors.values()):
        return tensors, None
    return tensors, lambda name, dtype: export.tensor_for_writer(tensors[name], dtype)


def weights_header(
    ema: EMA, tensors: Mapping[str, Tensor], dtype: torch.dtype | None
) -> dict[str, str]:
    """The header metadata [`save_ema_weights()`][emakit.checkpoint.save_ema_weights] writes for ``ema`` and ``tensors``."""
    from ._version import __version__

    inner = ema.ema_model  # the EMA pytree, for an EMA of a pytree
    if isinstance(inner, ZeroPartitions):
        model_class = inner.model_class
    else:  # the model's own class, not FSDP2's generated FSDP<Name> subclass
        fsdp = fsdp_module_type() or ()
        model_class = next(c for c in type(inner).__mro__ if not issubclass(c, fsdp)).__name__
    header = {
        "format": WEIGHTS_FORMAT,
        "format_version": str(WEIGHTS_FORMAT_VERSION),
        "emakit_version": __version__,
        "kind": ema.kind,
        "model_class": model_class,
        "step": str(int(ema.step)),
        "initted": "true" if bool(ema.initted) else "false",
        "decay": repr(float(ema.get_current_decay())),
    }
    for key in ("beta", "update_after_step", "update_every", "inv_gamma", "power", "min_value"):
        header[key] = repr(getattr(ema, key))
    header["schedule"] = repr(ema.tracker.rule.decays[0])
    dtypes = {str(out_dtype(t, dtype)).replace("torch.", "") for t in tensors.values()}
    header["dtypes"] = ",".join(sorted(dtypes))
    return header


def save_ema_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
    tied_once: bool = False,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> Path:
    """Write the EMA weights to ``path`` as safetensors, atomically: one file of the whole
    model, for every EMA.

    The file holds the EMA model's ``state_dict()`` under the model's own names and full
    shapes (integer buffers included; tied weights stored under each of their names), so
    it loads straight into the model class::

        model.load_state_dict(safetensors.torch.load_file(path))

    The file is streamed, one tensor in host memory at a time (no second copy of the
    model). **A sharded EMA** (FSDP2/DTensor, DeepSpeed ZeRO-3, ``partition=True``) is
    written by a collective: call it on every rank, not inside ``if is_rank_zero():``.
    The ranks first check that they agree (every rank in this call, every EMA at the same
    ``step`` and skip count: one small all-gather bounded by ``timeout_s``), then each
    tensor in turn is cast to ``dtype`` on every rank, gathered to rank 0, written by rank
    0 and dropped (`emakit._files.export`): rank 0's extra memory is about twice the
    largest tensor, whatever the model's size. Every rank returns once the file is
    complete, or raises rank 0's error. Any other EMA is written by the process that
    calls it (guard it with [`is_rank_zero()`][emakit.distributed.is_rank_zero] under
    DDP, or call [`save_full_ema_weights()`][emakit.distributed.save_full_ema_weights] on
    every rank).

    With ``tied_once=True`` a tied tensor (input and output embeddings) is stored once, under
    its first name, as ``save_pretrained`` and ``safetensors.torch.save_model`` store it:
    the file then has the keys of the model's own ``model.safetensors``. It loads with
    [`load_ema_weights()`][emakit.checkpoint.load_ema_weights] (which fills the tied names
    in), ``safetensors.torch.load_model(model, path)`` or ``from_pretrained``.

    The header metadata records ``format`` (``"emakit.ema_weights"``), ``format_version``,
    ``emakit_version``, ``model_class`` (the model's own class, not FSDP2's), ``step``,
    ``initted``, the current ``decay`` and the decay settings (``beta``,
    ``update_after_step``, ``update_every``, ``inv_gamma``, ``power``, ``min_value``,
    ``schedule``). A crash during the save leaves any previous file whole.

    Args:
        ema: the [`EMA`][emakit.EMA] (or [`EMAPytree`][emakit.EMAPytree], saved under its leaf
            paths) to export.
        path: the destination file; its folder is created if missing.
        dtype: cast floating tensors to this dtype on the way out (e.g. ``torch.bfloat16``
            for deployment; for a sharded EMA, before they are gathered). Default None
            keeps the shadow dtype. A cast that would turn a finite value into ``inf``
            (above 65504 in float16) raises ``EMAValueError`` naming the tensor and its
            largest magnitude (on every rank of a collective save, checked by rank 0 on
            each gathered tensor); the previous file is left whole.
        metadata: extra ``str -> str`` header entries; they may not reuse emakit's keys.
        tied_once: keyword-only; store each tied tensor once. Default False.
        timeout_s: keyword-only; for a collective save, seconds a rank waits for the
            others at the agreement step before it raises. Default 30.

    Returns:
        ``path`` as a `Path` (on every rank).

    Raises:
        EMAValueError: ``path`` is not a valid UTF-8 name (it could not be read back).
        EMAWriteError: the file could not be written (disk full, read-only folder); an
            ``OSError`` with the original ``errno`` (on every rank of a collective save).
            Any previous file is left whole.
        EMARuntimeError: a collective save that some ranks did not call within
            ``timeout_s``, or that meets another emakit collective.
        EMAStateError: a collective save of ranks whose EMAs are at different steps or
            skip counts (on every rank; nothing is written).
        EMAValueError: ``dtype`` cannot hold a value of the EMA (see ``dtype``).

    Example:
        >>> import tempfile, safetensors.torch
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = EMA(net)
        >>> path = save_ema_weights(ema, tempfile.mkdtemp() + "/ema.safetensors")
        >>> _ = net.load_state_dict(safetensors.torch.load_file(path))
    """
    return write_weights(
        ema, path, dtype=dtype, metadata=metadata, tied_once=tied_once, timeout_s=timeout_s
    )


def write_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
    tied_once: bool = False,
    timeout_s: float = AGREE_TIMEOUT_S,
    every_rank: bool = False,
) -> Path:
    """[`save_ema_weights()`][emakit.checkpoint.save_ema_weights]; with ``every_rank``
    [`save_full_ema_weights()`][emakit.distributed.save_full_ema_weights] (so named in the
    ranks' agreement): a collective for every EMA under ``torch.distributed`` (the whole
    EMA written by rank 0), not only for a sharded one."""
    ema = check_ema(ema)
    dest = writable_path("path", path)
    dtype = check.floating_dtype("dtype", dtype)
    timeout_s = check.real("timeout_s", timeout_s, low=0.0, low_open=True)
    tensors, gather = _full_tensors(ema)
    if check.boolean("tied_once", tied_once) and ema.kind == "module":
        aliases = {n for names in tied_names(ema) for n in names[1:]}
        tensors = {k: v for k, v in tensors.items() if k not in aliases}
    header = weights_header(ema, tensors, dtype)
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise EMATypeError(f"metadata must be a mapping of str to str, got {metadata=!r}")
        clash = sorted(set(metadata) & set(header))
        if clash:
            raise EMAValueError(f"metadata may not override emakit's header keys, got {clash}")
        header.update(metadata)
    collective = dist_ready() and (gather is not None or every_rank)
    if collective:
        operation = "save_full_ema_weights" if every_rank else "save_ema_weights"
        agree_on(operation, ema, timeout_s=timeout_s, settings=_export_settings(tensors, dtype))
    writer = not collective or torch.distributed.get_rank() == 0
    failure = export.write_streamed(
        dest, tensors, header, dtype, gather or (lambda name, _: tensors[name]), writer=writer
    )
    export.share_outcome(failure, str(dest), collective)
    return dest


def _export_settings(tensors: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, str]:
    """What every rank of a collective export must share beyond the EMA's settings: the
    export dtype and the tensors' names, full shapes and dtypes (ranks that would gather
    tensors of other sizes abort inside the gather), the layout as a digest."""
    layout = [(k, list(t.shape), str(out_dtype(t, dtype))) for k, t in tensors.items()]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()[:12]
    return {
        "dtype (of the export)": str(dtype),
        "tensors written (names, shapes, dtypes)": f"{len(layout)} tensors, digest {digest}",
    }


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)``, crash-safe: a training checkpoint that holds the EMA.

    The object is written to a temporary file next to ``path``, fsynced, then renamed over
    ``path`` (and the folder fsynced): a crash, ``SIGKILL`` or full disk at any moment
    leaves either the previous file or the complete new one, never a torn file that
    ``torch.load`` cannot read. It is the same atomic write emakit uses for its own files
    ([`atomic_write`][emakit._files.atomic.atomic_write]).

    Args:
        obj: what ``torch.save`` takes, e.g. ``{"model": net.state_dict(),
            "opt": opt.state_dict(), "ema": ema.state_dict()}``.
        path: the checkpoint file; its folder is created if missing.

    Returns:
        ``path`` as a `pathlib.Path`.

    Raises:
        EMAValueError: ``path`` is not a valid UTF-8 name.
        EMAWriteError: the file could not be written (disk full, read-only folder); an
            ``OSError`` with the original ``errno``. The previous file is left as it was.

    Example:
        >>> import tempfile
        >>> net = torch.nn.Linear(2, 2)
        >>> ema = EMA(net)
        >>> path = save_checkpoint(
        ...     {"model": net.state_dict(), "ema": ema.state_dict()}, f"{tempfile.mkdtemp()}/c.pt"
        ... )
        >>> ema.load_state_dict(torch.load(path)["ema"])
        <All keys matched successfully>
    """
    dest = writable_path("path", path)
    with write_errors([dest], "checkpoint"):
        atomic_write(dest, lambda f: torch.save(obj, f))
    return dest


def emakit_header(metadata: Mapping[str, str], source: str) -> tuple[int | None, bool] | None:
    """``(step, initted)`` from the header of a file [`save_ema_weights()`][emakit.checkpoint.save_ema_weights] wrote, None
    for another safetensors file, or an error for a damaged emakit header.

    A header with emakit's entries (``format_version``, ``emakit_version``) or a ``format``
    one or two characters away from `WEIGHTS_FORMAT`, but not a format emakit knows,
    is refused: reading it as a plain state dict would silently drop its step.

    Raises:
        EMAStateError: the header is damaged, newer than this emakit, or its ``step``,
            ``initted`` or ``format_version`` entries are malformed (naming ``source`` and
            the entry).
    """
    fmt = metadata.get("format")
    if fmt != WEIGHTS_FORMAT:
        ours = [k for k in _EMAKIT_ENTRIES if k in metadata]
        looks = isinstance(fmt, str) and near_format(fmt, WEIGHTS_FORMAT)
        if (ours or looks) and fmt not in OTHER_EMAKIT_FORMATS:
            raise EMAStateError(
                f"{source}: the header has "
                + (f"emakit's entries {ours}" if ours else "a format close to emakit's")
                + f" but format={fmt!r}, not {WEIGHTS_FORMAT!r}; the header is damaged, and "
                f"reading the file as a plain state dict would drop its step. Restore the "
                f"file from a copy, or load its tensors yourself and pass them to "
                f"emakit.load_foreign_state(..., format='state_dict', step=...)"
            )
        return None
    if "format_version" not in metadata:
        raise EMAStateError(
            f"{source}: the header says format={WEIGHTS_FORMAT!r} but has no format_version; "
            f"the header is damaged"
        )
    check.not_newer(source, "format_version", metadata["format_version"], WEIGHTS_FORMAT_VERSION)
    text = metadata.get("step")
    step = None if text is None else check.stored_count(source, "step", text, text=True)
    flag = metadata.get("initted", "true")
    if flag not in ("true", "false"):
        raise EMAStateError(
            f"{source}: initted must be 'true' or 'false', got initted={flag!r}; the header "
            f"is damaged"
        )
    return step, flag == "true"


def load_ema_weights(
    ema: EMA,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    restore_step: bool = True,
    timeout_s: float = AGREE_TIMEOUT_S,
) -> dict[str, str]:
    """Load EMA weights written by [`save_ema_weights()`][emakit.checkpoint.save_ema_weights]
    (or any safetensors file of the model's ``state_dict``) into ``ema``, for every EMA.

    Values are copied into the existing shadow tensors, so the shadow keeps its dtype (an
    fp32 shadow stays fp32 when the file holds bf16). Names are paired strictly. An EMA
    sharded by FSDP2 keeps the shard of each tensor it owns. **A partitioned EMA**
    (DeepSpeed ZeRO-3, ``partition=True``) loads in a collective: call it on every rank;
    the ranks first check that every one is in this call (bounded by ``timeout_s``), then
    each rank reads the file itself and keeps its own partition of each tensor (the slice
    of the flattened tensor its ``ds_tensor`` holds), so the file loads on any number of
    ranks: this is how a partitioned EMA moves to another world size (its per-rank
    ``state_dict`` is refused on another one).

    Args:
        ema: the [`EMA`][emakit.EMA] or [`EMAPytree`][emakit.EMAPytree] to load into.
        path: the safetensors file (readable by every rank, for a partitioned EMA).
        strict: with True (default) a missing or extra tensor name is an error listing
            them; with False, tensors absent from the file keep their values, and a
            ``UserWarning`` names the extra and the missing ones.
        restore_step: take ``step`` and ``initted`` from the header when the file was
            written by emakit (default True). Otherwise, and for files without them, the
            EMA keeps its step and counts as initialized, so the next ``update()`` does not
            re-initialize it from the model (a step still inside the warm-up,
            ``step <= update_after_step``, copies the model as usual).
        timeout_s: keyword-only; for a partitioned EMA, seconds a rank waits for the
            others at the agreement step. Default 30.

    Returns:
        The header metadata (``{}`` for a file without any).

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is a folder, a FIFO or another non-regular file.
        EMAStateError: the file is truncated, corrupt, newer than this emakit, its header
            is damaged (a malformed ``step``, a ``format`` that is not emakit's on a header
            that has emakit's entries), or it holds another model's weights or tensors of
            another kind (integers into a floating tensor, ...); the message names the
            file and the mismatch.
        EMARuntimeError: a partitioned EMA's load that some ranks did not call within
            ``timeout_s``.
    """
    ema = check_ema(ema)
    src = as_path("path", path)
    check.boolean("strict", strict)
    check.boolean("restore_step", restore_step)
    timeout_s = check.real("timeout_s", timeout_s, low=0.0, low_open=True)
    parts = ema.ema_model if isinstance(ema.ema_model, ZeroPartitions) else None
    if parts is not None and dist_ready():
        agree_on("load_ema_weights", ema, timeout_s=timeout_s, check_counts=False)
    tensors, metadata = read_safetensors(src)  # mapped: a partition keeps its own pages
    tensors.update(frozen_tensors(src, metadata, tensors))  # a post-hoc snapshot's, stored once
    if parts is not None:
        tensors = {name: parts.own_part(name, t) for name, t in tensors.items()}
        tensors[WORLD_KEY] = parts.layout_tensor()
    header = emakit_header(metadata, str(src))
    if header is not None and metadata.get("kind", ema.kind) != ema.kind:
        raise EMAStateError(
            f"{src} holds the weights of an EMA of a {metadata['kind']}, but ema is an "
            f"EMA of a {ema.kind}"
        )
    step, initted = header if header is not None and restore_step else (None, True)
    load_weights(ema, tensors, step=step, initted=initted, strict=strict, source=str(src))
    return metadata


def load_weights(
    ema: EMA,
    weights: Mapping[str, Tensor],
    *,
    step: int | None,
    initted: bool,
    strict: bool,
    source: str,
) -> None:
    """Copy ``weights`` (model names) into the shadow, set step/initted, pairing strictly;
    errors name ``source``."""
    if ema.kind == "pytree":
        current, prefix = leaves(ema.ema_pytree), "ema."
    else:
        if ema.ema_model is None:
            ema.init_ema()
        current, prefix = ema.ema_model.state_dict(), "ema_model."
    expected = set(current)
    weights = _align_keys(weights, expected)
    if ema.kind == "module":  # a tied tensor stored once (save_model...) fills its names
        weights = dict(weights)
        for names in tied_names(ema):
            present = [n for n in names if n in weights]
            if present:
                weights.update({n: weights[present[0]] for n in names if n not in weights})
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if strict and (missing or extra):
        raise EMAStateError(
            f"{source} does not match the EMA model by name: missing {few(missing)}, "
            f"unexpected {few(extra)}; it was saved from another model (or pass strict=False)"
        )
    if extra or missing:  # strict=False: say what was left out, never silently
        warnings.warn(
            f"{source} loaded with strict=False: {len(extra)} name(s) of the checkpoint "
            f"match no tensor of the EMA model and were not loaded {few(extra)}; "
            f"{len(missing)} tensor(s) of the EMA model are not in it and keep their values "
            f"{few(missing)}",
            UserWarning,
            stacklevel=3,
        )
    bad = []
    for k in sorted(expected & set(weights)):
        if not isinstance(weights[k], Tensor):
            kind = type(weights[k]).__name__
            raise EMAStateError(f"{source}: entry {k!r} is a {kind}, not a tensor")
        if weights[k].shape != current[k].shape:
            have, want = tuple(weights[k].shape), tuple(current[k].shape)
            bad.append(f"{k}: {have} in the checkpoint vs {want} in the model")
    if bad:
        raise EMAStateError(f"{source} has tensors of other shapes than the model: {few(bad)}")
    state: dict[str, Any] = {
        "step": torch.tensor(int(ema.step) if step is None else step),
        "initted": torch.tensor(initted),
    }
    state.update({prefix + k: v for k, v in weights.items() if k in expected})
    load_state(ema, state, strict=False, source=source)


def load_state(ema: EMA, state: Mapping[str, Any], *, strict: bool, source: str) -> None:
    """``ema.load_state_dict(state, strict=strict)``, its errors naming ``source``."""
    try:
        ema.load_state_dict(state, strict=strict)
    except EMAError as e:
        raise EMAStateError(f"{source}: {e}") from e


def tied_names(ema: EMA) -> list[list[str]]:
    """The EMA model's tensor names, grouped by tensor: a group of two or more is tied."""
    groups: dict[int, list[str]] = {}
    model = ema.ema_model
    named = (
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    )
    for name, t in named:
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def _align_keys(weights: Mapping[str, Tensor], expected: set[str]) -> dict[str, Tensor]:
    """``weights`` as is, or with DDP/compile/AveragedModel prefixes stripped when that
    matches the model's names better (a model may own a submodule called ``module``)."""
    raw = dict(weights)
    if set(raw) == expected:
        return raw
    stripped = {_WRAPPER_PREFIXES.sub("", k): v for k, v in raw.items()}
    if len(stripped) == len(raw) and len(set(stripped) & expected) > len(set(raw) & expected):
        return stripped
    return raw
