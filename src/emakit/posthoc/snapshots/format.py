"""Post-hoc EMA snapshots: safetensors files that describe themselves.

A snapshot is the state of one power-function EMA profile at one training step. Each
file carries, in its safetensors header, everything synthesis needs: the format and its
version, ``gamma`` and ``sigma_rel``, the ``step`` it was taken at and ``t``, the step its
averaging profile ends at (equal to ``step`` for snapshots written by
[`PostHocEMA`][emakit.PostHocEMA]), which tensors are copied rather than averaged, the
profile index, and the ``run`` that wrote it (see [`emakit.posthoc.snapshots.folder`][emakit.posthoc.snapshots.folder]). A folder of
snapshots can therefore be synthesized from without the model or the training script
(``emakit synthesize``), and files that are not snapshots (logs, other checkpoints,
temporary files) are ignored.

File names are readable and sort by step, e.g.
``step-000010000_sigma_rel-0.05_gamma-16.9722.safetensors``; the header, not the name, is
authoritative, and every header field is validated when read. Floating tensors are stored
in the snapshot dtype (float16 by default); integer and bool tensors
(``num_batches_tracked``, step counters) are stored exactly. Writes are atomic (temporary
file, fsync, rename; one step's files all or none, see `write_snapshots()`) and, under
``torch.distributed``, made by rank 0 only. A snapshot is read through one open file; its
`SnapshotInfo.identity` and `SnapshotInfo.header_digest` let a later read
notice that the file was replaced in between.

Header metadata (format version 1), all values strings::

    {
        "format": "emakit.posthoc.snapshot",
        "format_version": "1",
        "emakit_version": "0.1.0",
        "step": "10000",              # update() calls when written
        "t": "10000",                 # step the averaging profile ends at
        "gamma": "16.97219860230345",
        "sigma_rel": "0.05",
        "profile": "0",               # index among the PostHocEMA's profiles
        "update_every": "10",
        "copied": "[\\"bn.num_batches_tracked\\", ...]",  # JSON: taken, not averaged
        "run": "3f2a9c0e6b1d4e57",    # the run that wrote it (absent before emakit 0.2)
    }

Version 2 adds ``frozen_file``, ``frozen_digest`` and ``frozen_names``: the shared frozen
tensors are in a side file (see [`emakit.posthoc.snapshots.frozen`][emakit.posthoc.snapshots.frozen]).

**ema-pytorch's snapshots** (``<profile index>.<step>.pt``, ``torch.save`` of a
``KarrasEMA.state_dict()`` with every value in float16 by default) record no gamma; given
the profiles by index ([`LegacyProfiles`][emakit.posthoc.snapshots.legacy.LegacyProfiles]), [`list_snapshots()`][emakit.posthoc.snapshots.folder.list_snapshots] reads them too,
with ``torch.load(weights_only=True)``. See [`LegacyProfiles.t_of()`][emakit.posthoc.snapshots.legacy.LegacyProfiles.t_of] for their ``t``.

Reading: `open_snapshot()` opens one snapshot through one open file (emakit's lazily,
header first, then one tensor at a time, joined with its side file; ema-pytorch's loaded
whole), `snapshot_sources()` yields the files of a snapshot, each with the block of every
tensor it stores (one file for a whole model, the rank files of a sharded snapshot, see
[`emakit.posthoc.snapshots.shards`][emakit.posthoc.snapshots.shards]).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..._files.atomic import atomic_paths
from ..._files.reading import writable_path, write_errors
from ..._files.safetensors_file import SafetensorsFile, near_format, write_safetensors
from ..._validate import not_newer, stored_count
from ..._version import __version__
from ...errors import EMAStateError
from ..math import GAMMA_MIN
from .frozen import frozen_ref, join_frozen
from .legacy import LEGACY_SOURCE, load_legacy_tensors
from .shards import (
    FLAT_LAYOUT_VERSION,
    SHARD_FORMAT,
    Block,
    header_names,
    malformed,
    parse_layout,
    shard_suffix,
)

__all__ = [
    "RUN_PATTERN",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_SUFFIX",
    "SYNTHESIZED_FORMAT",
    "SnapshotInfo",
    "looks_damaged",
    "open_snapshot",
    "parse_header",
    "read_snapshot_info",
    "snapshot_filename",
    "snapshot_header",
    "snapshot_sources",
    "write_snapshot",
    "write_snapshots",
]

#: ``format`` value in a snapshot's header; other safetensors files are not snapshots.
SNAPSHOT_FORMAT = "emakit.posthoc.snapshot"
#: Newest layout read: 2 (a snapshot naming a side file of frozen tensors, see
#: `emakit.posthoc.snapshots.frozen`; a shard file holding flat ranges, see
#: `emakit.posthoc.snapshots.shards`); files using neither are written as 1. Newer ones are
#: refused.
SNAPSHOT_FORMAT_VERSION = 2
SNAPSHOT_SUFFIX = ".safetensors"
#: ``format`` value in the header of files ``emakit synthesize`` writes.
SYNTHESIZED_FORMAT = "emakit.posthoc.synthesized"
#: What a run id looks like: 1 to 64 letters, digits, ``.``, ``_`` or ``-``.
RUN_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot's header says about it (read without loading any tensor).

    Attributes:
        path: the file.
        step: ``update()`` calls when it was written.
        t: the step its averaging profile ends at (the last averaging update); the
            post-hoc solve uses ``t``.
        gamma: the profile's exponent.
        sigma_rel: the profile's relative width.
        profile: index of the profile in the [`PostHocEMA`][emakit.PostHocEMA] that wrote it.
        update_every: the profile's ``update_every`` (informational for emakit's; for
            ema-pytorch's files it decides what they hold, see
            [`solve_weights_stepwise()`][emakit.posthoc.math.solve_weights_stepwise]).
        copied: names of tensors taken as they are at synthesis (buffers, integer
            tensors, no-EMA and ignored names) instead of averaged.
        format_version: the header's ``format_version`` (0 for ema-pytorch files).
        source: ``"emakit"``, or ``"ema-pytorch"`` for an ema-pytorch
            ``<index>.<step>.pt`` file read through [`LegacyProfiles`][emakit.posthoc.snapshots.legacy.LegacyProfiles].
        exact_dtypes: for ema-pytorch files, the dtype each integer or bool tensor is
            restored to (ema-pytorch stored it as a float); empty for emakit snapshots.
        run: the id of the run that wrote it (``""`` for snapshots of emakit versions
            before run ids, and for ema-pytorch files).
        identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file when its header
            was read; None when not known.
        header_digest: SHA-256 of the header bytes when read (``""`` for ema-pytorch files).
        shards: for a snapshot of a sharded model, every rank's file in rank order
            (``path`` is rank 0's; see [`emakit.posthoc.snapshots.shards`][emakit.posthoc.snapshots.shards]); empty otherwise.
        frozen: the side files holding its frozen tensors (one per file of the snapshot
            that has one, see [`emakit.posthoc.snapshots.frozen`][emakit.posthoc.snapshots.frozen]);
            empty when it stores every tensor itself.
        frozen_names: the tensors it takes from ``frozen``; of a sharded set, those that
            every rank file storing a block of them takes from its side file (what the
            side files alone determine).
    """

    path: Path
    step: int
    t: int
    gamma: float
    sigma_rel: float
    profile: int
    update_every: int
    copied: frozenset[str]
    format_version: int = SNAPSHOT_FORMAT_VERSION
    source: str = "emakit"
    exact_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    run: str = ""
    identity: tuple[int, int, int, int] | None = None
    header_digest: str = ""
    shards: tuple[Path, ...] = ()
    frozen: tuple[Path, ...] = ()
    frozen_names: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes (of every rank's file, for a sharded snapshot; its side
        files, which other snapshots share, not counted)."""
        return sum(p.stat().st_size for p in self.files)

    @property
    def files(self) -> tuple[Path, ...]:
        """The files of the snapshot: every rank's for a sharded one, else ``(path,)``."""
        return self.shards or (self.path,)

    @property
    def world(self) -> int:
        """The number of ranks that wrote the snapshot (1 for a whole-model file)."""
        return len(self.shards) or 1

    @property
    def is_legacy(self) -> bool:
        """Whether this is an ema-pytorch ``<index>.<step>.pt`` file."""
        return self.source == LEGACY_SOURCE


