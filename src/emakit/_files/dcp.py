"""Sharded (DCP) checkpoint folders that survive a crash, read without unpickling code.

Imported only by [`emakit.distributed`][emakit.distributed]'s save and load functions (it imports
``torch.distributed.checkpoint``).

**Layout.** ``torch.distributed.checkpoint`` (DCP) writes its files in place, so a process
killed during a save over an existing checkpoint leaves a folder that is neither the old
checkpoint nor the new one. emakit therefore never writes into the checkpoint that is in
use. A checkpoint folder ``ckpt/`` holds::

    ckpt/emakit-sharded.json     {"format": "emakit.sharded_ema", "format_version": 1,
                                  "current": "v-3f2a9c0e6b1d4e57"}
    ckpt/v-3f2a9c0e6b1d4e57/     a complete DCP checkpoint (.metadata, __0_0.distcp, ...)

A save writes a fresh sibling ``ckpt/v-<random>/``; once DCP has finished (every rank's
data and the ``.metadata`` written and fsynced), rank 0 replaces the pointer file
atomically (`emakit._files.atomic.atomic_write_bytes()`) and then removes the other ``v-*``
folders: the previous checkpoint, and any left by a save that was killed (stale
temporaries). A kill at any moment leaves the pointer naming a complete checkpoint. A
folder without the pointer is read as a plain DCP checkpoint (what emakit wrote before,
or ``dcp.save`` itself); the first save over it switches it to this layout and removes
the old top-level DCP files.

**Reading.** DCP's own reader unpickles ``.metadata`` with `pickle`, and non-tensor
entries with ``torch.load(weights_only=False)``: a crafted checkpoint runs code.
`SafeReader` unpickles ``.metadata`` with an unpickler that resolves only DCP's own
metadata classes, ``torch.Size``, torch dtypes and layouts, and paths, refuses entries
stored as pickled bytes (an EMA's state holds only tensors), and refuses data file names
that point outside the checkpoint. Tensor data is read by DCP with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as _md
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import EMAFileNotFoundError, EMAStateError
from .atomic import atomic_write_bytes, fsync_dir
from .reading import open_regular, parse_json

#: The pointer file naming a checkpoint folder's current version.
POINTER = "emakit-sharded.json"
#: ``format`` in the pointer file.
SHARDED_FORMAT = "emakit.sharded_ema"
_VERSION = re.compile(r"^v-[0-9a-f]{16}$")
_DCP_FILE = re.compile(r"^(\.metadata|__\d+\.metadata|__\d+_\d+\.distcp)$")


def new_version() -> str:
    """A fresh version folder name, ``v-<16 hex digits>``."""
    return f"v-{uuid.uuid4().hex[:16]}"


def read_pointer(folder: Path) -> str | None:
    """The current version named by ``folder``'s pointer file (None without one).

    Raises:
        EMAStateError: the pointer file is malformed or cannot be read.
        EMAValueError: the pointer is not a regular file (a FIFO, a device, a folder).
    """
    path = folder / POINTER
    try:  # the one safe opener: a FIFO or device in its place is refused, not waited on
        with open_regular(path, "sharded-checkpoint pointer file") as f:
            raw = f.read()
    except EMAFileNotFoundError:
        return None
    try:
        pointer = parse_json(raw.decode("utf-8"))
        current = pointer["current"]
        ok = pointer.get("format") == SHARDED_FORMAT and isinstance(current, str)
    except (ValueError, TypeError, KeyError, AttributeError):
        ok, current = False, None
    if not ok or not _VERSION.match(current):
        raise EMAStateError(
            f"{path} is not an emakit sharded-checkpoint pointer (expected JSON with format "
            f"{SHARDED_FORMAT!r} and current 'v-<16 hex digits>'); the file is damaged"
        )
    return str(current)


def commit(folder: Path, version: str) -> None:
    """Make ``folder/version`` (complete) the current checkpoint: one atomic replace of the
    pointer file."""
    fsync_dir(folder / version)
    pointer = {"format": SHARDED_FORMAT, "format_version": 1, "current": version}
    atomic_write_bytes(folder / POINTER, json.dumps(pointer).encode())


def remove_stale(folder: Path, keep: str) -> None:
    """Remove the version folders other than ``keep`` (superseded, or left by a killed
    save) and the top-level files of a plain DCP checkpoint the pointer replaced."""
    for entry in list(os.scandir(folder)):
        if entry.is_dir(follow_symlinks=False) and _VERSION.match(entry.name):
            if entry.name != keep:
                shutil.rmtree(entry.path, ignore_errors=True)
        elif entry.is_file(follow_symlinks=False) and _DCP_FILE.match(entry.name):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


# -- reading without unpickling code -----------------------------------------------------------


def _layout(name: str) -> torch.layout:
    """``torch.serialization._get_layout``'s stand-in: a torch layout by name."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise EMAStateError(f"{name!r} is not a torch layout")
    return value


