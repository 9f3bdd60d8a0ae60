"""Post-hoc EMA snapshots: safetensors files that describe themselves.

A snapshot is the state of one power-function EMA profile at one training step. Each
file carries, in its safetensors header, everything synthesis needs: the format and its
version, ``gamma`` and ``sigma_rel``, the ``step`` it was taken at and ``t``, the step its
averaging profile ends at (equal to ``step`` for snapshots written by
[`PostHocEMA`][emakit.PostHocEMA]), which tensors are copied rather than averaged, the
profile index, and the ``run`` that wrote it (see [`emakit.posthoc.runs`][emakit.posthoc.runs]). A folder of
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
tensors are in a side file (see [`emakit.posthoc.frozen_files`][emakit.posthoc.frozen_files]).

**ema-pytorch's snapshots** (``<profile index>.<step>.pt``, ``torch.save`` of a
``KarrasEMA.state_dict()`` with every value in float16 by default) record no gamma; given
the profiles by index ([`LegacyProfiles`][emakit.posthoc.legacy.LegacyProfiles]), [`list_snapshots()`][emakit.posthoc.snapshots.list_snapshots] reads them too,
with ``torch.load(weights_only=True)``. See [`LegacyProfiles.t_of()`][emakit.posthoc.legacy.LegacyProfiles.t_of] for their ``t``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .._files.atomic import TEMP_PREFIX, atomic_paths
from .._files.reading import writable_path, write_errors
from .._files.safetensors_file import SafetensorsFile, write_safetensors
from .._validate import not_newer, stored_count
from ..errors import EMAError, EMAStateError
from .frozen_files import frozen_ref, is_side_file, join_frozen, side_missing, snapshot_tensors
from .legacy import (
    LEGACY_NAME,
    LEGACY_SOURCE,
    LegacyFile,
    LegacyProfiles,
    existing_folder,
    list_legacy_files,
)
from .math import GAMMA_MIN, PostHocWarning
from .shards import (
    FLAT_LAYOUT_VERSION,
    SHARD_FORMAT,
    ShardEntry,
    complete_sets,
    parse_layout,
    set_frozen_names,
    shard_fields,
    shard_suffix,
)

__all__ = [
    "LEGACY_NAME",
    "LEGACY_SOURCE",
    "RUN_PATTERN",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_SUFFIX",
    "SYNTHESIZED_FORMAT",
    "LegacyFile",
    "LegacyProfiles",
    "SnapshotInfo",
    "is_writer",
    "list_legacy_files",
    "list_snapshots",
    "read_snapshot_info",
    "snapshot_filename",
    "snapshot_header",
    "snapshot_tensors",
    "write_snapshot",
    "write_snapshots",
]

#: ``format`` value in a snapshot's header; other safetensors files are not snapshots.
SNAPSHOT_FORMAT = "emakit.posthoc.snapshot"
#: Newest layout read: 2 (a snapshot naming a side file of frozen tensors, see
#: `emakit.posthoc.frozen_files`; a shard file holding flat ranges, see
#: `emakit.posthoc.shards`); files using neither are written as 1. Newer ones are refused.
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
        update_every: the profile's ``update_every`` (informational).
        copied: names of tensors taken as they are at synthesis (buffers, integer
            tensors, no-EMA and ignored names) instead of averaged.
        format_version: the header's ``format_version`` (0 for ema-pytorch files).
        source: ``"emakit"``, or `LEGACY_SOURCE` (``"ema-pytorch"``) for an
            ema-pytorch ``<index>.<step>.pt`` file read through [`LegacyProfiles`][emakit.posthoc.legacy.LegacyProfiles].
        exact_dtypes: for ema-pytorch files, the dtype each integer or bool tensor is
            restored to (ema-pytorch stored it as a float); empty for emakit snapshots.
        run: the id of the run that wrote it (``""`` for snapshots of emakit versions
            before run ids, and for ema-pytorch files).
        identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file when its header
            was read; None when not known.
        header_digest: SHA-256 of the header bytes when read (``""`` for ema-pytorch files).
        shards: for a snapshot of a sharded model, every rank's file in rank order
            (``path`` is rank 0's; see [`emakit.posthoc.shards`][emakit.posthoc.shards]); empty otherwise.
        frozen: the side files holding its frozen tensors (one per file of the snapshot
            that has one, see [`emakit.posthoc.frozen_files`][emakit.posthoc.frozen_files]);
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
        return sum(p.stat().st_size for p in self.shards or (self.path,))

    @property
    def world(self) -> int:
        """The number of ranks that wrote the snapshot (1 for a whole-model file)."""
        return len(self.shards) or 1

    @property
    def is_legacy(self) -> bool:
        """Whether this is an ema-pytorch ``<index>.<step>.pt`` file."""
        return self.source == LEGACY_SOURCE


def is_writer() -> bool:
    """Whether this process writes files: always, except on ranks other than 0 of an
    initialized ``torch.distributed`` process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def snapshot_filename(
    step: int, sigma_rel: float, gamma: float, shard: tuple[int, int] | None = None
) -> str:
    """The readable file name of a snapshot, e.g.
    ``step-000010000_sigma_rel-0.05_gamma-16.9722.safetensors``, and with
    ``shard=(rank, world)`` one rank's file of a sharded snapshot, e.g.
    ``step-000010000_sigma_rel-0.05_gamma-16.9722.rank-00003-of-00004.safetensors``.

    The zero-padded step makes a sorted listing chronological.
    """
    name = f"step-{step:09d}_sigma_rel-{_fmt(sigma_rel)}_gamma-{_fmt(gamma)}"
    if shard is not None:
        name += shard_suffix(*shard)
    return name + SNAPSHOT_SUFFIX