def snapshot_filename(
    step: int, sigma_rel: float, gamma: float, shard: tuple[int, int] | None = None
) -> str:
    """The readable file name of a snapshot, e.g.
    ``step-000010000_sigma_rel-0.05_gamma-16.9722.safetensors``, and with
    ``shard=(rank, world)`` one rank's file of a sharded snapshot, e.g.
    ``step-000010000_sigma_rel-0.05_gamma-16.9722.rank-00003-of-00004.safetensors``.

    The zero-padded step makes a sorted listing chronological.
    """
    name = f"step-{step:09d}_sigma_rel-{sigma_rel:.6g}_gamma-{gamma:.6g}"
    return name + (shard_suffix(*shard) if shard else "") + SNAPSHOT_SUFFIX


def snapshot_header(info: SnapshotInfo, frozen: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header metadata that describes ``info`` (see the module docstring for the
    layout; `parse_header()` reads it back); ``frozen``: the entries naming its side file
    ([`FrozenPart.fields()`][emakit.posthoc.snapshots.frozen.FrozenPart.fields]), which
    make it format version 2."""
    header = {
        "format": SNAPSHOT_FORMAT,
        "format_version": "2" if frozen else "1",
        "emakit_version": __version__,
        "step": str(int(info.step)),
        "t": str(int(info.t)),
        "gamma": repr(float(info.gamma)),
        "sigma_rel": repr(float(info.sigma_rel)),
        "profile": str(int(info.profile)),
        "update_every": str(int(info.update_every)),
        "copied": json.dumps(sorted(info.copied)),
    }
    if info.run:
        header["run"] = info.run
    header.update(frozen or {})
    return header


def write_snapshots(
    paths: Sequence[str | os.PathLike[str]],
    produce: Callable[[int], tuple[Mapping[str, Tensor], Mapping[str, str]]],
    *,
    before_replace: Callable[[], None] | None = None,
) -> list[Path]:
    """Write several snapshots as one set: all of them, or none.

    Each file is written to a temporary file next to it and fsynced; only when all are
    complete are they renamed into place (see `emakit._files.atomic.atomic_paths()`). A failed
    write (a full disk) leaves every destination as it was and no temporary file behind.
    ``produce(i)`` is called for one file at a time, so only one file's tensors are held.

    Args:
        paths: the destinations.
        produce: ``i -> (tensors, header)`` for ``paths[i]``; ``header`` from
            `snapshot_header()`, the tensors already in the dtype to store.
        before_replace: keyword-only; called once every file is complete, before any
            replaces its destination; if it raises, nothing is replaced (see
            [`atomic_paths()`][emakit._files.atomic.atomic_paths]). Default None.

    Returns:
        The paths written.

    Raises:
        EMAValueError: a path is not valid UTF-8 (it could not be read back).
        EMAWriteError: a file could not be written (disk full, read-only folder); an
            ``OSError`` with the original ``errno``, naming the files. Nothing was replaced.
    """
    dests = [writable_path("path", p) for p in paths]
    with (
        write_errors(dests, "snapshot"),
        atomic_paths(dests, before_replace=before_replace) as temps,
    ):
        for i, tmp in enumerate(temps):
            tensors, header = produce(i)
            with open(tmp, "wb") as f:
                write_safetensors(f, tensors, header)
            del tensors
    return dests


def write_snapshot(
    path: str | os.PathLike[str], tensors: Mapping[str, Tensor], **fields: object
) -> Path:
    """Write one snapshot atomically (temporary file in the same folder, fsync, rename).

    Args:
        path: the destination file.
        tensors: name -> tensor, already in the dtype to store.
        **fields: what the header says, as the fields of `SnapshotInfo` (``step``, ``t``,
            ``gamma``, ``sigma_rel``, ``profile``, ``update_every``, ``copied``, ``run``).

    Raises:
        EMAWriteError: the file could not be written; it was left as it was.
    """
    header = snapshot_header(SnapshotInfo(Path(path), **fields))  # type: ignore[arg-type]
    return write_snapshots([path], lambda i: (tensors, header))[0]


def _count(meta: Mapping[str, str], key: str, path: Path, low: int, default: int | None) -> int:
    if key not in meta and default is not None:
        return default
    if key not in meta:
        raise malformed(path, f"{key} missing")
    return stored_count(f"snapshot {path}", key, meta[key], low=low, text=True)


def _real(meta: Mapping[str, str], key: str, path: Path, low: float | None = None) -> float:
    # low: the smallest value accepted; None: any value > 0
    value = meta.get(key)
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise malformed(path, f"{key}={value!r}: not a number") from None
    if not (math.isfinite(x) and (x > 0 if low is None else x >= low)):
        bound = "> 0" if low is None else f">= {low:.6f}"
        raise malformed(path, f"{key}={value!r}: must be finite and {bound}")
    return x


def parse_header(path: Path, meta: Mapping[str, str], f: SafetensorsFile) -> SnapshotInfo:
    """A snapshot's header (of a whole-model file, or of one rank's file), every field
    checked; errors name the file and the field."""
    version = _count(meta, "format_version", path, 1, None)
    newest = SNAPSHOT_FORMAT_VERSION
    if meta.get("format") == SHARD_FORMAT:  # version 2: flat ranges (ZeRO-3 partitions)
        newest = max(newest, FLAT_LAYOUT_VERSION)
    not_newer(f"snapshot {path}", "format_version", version, newest)
    copied = header_names(path, meta, "copied", absent="[]")
    gamma = _real(meta, "gamma", path, low=GAMMA_MIN)
    step = _count(meta, "step", path, 1, None)
    t = _count(meta, "t", path, 1, step)
    if t > step:
        raise malformed(path, f"t={meta.get('t')!r}: after step={step}")
    run = meta.get("run", "")
    if run and not RUN_PATTERN.match(run):
        raise malformed(path, f"run={run!r}: not a run id")
    ref = frozen_ref(path, meta)
    return SnapshotInfo(
        path=path,
        step=step,
        t=t,
        gamma=gamma,
        sigma_rel=_real(meta, "sigma_rel", path),
        profile=_count(meta, "profile", path, 0, 0),
        update_every=_count(meta, "update_every", path, 1, 1),
        copied=copied,
        format_version=version,
        run=run,
        identity=f.identity,
        header_digest=f.header_digest,
        frozen=() if ref is None else (ref.file,),
        frozen_names=frozenset() if ref is None else ref.names,
    )


def looks_damaged(meta: Mapping[str, str]) -> bool:
    """A header that is almost a snapshot's: its format one or two characters off, or
    missing while the profile fields are there (a flipped bit in the key)."""
    fmt = meta.get("format")
    if isinstance(fmt, str):
        return near_format(fmt, SNAPSHOT_FORMAT) and fmt != SNAPSHOT_FORMAT
    return "gamma" in meta and "sigma_rel" in meta


def read_snapshot_info(path: str | os.PathLike[str]) -> SnapshotInfo:
    """Read a snapshot's header (no tensor is loaded).

    Example:
        >>> info = read_snapshot_info("ckpts/step-000001000_sigma_rel-0.05_gamma-16.9722.safetensors")  # doctest: +SKIP
        >>> info.step, round(info.sigma_rel, 2)  # doctest: +SKIP
        (1000, 0.05)

    Raises:
        EMAFileNotFoundError: the file does not exist.
        EMAValueError: it is a folder, a FIFO or another non-regular file.
        EMAStateError: it is not a readable emakit snapshot, one from a newer emakit, or
            a header field is malformed (the message names the file and the field).
    """
    p = Path(path)
    with SafetensorsFile(p, "snapshot file") as f:
        meta = f.metadata
        if meta.get("format") != SNAPSHOT_FORMAT:
            raise EMAStateError(
                f"{p} is not an emakit post-hoc snapshot (its header format is "
                f"{meta.get('format')!r}, expected {SNAPSHOT_FORMAT!r})"
                + ("; the header looks damaged" if looks_damaged(meta) else "")
            )
        return parse_header(p, meta, f)


# -- reading the tensors ------------------------------------------------------------------


class _Tensors(dict[str, Tensor]):
    """An ema-pytorch file's tensors, loaded whole, read as a snapshot file is (``keys()``,
    ``get(name)``, and:)."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self[name].dtype


