"""Frozen weights stored once: the side files of post-hoc snapshots.

A [`PostHocEMA`][emakit.PostHocEMA] built with ``share_frozen=True`` shares its frozen
weights (``requires_grad=False``: a LoRA base, a frozen encoder) with the model (see
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
the folder refers to any more ([`collect_frozen_files()`][emakit.posthoc.snapshots.folder.collect_frozen_files]): the file of a value that
changed, once the snapshots of the old value are gone (deleted by hand, replaced by a
resumed run); a file still referred to, or one that a damaged snapshot might refer to, is
never removed. Call it yourself after removing snapshots.

**Reading.** A side file's bytes are checked when it is read: every tensor is hashed
(`tensor_digest()`) as it is read and the digest compared with the one its snapshots
record (`check_side_file()`; a reader of a snapshot reads and hashes the side file once,
at its first frozen tensor). A damaged file (a flipped bit, a partial copy) raises an
[`EMAStateError`][emakit.errors.EMAStateError] naming it, its snapshots and both digests,
instead of giving wrong weights.

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

from ..._files.safetensors_file import SafetensorsFile
from ..._version import __version__
from ...errors import EMAError, EMAStateError, user_stacklevel
from ..math import PostHocWarning
from .shards import header_names, malformed, shard_suffix

__all__ = [
    "FROZEN_FORMAT",
    "FrozenJoin",
    "FrozenPart",
    "check_side_file",
    "frozen_part",
    "frozen_ref",
    "frozen_tensors",
    "is_side_file",
    "join_frozen",
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


def _stored(t: Tensor, dtype: torch.dtype | None, copy: bool = False) -> Tensor:
    """``t`` as a snapshot stores it, on the CPU: a floating tensor in ``dtype`` (None
    keeps its own), an integer or bool tensor exact."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return t.detach().to("cpu", target, copy=copy).contiguous()


