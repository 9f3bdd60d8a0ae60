"""Frozen weights stored once: the side files of post-hoc snapshots.

A [`PostHocEMA`][emakit.PostHocEMA] shares its frozen weights (``requires_grad=False``: a
LoRA base, a frozen encoder) with the model (``share_frozen=True``, the default, see
`emakit._core.frozen`). Their values then change only when the user changes them, so a
snapshot need not store them again: each snapshot file leaves its shared tensors out and
names the **side file** that holds them, one per distinct value, in the snapshot folder::

    frozen-<32 hex digits>.run-<run>.safetensors                        a whole model
    frozen-<32 hex digits>.run-<run>.rank-00001-of-00004.safetensors    one rank's blocks

The hex digits start the SHA-256 of the stored tensors (`tensor_digest()`: names, dtypes,
shapes and bytes, in the snapshot dtype), so the name says what the file holds. A side
file belongs to one run (its id is in the name): two runs in one folder never share, and
never remove, each other's files. Its header (format version 1), all values strings::

    {
        "format": "emakit.posthoc.frozen",
        "format_version": "1",
        "emakit_version": "0.2.0",
        "digest": "<64 hex digits>",   # SHA-256 of the tensors, as tensor_digest() computes
        "run": "3f2a9c0e6b1d4e57",
    }

and a snapshot that uses one has ``format_version`` 2 and (see
`emakit.posthoc.snapshots`)::

    "frozen_file": "frozen-....safetensors",     # in the same folder
    "frozen_digest": "<64 hex digits>",          # the side file's "digest"
    "frozen_names": "[\\"base.weight\\", ...]",   # JSON: the tensors it takes from there

A sharded snapshot's rank file keeps the blocks of its frozen tensors in its
``shard_layout``; its side file holds the blocks themselves.

**Change detection.** At every snapshot the shared tensors are cast to the snapshot dtype
and hashed, one tensor at a time. When the digest is that of an existing side file of the
run (its header says so), the snapshot refers to it and nothing else is written; otherwise
(the first snapshot, new base weights loaded into a frozen module in place, a weight
unfrozen or un-shared, which is then stored in the snapshot itself) a new side file is
written in the same atomic set as the step's snapshots, renamed into place before them, so
no snapshot ever names a file that is not complete on disk. A changed value always gets a
new digest, hence a new file: it is never read back as the old one. Cheaper signals
(``Tensor._version``, ``data_ptr()``) are not used: a write through ``.data``, a NumPy
view or an extension kernel changes the bytes without bumping either.

**Removal.** After each snapshot the writer removes its run's side files that no file in
the folder refers to any more (`collect_frozen_files()`): the file of a value that
changed, once the snapshots of the old value are gone (deleted by hand, replaced by a
resumed run); a file still referred to is never removed. Call it yourself after removing
snapshots.

`snapshot_tensors()` (the CPU copies a snapshot or a side file stores, floating tensors
in the snapshot dtype) and `tensor_digest()` apply that one cast rule.

Tools that read a snapshot file alone (``safetensors.torch.load_file``) do not see its
frozen tensors; ``emakit synthesize`` writes whole models, and
``PostHocEMA(store_frozen_once=False)`` writes every tensor into every snapshot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._files.atomic import TEMP_PREFIX
from .._files.safetensors_file import SafetensorsFile
from ..errors import EMAError, EMAStateError
from .math import PostHocWarning
from .shards import shard_suffix

__all__ = [
    "FROZEN_FORMAT",
    "FROZEN_FORMAT_VERSION",
    "FrozenJoin",
    "FrozenPart",
    "FrozenRef",
    "collect_frozen_files",
    "frozen_filename",
    "frozen_header",
    "frozen_part",
    "frozen_ref",
    "frozen_tensors",
    "is_side_file",
    "join_frozen",
    "reference_fields",
    "side_file_ok",
    "side_missing",
    "snapshot_tensors",
    "tensor_digest",
]

#: ``format`` of a side file.
FROZEN_FORMAT = "emakit.posthoc.frozen"
#: Layout version of side files written by this emakit.
FROZEN_FORMAT_VERSION = 1
_NAME = re.compile(
    r"^frozen-[0-9a-f]{32}\.run-[A-Za-z0-9._-]{1,64}(\.rank-\d{5}-of-\d{5})?\.safetensors$"
)
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def is_side_file(name: str) -> bool:
    """Whether ``name`` is the name of a side file."""
    return bool(_NAME.match(name))


def _target(t: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a snapshot stores ``t`` in: ``dtype`` for a floating tensor (None keeps
    its own), its own for integer and bool tensors (exact)."""
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def _stored(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` as stored, on the CPU (no copy where it already is)."""
    return t.detach().to("cpu", _target(t, dtype)).contiguous()


def snapshot_tensors(state: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """CPU copies of an EMA model's ``state`` to write as a snapshot: floating tensors in
    ``dtype`` (None keeps theirs), integer and bool tensors exact.

    Warns:
        PostHocWarning: values overflow ``dtype`` (stored as inf).
    """
    out: dict[str, Tensor] = {}
    overflow: list[str] = []
    for name, v in state.items():
        v, target = v.detach(), _target(v, dtype)
        c = v.to(device="cpu", dtype=target, copy=True).contiguous()
        if target != v.dtype and c.isinf().any() and not v.isinf().any():
            overflow.append(name)
        out[name] = c
    if overflow:
        warnings.warn(
            f"post-hoc EMA snapshot: values of {overflow[:5]} overflow {dtype} and were "
            f"stored as inf; use checkpoint_dtype=torch.float32 or torch.bfloat16",
            PostHocWarning,
            stacklevel=4,
        )
    return out


def tensor_digest(tensors: Mapping[str, Tensor], dtype: torch.dtype | None) -> str:
    """SHA-256 (hex) of ``tensors`` as a snapshot stores them: floating tensors cast to
    ``dtype`` (None keeps theirs), each name, dtype and shape, then its bytes, by name.
    One tensor's CPU copy is held at a time."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = _stored(tensors[name], dtype)
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\0")
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def frozen_filename(digest: str, run: str, shard: tuple[int, int] | None = None) -> str:
    """The side file's name for ``digest`` in ``run`` (and ``shard=(rank, world)``)."""
    name = f"frozen-{digest[:32]}.run-{run}"
    if shard is not None:
        name += shard_suffix(*shard)
    return name + ".safetensors"


def frozen_header(digest: str, run: str) -> dict[str, str]:
    """The header metadata of a side file (see the module docstring)."""
    from .._version import __version__

    return {
        "format": FROZEN_FORMAT,
        "format_version": str(FROZEN_FORMAT_VERSION),
        "emakit_version": __version__,
        "digest": digest,
        "run": run,
    }


def reference_fields(file: str, digest: str, names: Sequence[str]) -> dict[str, str]:
    """The header entries of a snapshot that takes ``names`` from side file ``file``."""
    return {
        "frozen_file": file,
        "frozen_digest": digest,
        "frozen_names": json.dumps(sorted(names)),
    }


@dataclass(frozen=True)
class FrozenRef:
    """What a snapshot file's header says about its side file.

    Attributes:
        file: the side file (in the snapshot's folder).
        digest: the digest its header must record.
        names: the tensors the snapshot takes from it.
    """

    file: Path
    digest: str
    names: frozenset[str]


def _malformed(path: Path, key: str, value: object) -> EMAStateError:
    return EMAStateError(
        f"snapshot {path} has a malformed {key!r} in its header ({key}={value!r}); the file "
        f"is damaged or was not written by emakit: move it out of the folder"
    )


def frozen_ref(path: Path, meta: Mapping[str, str]) -> FrozenRef | None:
    """The side file a snapshot file's header refers to, checked; None when it stores
    every tensor itself.

    Raises:
        EMAStateError: a reference field is malformed (naming the file and the field).
    """
    if "frozen_file" not in meta:
        return None
    file, digest = meta.get("frozen_file", ""), meta.get("frozen_digest", "")
    if not is_side_file(file):
        raise _malformed(path, "frozen_file", file)
    if not _DIGEST.match(digest) or not file.startswith(f"frozen-{digest[:32]}."):
        raise _malformed(path, "frozen_digest", digest)
    try:
        names = json.loads(meta.get("frozen_names", ""))
    except ValueError:
        raise _malformed(path, "frozen_names", meta.get("frozen_names")) from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _malformed(path, "frozen_names", meta.get("frozen_names"))
    return FrozenRef(path.parent / file, digest, frozenset(names))


def side_file_ok(path: Path, digest: str) -> bool:
    """Whether ``path`` is a readable side file whose header records ``digest``."""
    try:
        with SafetensorsFile(path, "frozen weights file") as f:
            meta = f.metadata
    except EMAError:
        return False
    return meta.get("format") == FROZEN_FORMAT and meta.get("digest") == digest


def side_missing(path: Path, meta: Mapping[str, str], seen: dict[Any, bool]) -> str:
    """Why the snapshot file ``path`` (header ``meta``) cannot be read: its side file is
    missing or damaged; ``""`` when it has none or it is fine. Listing skips such files.
    ``seen`` caches the side files checked (one listing's)."""
    ref = frozen_ref(path, meta)
    if ref is None:
        return ""
    key = (ref.file, ref.digest)
    if key not in seen:
        seen[key] = side_file_ok(ref.file, ref.digest)
    if seen[key]:
        return ""
    return (
        f"skipping {path}: its frozen weights file {ref.file.name} is missing or damaged "
        f"(the side files of a snapshot folder must stay next to its snapshots)"
    )


class FrozenJoin:
    """One snapshot file and its side file read as one: the snapshot's own tensors and,
    under their names, the frozen ones it takes from the side file."""

    def __init__(self, own: SafetensorsFile, side: SafetensorsFile, names: frozenset[str]):
        self.own, self.side, self.names = own, side, names
        self.metadata = own.metadata
        self.path = own.path

    def _of(self, name: str) -> SafetensorsFile:
        return self.side if name in self.names else self.own

    def keys(self) -> list[str]:
        """The tensor names: the snapshot's, then the frozen ones."""
        return [*self.own.keys(), *sorted(self.names)]

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (of the block stored, for a rank file)."""
        return self._of(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype."""
        return self._of(name).dtype(name)

    def code(self, name: str) -> str:
        """A tensor's safetensors dtype code."""
        return self._of(name).code(name)

    def get(self, name: str) -> Tensor:
        """A tensor, as stored."""
        return self._of(name).get(name)


def _side_error(path: Path, ref: FrozenRef, why: str) -> EMAStateError:
    return EMAStateError(
        f"snapshot {path} takes its frozen weights from {ref.file.name}, which {why}; the "
        f"snapshot cannot be read without it (the side files of a snapshot folder must stay "
        f"next to its snapshots: copy or move the folder as a whole)"
    )


@contextlib.contextmanager
def join_frozen(f: Any) -> Iterator[Any]:
    """``f`` (an open snapshot file) joined with its side file, if its header names one;
    ``f`` itself otherwise (an ema-pytorch file, a snapshot that stores every tensor).

    Raises:
        EMAStateError: the side file is missing, not a side file, records another digest,
            or does not hold the names the snapshot takes from it (or the snapshot holds
            them too).
    """
    meta = getattr(f, "metadata", None)
    ref = None if meta is None else frozen_ref(f.path, meta)
    if ref is None:
        yield f
        return
    with _open_side(f.path, ref, set(f.keys())) as side:
        yield FrozenJoin(f, side, ref.names)


def _open_side(path: Path, ref: FrozenRef, own: set[str]) -> SafetensorsFile:
    """The side file ``ref`` of the snapshot file ``path`` (storing ``own``), open, checked."""
    try:
        side = SafetensorsFile(ref.file, "frozen weights file")
    except EMAError as e:
        raise _side_error(path, ref, f"cannot be read ({e})") from e
    why = _mismatch(side, ref, own)
    if why:
        side.close()
        raise _side_error(path, ref, why)
    return side


def _mismatch(side: SafetensorsFile, ref: FrozenRef, own: set[str]) -> str:
    """What is wrong with ``side`` as the side file ``ref`` names (``""``: nothing)."""
    meta = side.metadata
    if meta.get("format") != FROZEN_FORMAT or meta.get("digest") != ref.digest:
        return "records another digest (it was replaced)"
    missing = sorted(ref.names - set(side.keys()))
    if missing:
        return f"lacks {missing[:5]}"
    twice = sorted(ref.names & own)
    return f"repeats {twice[:5]}" if twice else ""


def frozen_tensors(
    path: str | os.PathLike[str], meta: Mapping[str, str], own: Iterable[str]
) -> dict[str, Tensor]:
    """The frozen tensors a snapshot file (header ``meta``, storing ``own``) takes from its
    side file; empty when it has none. For readers of a snapshot as a plain state dict
    ([`load_ema_weights()`][emakit.checkpoint.load_ema_weights]).

    Raises:
        EMAStateError: the side file is missing, replaced or incomplete.
    """
    ref = frozen_ref(Path(path), meta)
    if ref is None:
        return {}
    with _open_side(Path(path), ref, set(own)) as side:
        return {n: side.get(n) for n in sorted(ref.names)}


def _references(folder: Path) -> set[str] | None:
    """The side files the files of ``folder`` refer to; None when the folder cannot be
    listed."""
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return None
    out: set[str] = set()
    for p in entries:
        name = p.name
        if not name.endswith(".safetensors") or TEMP_PREFIX in name or is_side_file(name):
            continue
        with contextlib.suppress(EMAError, OSError), SafetensorsFile(p, "snapshot") as f:
            file = f.metadata.get("frozen_file")
            if file is not None:
                out.add(file)
    return out


def collect_frozen_files(
    folder: str | os.PathLike[str], run: str | None = None, shard: tuple[int, int] | None = None
) -> list[Path]:
    """Remove the side files in ``folder`` that no file there refers to any more.

    Only side files are ever removed: the run's (every run's when ``run`` is None), and
    with ``shard=(rank, world)`` only that rank's (each rank collects its own). A file that
    any ``.safetensors`` file in the folder refers to (a snapshot of any run, complete or
    not) is kept; a file whose header cannot be read refers to nothing. Never raises for a
    file that cannot be read or removed.

    Args:
        folder: the snapshot folder.
        run: the run whose side files may be removed. Default None: every run's.
        shard: ``(rank, world)``: only that rank's side files. Default None: the side
            files of whole-model snapshots (``run`` given), or all (``run`` None).

    Returns:
        The files removed.
    """
    root = Path(folder)
    ending = f".run-{run}{'' if shard is None else shard_suffix(*shard)}.safetensors"
    try:
        candidates = [
            p
            for p in sorted(root.glob("frozen-*.safetensors"))
            if is_side_file(p.name) and (run is None or p.name.endswith(ending))
        ]
    except OSError:
        return []
    refs = _references(root) if candidates else None  # no side file: no header read
    if refs is None:
        return []
    removed = []
    for p in candidates:
        if p.name not in refs:
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


@dataclass(frozen=True)
class FrozenPart:
    """One step's shared frozen tensors, as one rank stores them.

    Attributes:
        names: per profile, the tensors its snapshot takes from the side file.
        tensors: name -> the tensor (or this rank's block of it) the side file holds.
        digest: `tensor_digest()` of ``tensors`` in the snapshot dtype.
        path: the side file.
        new: whether it must be written (no side file of this digest exists yet).
    """

    names: tuple[frozenset[str], ...]
    tensors: dict[str, Tensor]
    digest: str
    path: Path
    new: bool

    def fields(self, index: int) -> dict[str, str] | None:
        """The header entries of profile ``index``'s snapshot, or None when it takes
        nothing from the side file."""
        names = self.names[index]
        return reference_fields(self.path.name, self.digest, sorted(names)) if names else None


def frozen_part(
    states: Sequence[Mapping[str, Tensor]],
    shared: Sequence[frozenset[str]],
    *,
    dtype: torch.dtype | None,
    folder: Path,
    run: str,
    shard: tuple[int, int] | None,
) -> FrozenPart | None:
    """The frozen part of one step's snapshots (see the module docstring), or None when no
    profile shares a tensor this rank stores.

    Args:
        states: what this rank stores of each profile's EMA model (its state dict, or the
            local blocks of a sharded one).
        shared: each profile's shared names ([`KarrasEMA.shared_names()`][emakit.posthoc.karras.KarrasEMA.shared_names]).
        dtype: the snapshot dtype of floating tensors (None keeps theirs).
        folder, run, shard: where the side file goes, whose it is, and ``(rank, world)``.
    """
    tensors: dict[str, Tensor] = {}
    names = []
    for state, names_shared in zip(states, shared, strict=True):
        mine = set()
        for name in sorted(names_shared & set(state)):
            tensors.setdefault(name, state[name])
            mine.add(name)
        names.append(frozenset(mine))
    if not tensors:
        return None
    digest = tensor_digest(tensors, dtype)
    path = folder / frozen_filename(digest, run, shard)
    return FrozenPart(tuple(names), tensors, digest, path, not side_file_ok(path, digest))