def snapshot_header(
    *,
    step: int,
    t: int,
    gamma: float,
    sigma_rel: float,
    profile: int,
    update_every: int,
    copied: frozenset[str] | set[str],
    run: str = "",
    frozen: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The header metadata of a snapshot (see the module docstring for the layout);
    ``frozen``: the entries naming its side file
    ([`reference_fields()`][emakit.posthoc.frozen_files.reference_fields]), which make it format
    version 2."""
    from .._version import __version__

    header = {
        "format": SNAPSHOT_FORMAT,
        "format_version": "2" if frozen else "1",
        "emakit_version": __version__,
        "step": str(int(step)),
        "t": str(int(t)),
        "gamma": repr(float(gamma)),
        "sigma_rel": repr(float(sigma_rel)),
        "profile": str(int(profile)),
        "update_every": str(int(update_every)),
        "copied": json.dumps(sorted(copied)),
    }
    if run:
        header["run"] = run
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
    path: str | os.PathLike[str],
    tensors: Mapping[str, Tensor],
    *,
    step: int,
    t: int,
    gamma: float,
    sigma_rel: float,
    profile: int,
    update_every: int,
    copied: frozenset[str] | set[str],
    run: str = "",
) -> Path:
    """Write one snapshot atomically (temporary file in the same folder, fsync, rename).

    Args:
        path: the destination file.
        tensors: name -> tensor, already in the dtype to store.
        step, t, gamma, sigma_rel, profile, update_every, copied, run: the header fields
            (see [`SnapshotInfo`][emakit.posthoc.snapshots.SnapshotInfo]).

    Returns:
        ``path`` as a `Path`.

    Raises:
        EMAWriteError: the file could not be written; it was left as it was.
    """
    header = snapshot_header(
        step=step, t=t, gamma=gamma, sigma_rel=sigma_rel, profile=profile,
        update_every=update_every, copied=copied, run=run,
    )  # fmt: skip
    return write_snapshots([path], lambda i: (tensors, header))[0]


def _malformed(path: Path, key: str, value: object, why: str) -> EMAStateError:
    return EMAStateError(
        f"snapshot {path} has a malformed {key!r} in its header ({key}={value!r}: {why}); "
        f"the file is damaged or was not written by emakit: move it out of the folder"
    )


def _count(meta: Mapping[str, str], key: str, path: Path, low: int, default: int | None) -> int:
    if key not in meta and default is not None:
        return default
    try:
        return stored_count(f"snapshot {path}", key, meta[key], low=low, text=True)
    except KeyError:
        raise _malformed(path, key, None, "missing") from None


def _real(meta: Mapping[str, str], key: str, path: Path, low: float | None = None) -> float:
    # low: the smallest value accepted; None: any value > 0
    value = meta.get(key)
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _malformed(path, key, value, "not a number") from None
    if not (math.isfinite(x) and (x > 0 if low is None else x >= low)):
        bound = "> 0" if low is None else f">= {low:.6f}"
        raise _malformed(path, key, value, f"must be finite and {bound}")
    return x


def _parse(path: Path, meta: Mapping[str, str], f: SafetensorsFile | None = None) -> SnapshotInfo:
    """A snapshot's header, every field checked; errors name the file and the field."""
    if "format_version" not in meta:
        raise _malformed(path, "format_version", None, "missing")
    version = _count(meta, "format_version", path, 1, None)
    newest = SNAPSHOT_FORMAT_VERSION
    if meta.get("format") == SHARD_FORMAT:  # version 2: flat ranges (ZeRO-3 partitions)
        newest = max(newest, FLAT_LAYOUT_VERSION)
    not_newer(f"snapshot {path}", "format_version", version, newest)
    try:
        copied = json.loads(meta.get("copied", "[]"))
    except ValueError:
        raise _malformed(path, "copied", meta.get("copied"), "not JSON") from None
    if not isinstance(copied, list) or not all(isinstance(n, str) for n in copied):
        raise _malformed(path, "copied", meta.get("copied"), "not a JSON list of names")
    gamma = _real(meta, "gamma", path, low=GAMMA_MIN)
    step = _count(meta, "step", path, 1, None)
    t = _count(meta, "t", path, 1, step)
    if t > step:
        raise _malformed(path, "t", meta.get("t"), f"after step={step}")
    run = meta.get("run", "")
    if run and not RUN_PATTERN.match(run):
        raise _malformed(path, "run", run, "not a run id")
    ref = frozen_ref(path, meta)
    return SnapshotInfo(
        path=path,
        step=step,
        t=t,
        gamma=gamma,
        sigma_rel=_real(meta, "sigma_rel", path),
        profile=_count(meta, "profile", path, 0, 0),
        update_every=_count(meta, "update_every", path, 1, 1),
        copied=frozenset(copied),
        format_version=version,
        run=run,
        identity=None if f is None else f.identity,
        header_digest="" if f is None else f.header_digest,
        frozen=() if ref is None else (ref.file,),
        frozen_names=frozenset() if ref is None else ref.names,
    )


def _shard_entry(
    path: Path, meta: Mapping[str, str], f: SafetensorsFile
) -> tuple[ShardEntry, SnapshotInfo]:
    """One rank's file of a sharded snapshot: its set, rank and stored volumes."""
    info = _parse(path, meta, f)
    rank, world = shard_fields(path, meta)
    with join_frozen(f) as g:  # the blocks of its frozen tensors are in its side file
        layout = parse_layout(path, meta, {n: g.shape(n) for n in g.keys()})  # noqa: SIM118
    volumes = {n: (shape, 0 if b is None else b.numel) for n, (shape, b) in layout.items()}
    write = meta.get("shard_set", "")  # one write's files only: never two writes' mixed
    key = (
        info.step,
        info.t,
        info.gamma,
        info.sigma_rel,
        info.profile,
        info.run,
        info.copied,
        write,
    )
    return ShardEntry(key, rank, world, path, volumes), info


def _looks_damaged(meta: Mapping[str, str]) -> bool:
    """A header that is almost a snapshot's: its format one or two characters off, or
    missing while the profile fields are there (a flipped bit in the key)."""
    fmt = meta.get("format")
    if isinstance(fmt, str):
        near = len(fmt) == len(SNAPSHOT_FORMAT) and (
            sum(a != b for a, b in zip(fmt, SNAPSHOT_FORMAT, strict=True)) <= 2
        )
        return near and fmt != SNAPSHOT_FORMAT
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
                + ("; the header looks damaged" if _looks_damaged(meta) else "")
            )
        return _parse(p, meta, f)