def snapshot_tensors(state: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """CPU copies of an EMA model's ``state`` to write as a snapshot: floating tensors in
    ``dtype`` (None keeps theirs), integer and bool tensors exact.

    Warns:
        PostHocWarning: values overflow ``dtype`` (stored as inf).
    """
    out = {name: _stored(v, dtype, copy=True) for name, v in state.items()}
    overflow = [
        n
        for n, v in state.items()
        if out[n].dtype != v.dtype and out[n].isinf().any() and not v.isinf().any()
    ]
    if overflow:
        warnings.warn(
            f"post-hoc EMA snapshot: values of {overflow[:5]} overflow {dtype} and were "
            f"stored as inf; use checkpoint_dtype=torch.float32 or torch.bfloat16",
            PostHocWarning,
            stacklevel=user_stacklevel(),
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
    return f"frozen-{digest[:32]}.run-{run}{shard_suffix(*shard) if shard else ''}.safetensors"


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


def frozen_ref(path: Path, meta: Mapping[str, str]) -> FrozenRef | None:
    """The side file a snapshot file's header refers to, checked; None when it stores
    every tensor itself.

    Raises:
        EMAStateError: a reference field is malformed (naming the file and the field).
    """
    if "frozen_file" not in meta:
        return None
    file, digest = meta.get("frozen_file", ""), meta.get("frozen_digest", "")
    names = header_names(path, meta, "frozen_names")
    for key, ok in (
        ("frozen_file", is_side_file(file)),
        ("frozen_digest", _DIGEST.match(digest) and file.startswith(f"frozen-{digest[:32]}.")),
    ):
        if not ok:
            raise malformed(path, f"{key}={meta.get(key)!r}")
    return FrozenRef(path.parent / file, digest, names)


def _side_problem(path: Path, digest: str) -> str:
    """What is wrong with ``path`` as the side file recording ``digest`` (its header; the
    bytes are checked when read, see `check_side_file()`); ``""`` when nothing is."""
    if not os.path.lexists(path):
        return "does not exist"
    try:
        with SafetensorsFile(path, "frozen weights file") as f:
            meta = f.metadata
    except EMAError as e:
        return f"cannot be read ({e})"
    if meta.get("format") != FROZEN_FORMAT:
        return f"is not a frozen weights file (its header format is {meta.get('format')!r})"
    if meta.get("digest") != digest:
        return f"records another digest ({meta.get('digest')!r}): it was replaced"
    return ""


def side_missing(path: Path, meta: Mapping[str, str], seen: dict[Any, str]) -> str:
    """Why the snapshot file ``path`` (header ``meta``) cannot be read: its side file is
    missing or damaged (naming both); ``""`` when it has none or it is fine. Listing skips
    such files. ``seen`` caches the side files checked (one listing's)."""
    ref = frozen_ref(path, meta)
    if ref is None:
        return ""
    key = (ref.file, ref.digest)
    if key not in seen:
        seen[key] = _side_problem(ref.file, ref.digest)
    if not seen[key]:
        return ""
    return (
        f"skipping {path}: its frozen weights file {ref.file.name} is missing or damaged: it "
        f"{seen[key]} (the side files of a snapshot folder must stay next to its snapshots: "
        f"copy or move the folder as a whole)"
    )


class _Hashed(Mapping[str, Tensor]):
    """A side file's tensors read one at a time, as `tensor_digest()` asks for them;
    those named in ``keep`` are kept (``kept``), so a reader that needs them reads the
    file once."""

    def __init__(self, side: SafetensorsFile, keep: Iterable[str] = ()) -> None:
        self.side, self.keep = side, set(keep)
        self.kept: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        t = self.side.get(name)
        if name in self.keep:
            self.kept[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.side.keys())

    def __len__(self) -> int:
        return len(self.side.keys())


def _verified(
    side: SafetensorsFile, users: Sequence[Path], keep: Iterable[str] = ()
) -> dict[str, Tensor]:
    """Read every tensor of the open side file ``side`` once, hashing it (`tensor_digest()`
    of the stored tensors), and compare the digest with the one its header and its
    snapshots (``users``) record; the tensors named in ``keep``, as read.

    Raises:
        EMAStateError: the digests differ (naming the side file, the snapshots, both
            digests).
    """
    reading = _Hashed(side, keep)
    actual, expected = tensor_digest(reading, None), side.metadata.get("digest", "")
    if actual != expected:
        names = ", ".join(str(p) for p in users[:3]) + (" ..." if len(users) > 3 else "")
        raise EMAStateError(
            f"frozen weights file {side.path} is damaged: the SHA-256 of its tensors is "
            f"{actual}, but the snapshot(s) taking their frozen weights from it ({names}) "
            f"record {expected}; its bytes changed since it was written (a bad disk, an "
            f"incomplete copy, an edit). Restore the file from a copy of the folder; "
            f"without it those snapshots cannot be used"
        )
    return reading.kept


def check_side_file(path: Path, users: Sequence[Path] = (), digest: str | None = None) -> None:
    """Check the side file ``path`` whole: its tensors hash to the digest its header
    records (one read of the file), and that is ``digest`` when given (what its snapshots
    record). ``users``: the snapshot files that refer to it, for the message.

    Raises:
        EMAStateError: it is missing, unreadable, not a side file, replaced, or its bytes
            do not hash to its digest (the message names it and the snapshots).
    """
    first = users[0] if users else path
    try:
        side = SafetensorsFile(path, "frozen weights file")
    except EMAError as e:
        why = f"cannot be read ({e})"
        raise _side_error(first, FrozenRef(path, digest or "", frozenset()), why) from e
    with side:
        recorded = side.metadata.get("digest", "")
        why = _side_problem(path, recorded if digest is None else digest)
        if why:
            raise _side_error(first, FrozenRef(path, recorded, frozenset()), why)
        _verified(side, users)


class FrozenJoin:
    """One snapshot file and its side file read as one: the snapshot's own tensors and,
    under their names, the frozen ones it takes from the side file. The side file's bytes
    are checked against its digest when its first tensor is read (`get()`): the whole
    file is read and hashed once, then tensors are read as asked."""

    def __init__(self, own: SafetensorsFile, side: SafetensorsFile, names: frozenset[str]):
        self.own, self.side, self.names = own, side, names
        self.metadata = own.metadata
        self.path = own.path
        self.checked = False

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

    def get(self, name: str) -> Tensor:
        """A tensor, as stored.

        Raises:
            EMAStateError: ``name`` is in the side file, whose bytes do not hash to its
                digest.
        """
        if name in self.names and not self.checked:
            kept = _verified(self.side, [self.path], keep=(name,))
            self.checked = True
            return kept[name]
        return self._of(name).get(name)


def _side_error(path: Path, ref: FrozenRef, why: str) -> EMAStateError:
    return EMAStateError(
        f"snapshot {path} takes its frozen weights from {ref.file.name}, which {why}; the "
        f"snapshot cannot be read without it (the side files of a snapshot folder must stay "
        f"next to its snapshots: copy or move the folder as a whole)"
    )


def _open_side(path: Path, ref: FrozenRef, own: set[str]) -> SafetensorsFile:
    """The side file ``ref`` of the snapshot file ``path`` (storing ``own``), open, checked.

    Raises:
        EMAStateError: the side file is missing, not a side file, records another digest,
            or does not hold the names the snapshot takes from it (or the snapshot holds
            them too).
    """
    try:
        side = SafetensorsFile(ref.file, "frozen weights file")
    except EMAError as e:
        raise _side_error(path, ref, f"cannot be read ({e})") from e
    missing, twice = sorted(ref.names - set(side.keys())), sorted(ref.names & own)
    if side.metadata.get("format") != FROZEN_FORMAT or side.metadata.get("digest") != ref.digest:
        why = "records another digest (it was replaced)"
    else:
        why = f"lacks {missing[:5]}" if missing else f"repeats {twice[:5]}" if twice else ""
    if why:
        side.close()
        raise _side_error(path, ref, why)
    return side


@contextlib.contextmanager
def join_frozen(f: Any) -> Iterator[Any]:
    """``f`` (an open snapshot file) joined with its side file, if its header names one
    (a `FrozenJoin`); ``f`` itself
    otherwise (an ema-pytorch file, a snapshot that stores every tensor).

    Raises:
        EMAStateError: the side file is missing, replaced or incomplete.
    """
    meta = getattr(f, "metadata", None)
    ref = None if meta is None else frozen_ref(f.path, meta)
    if ref is None:
        yield f
        return
    with _open_side(f.path, ref, set(f.keys())) as side:
        yield FrozenJoin(f, side, ref.names)


def frozen_tensors(
    path: str | os.PathLike[str], meta: Mapping[str, str], own: Iterable[str]
) -> dict[str, Tensor]:
    """The frozen tensors a snapshot file (header ``meta``, storing ``own``) takes from its
    side file; empty when it has none. For readers of a snapshot as a plain state dict
    ([`load_ema_weights()`][emakit.checkpoint.load_ema_weights]). The side file is read
    once, every tensor hashed as it is read and the digest checked.

    Raises:
        EMAStateError: the side file is missing, replaced, incomplete, or its bytes do not
            hash to the digest its snapshot records.
    """
    ref = frozen_ref(Path(path), meta)
    if ref is None:
        return {}
    with _open_side(Path(path), ref, set(own)) as side:
        return _verified(side, [Path(path)], keep=ref.names)  # hashed as read: one read


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

    def header(self, run: str) -> dict[str, str]:
        """The side file's header metadata (see the module docstring)."""
        return {
            "format": FROZEN_FORMAT,
            "format_version": str(FROZEN_FORMAT_VERSION),
            "emakit_version": __version__,
            "digest": self.digest,
            "run": run,
        }

    def fields(self, index: int) -> dict[str, str] | None:
        """The header entries of profile ``index``'s snapshot that name the side file
        (``frozen_file``, ``frozen_digest``, ``frozen_names``), or None when it takes
        nothing from it."""
        names = self.names[index]
        if not names:
            return None
        return {
            "frozen_file": self.path.name,
            "frozen_digest": self.digest,
            "frozen_names": json.dumps(sorted(names)),
        }


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
        mine = sorted(names_shared & set(state))
        for name in mine:
            tensors.setdefault(name, state[name])
        names.append(frozenset(mine))
    if not tensors:
        return None
    digest = tensor_digest(tensors, dtype)
    path = folder / frozen_filename(digest, run, shard)
    return FrozenPart(tuple(names), tensors, digest, path, bool(_side_problem(path, digest)))