def _check_unchanged(info: SnapshotInfo, identity: tuple[int, ...], digest: str) -> None:
    if (info.identity is not None and identity != info.identity) or (
        info.header_digest and digest != info.header_digest
    ):
        raise EMAStateError(
            f"snapshot {info.path} changed after the synthesis was planned (it was replaced "
            f"or rewritten: another process is writing to the folder?); plan the synthesis "
            f"again once the folder is no longer written to"
        )


@contextmanager
def open_snapshot(info: SnapshotInfo, rank: int = 0) -> Iterator[Any]:
    """Open one snapshot (or rank ``rank``'s file of a sharded one) for reading through one
    open file: an emakit file lazily (its header, then one tensor at a time; joined with
    its side file, if it has one), an ema-pytorch file loaded whole
    (``torch.load(weights_only=True)``). The reader has ``keys()``, ``shape(name)``,
    ``dtype(name)`` and ``get(name)`` (a `SafetensorsFile`).

    Raises:
        EMAStateError: the file changed since ``info`` was read (another file at the path,
            or another header); an ema-pytorch file that cannot be loaded safely; a
            damaged file.
    """
    path = info.files[rank]
    if info.is_legacy:
        yield _Tensors(load_legacy_tensors(path))  # found by name: no header to compare
        return
    with SafetensorsFile(path, "snapshot") as f:
        if rank == 0:
            _check_unchanged(info, f.identity, f.header_digest)
        meta = f.metadata
        if info.shards and (meta.get("step") != str(info.step) or meta.get("rank") != str(rank)):
            raise EMAStateError(
                f"snapshot shard {path} changed after the synthesis was planned (its "
                f"header now says step {meta.get('step')}, rank {meta.get('rank')}); "
                f"plan the synthesis again once the folder is no longer written to"
            )
        with join_frozen(f) as g:  # a shard file's frozen blocks are in its side file too
            yield g