#: safetensors codes of the integer and bool dtypes.
_EXACT = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8}
_EXACT.update({"U8": torch.uint8, "BOOL": torch.bool})


def _legacy_layout(
    emakit: list[SnapshotInfo], legacy: LegacyProfiles
) -> tuple[frozenset[str], tuple[tuple[str, torch.dtype], ...]]:
    """The copied names and exact dtypes ema-pytorch files are read with."""
    if legacy.copied is not None:
        return legacy.copied, legacy.exact_dtypes
    if emakit:  # the folder's own snapshots know the model
        ref = emakit[-1]
        with SafetensorsFile(ref.path, "snapshot") as f:
            stored = set(f.keys())
            codes = {n: f.code(n) for n in sorted(ref.copied) if n in stored}
        return ref.copied, tuple((n, _EXACT[c]) for n, c in codes.items() if c in _EXACT)
    return frozenset(), ()


def _legacy_snapshots(
    root: Path, emakit: list[SnapshotInfo], legacy: LegacyProfiles
) -> list[SnapshotInfo]:
    files = list_legacy_files(root)
    profiles = {f.path: legacy.profile(f) for f in files}  # raises for a bad index first
    empty = [f for f in files if f.step == 0]
    if empty:
        warnings.warn(
            f"skipping {len(empty)} ema-pytorch snapshot(s) of step 0 ({empty[0].path.name}, "
            f"...): written before any update(), they average nothing",
            PostHocWarning,
            stacklevel=3,
        )
    files = [f for f in files if f.step > 0]
    if not files:
        return []
    copied, exact = _legacy_layout(emakit, legacy)
    return [
        SnapshotInfo(
            path=f.path,
            step=f.step,
            t=legacy.t_of(f.step),
            gamma=profiles[f.path][0],
            sigma_rel=profiles[f.path][1],
            profile=f.profile,
            update_every=legacy.update_every,
            copied=copied,
            format_version=0,
            source=LEGACY_SOURCE,
            exact_dtypes=exact,
        )
        for f in files
    ]