#: What a ``.metadata`` file may refer to: the classes DCP's metadata module defines (its
#: dataclasses and enums), its storage records, and the plain types their fields hold
#: (torch dtypes, layouts and memory formats are looked up apart).
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        (_md.__name__, name): c
        for name, c in vars(_md).items()
        if isinstance(c, type) and c.__module__ == _md.__name__
    },
    **{  # Python 3.13 pickles a path as pathlib._local.PosixPath
        (module, name): Path
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")
    },
    (_StorageInfo.__module__, _StorageInfo.__qualname__): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch.serialization", "_get_layout"): _layout,
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP's ``.metadata`` holds; anything else is refused."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":  # torch.float32, torch.strided...
            value = getattr(torch, name, None)
            found = value if isinstance(value, _TORCH_CONSTANTS) else None
        if found is None:
            raise EMAStateError(
                f"{self.path} refers to {module}.{name}, which is not part of DCP's checkpoint "
                f"metadata; emakit does not unpickle anything else (a crafted .metadata file "
                f"could run code). The checkpoint is damaged or was not written by DCP"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise EMAStateError(f"{self.path} holds a persistent reference; it is not DCP metadata")


def _check_metadata(metadata: Any, path: str) -> None:
    if not isinstance(metadata, Metadata):
        raise EMAStateError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    storage = metadata.storage_data
    if not isinstance(storage, Mapping):
        raise EMAStateError(f"{path}: storage_data is a {type(storage).__name__}, not a map")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str):
            raise EMAStateError(f"{path}: the storage entry of {index} is malformed")
        if not name or name in (".", "..") or os.path.basename(name) != name or "\\" in name:
            raise EMAStateError(
                f"{path}: the storage entry of {getattr(index, 'fqn', index)!r} names the "
                f"file {name!r}, which is not a file inside the checkpoint folder"
            )


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` without running code.

    Args:
        path: the DCP checkpoint folder (a version folder, or a plain DCP checkpoint).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled with an allow-list of DCP's classes.

        Raises:
            EMAStateError: the file refers to anything else (it is refused, not run), or
                is malformed.
        """
        try:
            metadata = self._read_checked(kwargs.get("rank"))
        except EMAStateError as e:
            # torch 2.9's dcp.load swallows this (it then fails on "metadata is None"):
            # kept for load_sharded_ema to raise instead
            self.refused = e
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    #: The refusal of the last `read_metadata()` call, or None.
    refused: EMAStateError | None = None

    def _read_checked(self, rank: int | None) -> Metadata:
        path = self._metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, str(path)).load()
            except EMAStateError:
                raise
            except Exception as e:
                raise EMAStateError(
                    f"{path} is not readable DCP metadata ({type(e).__name__}: {e}); the "
                    f"checkpoint is damaged"
                ) from e
        _check_metadata(metadata, str(path))
        return metadata

    def _metadata_path(self, rank: int | None) -> Any:
        """The ``.metadata`` file's path: torch's own method where it has one (2.5 on, which
        may name a file per rank), else the single file torch 2.4 reads."""
        own = getattr(self, "_get_metadata_path", None)
        return own(rank) if own is not None else self.fs.concat_path(self.path, ".metadata")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the planned tensors; an entry stored as pickled bytes is refused.

        Raises:
            EMAStateError: the plan would unpickle an entry (DCP loads those with
                ``torch.load(weights_only=False)``).
        """
        pickled = [i.dest_index.fqn for i in plan.items if i.type == LoadItemType.BYTE_IO]
        if pickled:
            raise EMAStateError(
                f"{self.path}: the entries {pickled[:5]} are stored as pickled objects, which "
                f"DCP would load with torch.load(weights_only=False); an EMA's state holds "
                f"only tensors, so emakit refuses them"
            )
        # file by file, so a damaged data file is named (DCP's own error is only the
        # exception type: "rank 0: EOFError")
        per_file: dict[str, list[Any]] = collections.defaultdict(list)
        for item in plan.items:
            per_file[self.storage_data[item.storage_index].relative_path].append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except EMAStateError:
                raise
            except Exception as e:
                raise EMAStateError(
                    f"data file {Path(self.path) / name} of the sharded checkpoint cannot be read "
                    f"({type(e).__name__}: {' '.join(str(e).split())[:200] or 'no message'}); "
                    f"it is truncated or damaged: restore it, or load an older checkpoint"
                ) from e
        done: Future[None] = Future()
        done.set_result(None)
        return done