#: name -> (global shape, the block this file stores, or None).
Layout = Mapping[str, tuple[tuple[int, ...], Block | None]]


def snapshot_sources(info: SnapshotInfo, first: int | None = None) -> Iterator[tuple[Any, Layout]]:
    """The files of ``info`` (`open_snapshot()`), one open at a time, each with its layout
    (name -> global shape and the block it stores). A whole-model snapshot is one file
    storing every tensor whole; a sharded one yields its rank files, starting with rank
    ``first`` (the caller's own rank: with an unchanged world size that file alone holds
    the caller's blocks, and the caller stops iterating). A file whose frozen tensors are
    in a side file is yielded joined with it (see
    [`join_frozen()`][emakit.posthoc.snapshots.frozen.join_frozen]): every reader sees every tensor.

    Raises:
        EMAStateError: a file changed since it was listed, or its header is malformed.
    """
    order = list(range(info.world))
    if first is not None and 0 <= first < info.world:
        order.insert(0, order.pop(first))
    for rank in order:
        with open_snapshot(info, rank) as f:
            shapes = {n: f.shape(n) for n in f.keys()}  # noqa: SIM118 - a reader is not a dict
            if info.shards:
                yield f, parse_layout(info.files[rank], f.metadata, shapes)
            else:
                yield f, {n: (shape, Block.whole(shape)) for n, shape in shapes.items()}
