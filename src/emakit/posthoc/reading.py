"""Reading one post-hoc snapshot: emakit's (one file, or one file per rank) and
ema-pytorch's.

* `open_snapshot()`: a whole-model snapshot, through one open file: emakit's lazily
  (header first, then one tensor at a time), ema-pytorch's loaded whole
  (``torch.load(weights_only=True)``).
* `snapshot_sources()`: the files of a snapshot, each with the block of every tensor it
  stores (one file holding every tensor whole, or the rank files of a sharded snapshot,
  see [`emakit.posthoc.shards`][emakit.posthoc.shards]), opened one at a time.
* `load_legacy_tensors()`, `restore_exact()`: ema-pytorch's files, whose integer
  tensors were stored as floats.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from .._files.reading import open_regular, refusal_reason
from .._files.safetensors_file import SafetensorsFile
from ..errors import EMAStateError
from .frozen_files import join_frozen
from .shards import Block, parse_layout
from .snapshots import SnapshotInfo

__all__ = [
    "SnapshotReader",
    "load_legacy_tensors",
    "open_snapshot",
    "restore_exact",
    "snapshot_sources",
]


def load_legacy_tensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The EMA model's tensors in an ema-pytorch snapshot, as stored (names without the
    ``ema_model.`` prefix; ``initted`` and ``step`` left out).

    Loaded with ``torch.load(weights_only=True)``: a file holding anything but tensors
    (e.g. a pickled object with code) is refused, never executed.

    Raises:
        EMAFileNotFoundError: the file does not exist.
        EMAValueError: it is not a regular file (a FIFO...).
        EMAStateError: the file cannot be loaded that way, or is not a ``KarrasEMA`` state.
    """
    with open_regular(path, "ema-pytorch snapshot") as f:
        return _legacy_tensors(f, Path(path))


def _legacy_tensors(f: Any, p: Path) -> dict[str, Tensor]:
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise EMAStateError(
            f"{p} could not be loaded as an ema-pytorch snapshot: torch.load(weights_only="
            f"True) refused it ({refusal_reason(e)}). emakit reads .pt snapshots with "
            f"weights_only=True and never runs pickled code; move the file out of the "
            f"snapshot folder if it is not one of ema-pytorch's snapshots"
        ) from e
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()
    ):
        raise EMAStateError(
            f"{p} holds a {type(obj).__name__} that is not an ema-pytorch KarrasEMA state dict "
            f"(names -> tensors); move it out of the snapshot folder"
        )
    prefix = "ema_model."
    stray = sorted(k for k in obj if not k.startswith(prefix) and k not in ("initted", "step"))
    out = {k[len(prefix) :]: v for k, v in obj.items() if k.startswith(prefix)}
    if stray or not out:
        raise EMAStateError(
            f"{p} is not an ema-pytorch KarrasEMA state dict: expected initted, step and "
            f"ema_model.* keys, got {sorted(obj)[:10]}; move it out of the snapshot folder"
        )
    return out


def restore_exact(info: SnapshotInfo, name: str, value: Tensor) -> Tensor | None:
    """``value`` of ``name`` from ``info``'s file in its exact dtype (rounded), for
    ema-pytorch files that stored integer and bool tensors as floats; unchanged otherwise.

    Returns:
        The tensor, or None when the float copy overflowed (inf/NaN: the value is lost).
    """
    dtype = dict(info.exact_dtypes).get(name)
    if dtype is None or value.dtype == dtype:
        return value
    if value.is_floating_point():
        if not bool(torch.isfinite(value).all()):
            return None
        value = value.round()
    return value.to(dtype)


class SnapshotReader(Protocol):
    """The tensors of one open snapshot (`open_snapshot()`)."""

    def keys(self) -> list[str]:
        """The tensor names."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype."""
        ...

    def get(self, name: str) -> Tensor:
        """A tensor, as stored."""
        ...


class _TensorsReader:
    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self._t = tensors

    def keys(self) -> list[str]:
        return list(self._t)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._t[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._t[name].dtype

    def get(self, name: str) -> Tensor:
        return self._t[name]


def _changed(info: SnapshotInfo, identity: tuple[int, int, int, int], digest: str) -> None:
    if (info.identity is not None and identity != info.identity) or (
        info.header_digest and digest != info.header_digest
    ):
        raise EMAStateError(
            f"snapshot {info.path} changed after the synthesis was planned (it was replaced "
            f"or rewritten: another process is writing to the folder?); plan the synthesis "
            f"again once the folder is no longer written to"
        )


@contextmanager
def open_snapshot(info: SnapshotInfo) -> Iterator[SnapshotReader]:
    """Open one snapshot for reading through one open file: an emakit file lazily
    (its header, then one tensor at a time; joined with its side file, if it has one), an
    ema-pytorch file loaded whole (``torch.load(weights_only=True)``).

    Raises:
        EMAStateError: the file changed since ``info`` was read (another file at the path,
            or another header); an ema-pytorch file that cannot be loaded safely; a
            damaged file.
    """
    if info.is_legacy:
        with open_regular(info.path, "ema-pytorch snapshot") as fh:
            st = os.fstat(fh.fileno())
            _changed(info, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), "")
            tensors = _legacy_tensors(fh, info.path)
        yield _TensorsReader(tensors)
        return
    with SafetensorsFile(info.path, "snapshot") as f:
        _changed(info, f.identity, f.header_digest)
        with join_frozen(f) as g:
            yield g


#: name -> (global shape, the block this file stores, or None).
Layout = Mapping[str, tuple[tuple[int, ...], Block | None]]


def _whole_layout(f: SnapshotReader) -> dict[str, tuple[tuple[int, ...], Block | None]]:
    return {n: (f.shape(n), Block.whole(f.shape(n))) for n in f.keys()}  # noqa: SIM118


def snapshot_sources(
    info: SnapshotInfo, first: int | None = None
) -> Iterator[tuple[SnapshotReader, Layout]]:
    """The files of ``info``, one open at a time, each with its layout (name -> global
    shape and the block it stores). A whole-model snapshot is one file storing every
    tensor whole; a sharded one yields its rank files, starting with rank ``first`` (the
    caller's own rank: with an unchanged world size that file alone holds the caller's
    blocks, and the caller stops iterating). A file whose frozen tensors are in a side
    file is yielded joined with it (see
    [`join_frozen()`][emakit.posthoc.frozen_files.join_frozen]): every reader sees every tensor.

    Raises:
        EMAStateError: a file changed since it was listed, or its header is malformed.
    """
    if not info.shards:
        with open_snapshot(info) as f:
            yield f, _whole_layout(f)
        return
    order: Sequence[int] = range(len(info.shards))
    if first is not None and 0 <= first < len(info.shards):
        order = [first, *(r for r in order if r != first)]
    for r in order:
        path = info.shards[r]
        with SafetensorsFile(path, "snapshot shard") as f:
            if path == info.path:
                _changed(info, f.identity, f.header_digest)
            meta = f.metadata
            if meta.get("step") != str(info.step) or meta.get("rank") != str(r):
                raise EMAStateError(
                    f"snapshot shard {path} changed after the synthesis was planned (its "
                    f"header now says step {meta.get('step')}, rank {meta.get('rank')}); "
                    f"plan the synthesis again once the folder is no longer written to"
                )
            with join_frozen(f) as g:  # its frozen blocks are in its side file
                yield g, parse_layout(path, meta, {n: g.shape(n) for n in g.keys()})  # noqa: SIM118