def list_snapshots(
    folder: str | os.PathLike[str], *, legacy: LegacyProfiles | None = None
) -> list[SnapshotInfo]:
    """The snapshots in ``folder``, sorted by ``(step, gamma)``.

    ``*.safetensors`` files whose header says ``format = emakit.posthoc.snapshot`` count
    and, with ``legacy``, ema-pytorch's ``<profile index>.<step>.pt`` files (see
    [`LegacyProfiles`][emakit.posthoc.legacy.LegacyProfiles]; without it they are left out: [`list_legacy_files()`][emakit.posthoc.legacy.list_legacy_files]
    finds them). Anything else in the folder (other files, other safetensors files,
    emakit's temporary files) is ignored. A ``.safetensors`` file whose header cannot be
    read, or whose header is almost a snapshot's (a damaged ``format``), is skipped with a
    [`PostHocWarning`][emakit.posthoc.math.PostHocWarning]. Snapshots of every run are listed (see
    [`emakit.posthoc.runs`][emakit.posthoc.runs] to pick one).

    Args:
        folder: the snapshot folder.
        legacy: the profiles of ema-pytorch's files by index. Default None: leave them out.

    Returns:
        The snapshots' headers; empty if the folder holds none.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
        EMAStateError: a snapshot was written by a newer emakit, or a field of its header
            is malformed (naming the file and the field); an ema-pytorch file's profile
            index is out of range of ``legacy.gammas``.
    """
    root = existing_folder(folder)
    found: list[SnapshotInfo] = []
    shards: list[tuple[ShardEntry, SnapshotInfo]] = []
    seen: dict = {}  # side files checked
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith(".") or TEMP_PREFIX in name or not name.endswith(SNAPSHOT_SUFFIX):
            continue
        if is_side_file(name) or not path.is_file():
            continue
        try:
            f = SafetensorsFile(path, "snapshot")
        except EMAError as e:  # unreadable, a FIFO, or a file that vanished since the listing
            warnings.warn(f"skipping {path}: {e}", PostHocWarning, stacklevel=2)
            continue
        with f:
            meta = f.metadata
            ours = meta.get("format") in (SNAPSHOT_FORMAT, SHARD_FORMAT)
            why = side_missing(path, meta, seen) if ours else ""
            if why:
                warnings.warn(why, PostHocWarning, stacklevel=2)
                continue
            if meta.get("format") == SNAPSHOT_FORMAT:
                found.append(_parse(path, meta, f))  # a malformed field raises, never skips
            elif meta.get("format") == SHARD_FORMAT:
                shards.append(_shard_entry(path, meta, f))
            elif _looks_damaged(meta):
                warnings.warn(
                    f"skipping {path}: its header is almost a snapshot's but its format is "
                    f"{meta.get('format')!r}; the file is damaged",
                    PostHocWarning,
                    stacklevel=2,
                )
    by_path = {e.path: info for e, info in shards}
    for group in complete_sets(e for e, _ in shards):
        first, infos = by_path[group[0].path], [by_path[e.path] for e in group]
        found.append(
            dataclasses.replace(
                first,
                shards=tuple(e.path for e in group),
                frozen=tuple(p for i in infos for p in i.frozen),
                frozen_names=set_frozen_names(group, [i.frozen_names for i in infos]),
            )
        )
    found.sort(key=lambda s: (s.step, s.gamma, s.path.name))
    if legacy is not None:
        found.extend(_legacy_snapshots(root, found, legacy))
        found.sort(key=lambda s: (s.step, s.gamma, s.path.name))
    return found
