"""A snapshot folder: what it holds, which run wrote what, and one writer at a time.

* [`list_snapshots()`][emakit.posthoc.snapshots.folder.list_snapshots] reads the headers
  of every snapshot in a folder (emakit's, the complete sets of rank files of sharded
  snapshots, and, given their profiles, ema-pytorch's ``<index>.<step>.pt`` files, which
  [`list_legacy_files()`][emakit.posthoc.snapshots.folder.list_legacy_files] finds by
  name); [`find_snapshot_folder()`][emakit.posthoc.snapshots.folder.find_snapshot_folder]
  finds the folder itself inside a folder that holds one (``emakit demo`` writes its
  snapshots to ``OUT/posthoc-snapshots``, next to ``summary.json``).

**Runs.** Two experiments that share a snapshot folder (the default folder name, a
copy-pasted config) would otherwise be mixed at synthesis without a word, and the result
is garbage. So:

* Each [`PostHocEMA`][emakit.PostHocEMA] run has an id (`new_run_id()`, or the ``run_id=``
  it was given), written into every snapshot header (``run``) and kept in its
  ``state_dict()``, so a resumed run keeps writing under its id.
* While a run writes, it holds an exclusive lock on the folder ([`FolderLock`][emakit.posthoc.snapshots.folder.FolderLock], a
  ``flock`` on ``.emakit-posthoc.lock``, removed when released): a second run writing to
  the same folder at the same time is refused. The lock dies with the process (a killed
  run leaves the file, unlocked); where the file system has no locks the run ids still
  keep runs apart.
* Synthesis and ``emakit inspect`` refuse a folder holding more than one run unless the
  caller picks one ([`pick_run()`][emakit.posthoc.snapshots.folder.pick_run]);
  `PostHocEMA.synthesize_ema_model()` picks its own run.

Snapshots written before emakit recorded run ids have the run ``""`` (shown as
``(none)``): pick them with ``run=""``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._files.atomic import TEMP_PREFIX, lock_entry
from ..._files.reading import as_path, parse_json
from ..._files.safetensors_file import SafetensorsFile, near_format
from ...errors import (
    EMAError,
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)
from ..math import PostHocWarning
from .format import (
    RUN_PATTERN,
    SNAPSHOT_FORMAT,
    SNAPSHOT_SUFFIX,
    SnapshotInfo,
    looks_damaged,
    parse_header,
)
from .frozen import frozen_ref, is_side_file, join_frozen, side_missing
from .legacy import LEGACY_NAME, LEGACY_SOURCE, LegacyFile, LegacyProfiles
from .shards import (
    SHARD_FORMAT,
    ShardEntry,
    complete_sets,
    parse_layout,
    set_frozen_names,
    shard_fields,
    shard_suffix,
)

__all__ = [
    "LOCK_NAME",
    "FolderLock",
    "check_output",
    "check_run_id",
    "collect_frozen_files",
    "describe_runs",
    "existing_folder",
    "find_snapshot_folder",
    "first_write_warnings",
    "list_legacy_files",
    "list_snapshots",
    "new_run_id",
    "own_path",
    "pick_run",
    "runs_in",
    "skipped_files",
]

#: The lock file a writing run holds in its snapshot folder.
LOCK_NAME = ".emakit-posthoc.lock"


def existing_folder(folder: object) -> Path:
    """``folder`` if it is an existing folder, or an error saying what it is.

    Raises:
        EMAFileNotFoundError: it does not exist.
        EMAValueError: it is not a folder.
    """
    root = as_path("folder", folder)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        error = EMAValueError if root.exists() else EMAFileNotFoundError
        raise error(
            f"snapshot folder {str(root)!r} {what}; pass the checkpoint_folder that "
            f"PostHocEMA wrote its snapshots to"
        )
    return root


# -- what a folder holds ----------------------------------------------------------------------


def list_legacy_files(folder: str | os.PathLike[str]) -> list[LegacyFile]:
    """ema-pytorch's snapshot files (``<profile index>.<step>.pt``) in ``folder``, by
    ``(step, profile)``; found by name, nothing is read.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
    """
    found = []
    for path in existing_folder(folder).iterdir():
        m = LEGACY_NAME.match(path.name)
        if m and path.is_file():
            found.append(LegacyFile(path, int(m.group(1)), int(m.group(2))))
    found.sort(key=lambda f: (f.step, f.profile, f.path.name))
    return found


def _shard_entry(
    path: Path, meta: Mapping[str, str], f: SafetensorsFile
) -> tuple[ShardEntry, SnapshotInfo]:
    """One rank's file of a sharded snapshot: its set, rank and stored volumes."""
    info = parse_header(path, meta, f)
    rank, world = shard_fields(path, meta)
    with join_frozen(f) as g:  # the blocks of its frozen tensors are in its side file
        layout = parse_layout(path, meta, {n: g.shape(n) for n in g.keys()})  # noqa: SIM118
    volumes = {n: (shape, 0 if b is None else b.numel) for n, (shape, b) in layout.items()}
    write = meta.get("shard_set", "")  # one write's files only: never two writes' mixed
    key = (info.step, info.t, info.gamma, info.sigma_rel, info.profile, info.run, info.copied)
    return ShardEntry((*key, write), rank, world, path, volumes), info


def _legacy_snapshots(
    root: Path, emakit: list[SnapshotInfo], legacy: LegacyProfiles
) -> list[SnapshotInfo]:
    """ema-pytorch's files as snapshots of ``legacy``'s profiles; the tensors they copy
    and the exact dtypes of integer ones from ``legacy``, else from the folder's latest
    emakit snapshot."""
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
    copied, exact = legacy.copied, legacy.exact_dtypes
    if copied is None:  # the folder's own snapshots know the model, if it has any
        copied, exact = frozenset(), ()
        if emakit:
            ref = max(emakit, key=lambda s: (s.step, s.gamma, s.path.name))
            with SafetensorsFile(ref.path, "snapshot") as f:
                dtypes = {n: f.dtype(n) for n in sorted(ref.copied & set(f.keys()))}
            copied = ref.copied
            exact = tuple(
                (n, d) for n, d in dtypes.items() if not (d.is_floating_point or d.is_complex)
            )
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


def _read_folder(
    root: Path,
) -> tuple[list[SnapshotInfo], list[tuple[ShardEntry, SnapshotInfo]], list[str]]:
    """The headers of the folder's snapshot files: ``(whole-model snapshots, rank files,
    why each skipped file was skipped)``."""
    found: list[SnapshotInfo] = []
    shards: list[tuple[ShardEntry, SnapshotInfo]] = []
    skipped: list[str] = []
    seen: dict = {}  # side files checked
    for path in sorted(root.iterdir()):  # not emakit's temporary files (".<name>.emakit-tmp-...")
        name = path.name
        if name.startswith(".") or not name.endswith(SNAPSHOT_SUFFIX) or is_side_file(name):
            continue
        if not path.is_file():
            continue
        try:
            f = SafetensorsFile(path, "snapshot")
        except EMAError as e:  # unreadable, a FIFO, or a file that vanished since the listing
            skipped.append(f"skipping {path}: {e}")
            continue
        with f:
            meta = f.metadata
            kind = meta.get("format")
            why = side_missing(path, meta, seen) if kind in (SNAPSHOT_FORMAT, SHARD_FORMAT) else ""
            if why:
                skipped.append(why)
            elif kind == SNAPSHOT_FORMAT:
                found.append(parse_header(path, meta, f))  # a malformed field raises
            elif kind == SHARD_FORMAT:
                shards.append(_shard_entry(path, meta, f))
            elif looks_damaged(meta):
                skipped.append(
                    f"skipping {path}: its header is almost a snapshot's but its format is "
                    f"{kind!r}; the file is damaged"
                )
    return found, shards, skipped


def skipped_files(folder: str | os.PathLike[str]) -> list[str]:
    """Why [`list_snapshots()`][emakit.posthoc.snapshots.folder.list_snapshots] skips
    files of ``folder``, one line per file, each naming it (and, for a snapshot whose side
    file is missing or damaged, the side file); empty when it skips none. What an error
    for a folder without usable snapshots says.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
    """
    try:
        return _read_folder(existing_folder(folder))[2]
    except EMAStateError as e:  # a malformed header: that is why
        return [str(e)]


def list_snapshots(
    folder: str | os.PathLike[str], *, legacy: LegacyProfiles | None = None
) -> list[SnapshotInfo]:
    """The snapshots in ``folder``, sorted by ``(step, gamma)``.

    ``*.safetensors`` files whose header says ``format = emakit.posthoc.snapshot`` count
    (and the complete sets of rank files of sharded snapshots) and, with ``legacy``,
    ema-pytorch's ``<profile index>.<step>.pt`` files (see
    [`LegacyProfiles`][emakit.posthoc.snapshots.legacy.LegacyProfiles]; without it they are left out: [`list_legacy_files()`][emakit.posthoc.snapshots.folder.list_legacy_files]
    finds them). Anything else in the folder (other files, other safetensors files,
    emakit's temporary files) is ignored. A ``.safetensors`` file whose header cannot be
    read, or whose header is almost a snapshot's (a damaged ``format``), is skipped with a
    [`PostHocWarning`][emakit.posthoc.math.PostHocWarning]. Snapshots of every run are
    listed (`pick_run()` picks one).

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
    found, shards, skipped = _read_folder(root)
    for why in skipped:
        warnings.warn(why, PostHocWarning, stacklevel=2)
    by_path = {e.path: info for e, info in shards}
    for group in complete_sets(e for e, _ in shards):
        infos = [by_path[e.path] for e in group]
        found.append(
            dataclasses.replace(
                infos[0],
                shards=tuple(e.path for e in group),
                frozen=tuple(p for i in infos for p in i.frozen),
                frozen_names=set_frozen_names(group, [i.frozen_names for i in infos]),
            )
        )
    if legacy is not None:
        found.extend(_legacy_snapshots(root, found, legacy))
    return sorted(found, key=lambda s: (s.step, s.gamma, s.path.name))


def find_snapshot_folder(folder: str | os.PathLike[str]) -> Path:
    """The folder that holds the snapshots: ``folder`` itself if it holds any (or is not a
    folder: the caller's own checks then report it), else its one subfolder that does.

    Args:
        folder: a snapshot folder, or a folder with one snapshot subfolder (a demo run's).

    Returns:
        ``folder``, or that subfolder.

    Raises:
        EMAValueError: ``folder`` holds no snapshots and several subfolders do (the
            message lists them).

    Example:
        >>> find_snapshot_folder("emakit-demo-20240101-120000")  # doctest: +SKIP
        PosixPath('emakit-demo-20240101-120000/posthoc-snapshots')
    """

    def holds(p: Path) -> bool:
        return bool(list_snapshots(p) or list_legacy_files(p))

    folder = Path(folder)
    if not folder.is_dir() or holds(folder):
        return folder
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and holds(p))
    if len(subs) > 1:
        raise EMAValueError(
            f"{str(folder)!r} holds no post-hoc snapshots itself, but {len(subs)} of its "
            f"subfolders do ({', '.join(repr(str(p)) for p in subs[:5])}); pass one of them"
        )
    return subs[0] if subs else folder


# -- the files snapshots are made of ----------------------------------------------------------

#: The header entries that name a snapshot's side file.
_FROZEN_KEYS = ("frozen_file", "frozen_digest", "frozen_names")


def _references(files: Sequence[Path]) -> tuple[set[str], list[Path], list[Path]]:
    """What the ``.safetensors`` files among ``files`` (side files and emakit's in-flight
    temporaries left out) say about side files: ``(the names of the side files they refer
    to, the snapshot and rank files, the files whose references cannot be known)``.

    A file's references cannot be known when its header cannot be read, is almost a
    snapshot's (`looks_damaged()`), or is a snapshot's whose side-file entries are
    malformed, partly missing or misspelled (a key one or two characters off): such a
    file may be a damaged snapshot referring to any side file.
    """
    refs: set[str] = set()
    snapshots: list[Path] = []
    unknown: list[Path] = []
    for p in files:
        name = p.name
        if not name.endswith(SNAPSHOT_SUFFIX) or TEMP_PREFIX in name or is_side_file(name):
            continue
        try:
            with SafetensorsFile(p, "snapshot") as f:
                meta = f.metadata
        except (EMAError, OSError):
            unknown.append(p)
            continue
        if meta.get("format") not in (SNAPSHOT_FORMAT, SHARD_FORMAT):
            if looks_damaged(meta):
                unknown.append(p)
            continue
        snapshots.append(p)
        present = [k for k in _FROZEN_KEYS if k in meta]
        misspelt = [
            k
            for k in meta
            if k not in _FROZEN_KEYS and any(near_format(k, f) for f in _FROZEN_KEYS)
        ]
        try:
            ref = frozen_ref(p, meta)
        except EMAStateError:
            ref = None
        if misspelt or (present and (ref is None or len(present) < len(_FROZEN_KEYS))):
            unknown.append(p)
        elif ref is not None:
            refs.add(ref.file.name)
    return refs, snapshots, unknown


def _check_shard(shard: object) -> tuple[int, int] | None:
    if shard is None:
        return None
    ok = (
        isinstance(shard, tuple)
        and len(shard) == 2
        and all(type(x) is int for x in shard)
        and 0 <= shard[0] < shard[1]
    )
    if not ok:
        raise EMAValueError(
            f"shard must be None or (rank, world) with 0 <= rank < world, got {shard=!r}"
        )
    return shard  # type: ignore[return-value]


def collect_frozen_files(
    folder: str | os.PathLike[str], run: str | None = None, shard: tuple[int, int] | None = None
) -> list[Path]:
    """Remove the side files in ``folder`` that no file there refers to any more.

    Only side files are ever removed: the run's (every run's when ``run`` is None), and
    with ``shard=(rank, world)`` only that rank's (each rank collects its own). A file that
    any ``.safetensors`` file in the folder refers to (a snapshot of any run, complete or
    not) is kept. The rule is conservative: when a ``.safetensors`` file in the folder may
    be a snapshot but its references cannot be read (its header is unreadable or damaged,
    or its side-file entries are malformed), it may refer to any side file, so **none is
    removed** (a [`PostHocWarning`][emakit.posthoc.math.PostHocWarning] names it, when that
    keeps a file); move the damaged file out of the folder to collect again. A file that
    cannot be removed is left. The writer calls this after each snapshot.

    Args:
        folder: the snapshot folder (it must exist).
        run: the run whose side files may be removed (a run id: letters, digits, ``.``,
            ``_``, ``-``). Default None: every run's.
        shard: ``(rank, world)``: only that rank's side files. Default None: the side
            files of whole-model snapshots (``run`` given), or all (``run`` None).

    Returns:
        The files removed.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder; ``run`` is not a run id (a path such as
            ``"../x"``); ``shard`` is not ``(rank, world)``.
        EMATypeError: ``folder`` is not a path, or ``run`` is not a str.
    """
    root = existing_folder(folder)
    if run is not None:
        check_run_id("run", run)
    part = _check_shard(shard)
    ending = f".run-{run}{'' if part is None else shard_suffix(*part)}.safetensors"
    try:
        files = sorted(root.iterdir())
    except OSError:
        return []
    candidates = [
        p for p in files if is_side_file(p.name) and (run is None or p.name.endswith(ending))
    ]
    if not candidates:  # no side file: no header read
        return []
    refs, _, unknown = _references(files)
    unused = [p for p in candidates if p.name not in refs]
    if unknown and unused:
        warnings.warn(
            f"kept {len(unused)} frozen weights file(s) that no readable snapshot refers to "
            f"({unused[0].name}{', ...' if len(unused) > 1 else ''}): "
            f"{', '.join(str(p) for p in unknown[:3])}{' ...' if len(unknown) > 3 else ''} "
            f"may be a damaged snapshot referring to them (its header cannot be read); move "
            f"it out of the folder, then call emakit.posthoc.collect_frozen_files",
            PostHocWarning,
            stacklevel=2,
        )
        return []
    removed = []
    for p in unused:
        with contextlib.suppress(OSError):
            p.unlink()
            removed.append(p)
    return removed


def _inode(path: Path) -> object:
    """What names the file at ``path`` (through links too): its device and inode, or the
    absolute path when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.abspath(path)
    return st.st_dev, st.st_ino


def check_output(name: str, path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> None:
    """Refuse an output path that is, or links to (a symlink, a hard link), a file the
    snapshots of ``folder`` are made of: a snapshot or rank file of any run, readable or
    not (a damaged one), a side file (referred to or not, or named by a snapshot and
    missing), an ema-pytorch snapshot file. Writing there would destroy snapshots.

    Args:
        name: the argument's name, for the message (``"--out"``, ``"plot"``).
        path: the output path.
        folder: the snapshot folder (nothing is checked when it is not a folder).

    Raises:
        EMAValueError: ``path`` is such a file (naming it).
    """
    root = Path(folder)
    if not root.is_dir():
        return
    files = sorted(root.iterdir())
    refs, snapshots, unknown = _references(files)
    inputs = [*snapshots, *unknown, *(root / r for r in refs)]
    inputs += [p for p in files if is_side_file(p.name)] + [f.path for f in list_legacy_files(root)]
    given = {_inode(p): p for p in inputs}
    same = given.get(_inode(Path(path)))
    if same is not None:
        raise EMAValueError(
            f"{name} {os.fspath(path)} is {same}, a file of the input snapshots in "
            f"{str(root)!r}: emakit never overwrites the snapshots or their side files; "
            f"name the output differently"
        )


# -- runs ---------------------------------------------------------------------------------------


def new_run_id() -> str:
    """A fresh run id: 16 random hex digits."""
    return uuid.uuid4().hex[:16]


def check_run_id(name: str, value: object) -> str:
    """``value`` if it is a valid run id (1 to 64 letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or digit), or an error naming the argument ``name``."""
    if not isinstance(value, str):
        raise EMATypeError(f"{name} must be a str, got {name}={value!r} ({type(value).__name__})")
    if not RUN_PATTERN.match(value):
        raise EMAValueError(
            f"{name} must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter "
            f"or digit), got {name}={value!r}"
        )
    return value


def runs_in(snaps: Sequence[SnapshotInfo]) -> dict[str, list[SnapshotInfo]]:
    """emakit's snapshots by run id (``""``: written before run ids), in order of first
    step; ema-pytorch's files belong to no run and are left out."""
    runs: dict[str, list[SnapshotInfo]] = {}
    for s in sorted(snaps, key=lambda s: (s.step, s.path.name)):
        if not s.is_legacy:
            runs.setdefault(s.run, []).append(s)
    return runs


def describe_runs(runs: dict[str, list[SnapshotInfo]]) -> str:
    """One line per run: id, snapshot count, steps."""
    return "; ".join(
        f"{run or '(none)'}: {len(snaps)} snapshot(s), steps {snaps[0].step}..{snaps[-1].step}"
        for run, snaps in runs.items()
    )


def pick_run(
    snaps: Sequence[SnapshotInfo], run: str | None, folder: str | os.PathLike[str]
) -> list[SnapshotInfo]:
    """The snapshots of one run (and any ema-pytorch files), or an error for a mixed folder.

    Args:
        snaps: the folder's snapshots ([`list_snapshots()`][emakit.posthoc.snapshots.folder.list_snapshots]).
        run: the run to keep; ``""`` keeps the snapshots written before run ids. Default
            None: the folder must hold at most one run.
        folder: the folder, for messages.

    Raises:
        EMAStateError: ``run`` is None and the folder holds more than one run.
        EMAValueError: ``run`` has no snapshots in the folder.
    """
    runs = runs_in(snaps)
    if run is None:
        if len(runs) > 1:
            raise EMAStateError(
                f"{os.fspath(folder)!r} holds the snapshots of {len(runs)} runs "
                f"({describe_runs(runs)}); synthesizing from a mix of runs gives wrong "
                f"weights. Pick one: run=<id> (emakit synthesize/inspect --run ID), or move "
                f"the other runs' files out of the folder"
            )
        return list(snaps)
    if not isinstance(run, str):
        raise EMATypeError(f"run must be a str or None, got run={run!r} ({type(run).__name__})")
    if run not in runs:
        raise EMAValueError(
            f"run={run!r} has no snapshots in {os.fspath(folder)!r}; the runs there are: "
            f"{describe_runs(runs) or 'none'}"
        )
    return [s for s in snaps if s.is_legacy or s.run == run]


def first_write_warnings(folder: Path, run: str, step: int) -> list[str]:
    """What a run should be told before its first write into ``folder`` at ``step``:
    other runs' snapshots there, and its own (or ema-pytorch's) after ``step``, left by a
    run that was resumed from an earlier state."""
    out = []
    snaps = list_snapshots(folder)
    others = {r: v for r, v in runs_in(snaps).items() if r != run}
    if others:
        out.append(
            f"{str(folder)!r} already holds the snapshots of other run(s) "
            f"({describe_runs(others)}); this run ({run!r}) writes its own next to them "
            f"(named ..._run-{run}.safetensors where steps and profiles coincide: theirs are "
            f"kept), and synthesis from the folder must pick a run (run=..., emakit "
            f"synthesize --run). Give each experiment its own checkpoint_folder"
        )
    later = [s.step for s in snaps if s.run == run and s.step > step]
    theirs = [f for f in list_legacy_files(folder) if f.step > step]
    if later or theirs:
        kept = (
            f" (not ema-pytorch's {len(theirs)} file(s) like {theirs[0].path.name}: remove them)"
            if theirs
            else ""
        )
        out.append(
            f"{str(folder)!r} already holds {len(later) + len(theirs)} snapshot(s) after step "
            f"{step} (up to step {max(later + [f.step for f in theirs])}), from before a "
            f"resume. Snapshots of this run overwrite them as training passes their "
            f"steps{kept}; synthesis at or before step {step} ignores them"
        )
    return out


def own_path(path: Path, run: str) -> Path:
    """Where run ``run`` writes the snapshot named ``path``: ``path`` itself, unless a file
    another run wrote (or an unreadable one) has that name; then ``path`` with
    ``_run-<run>`` before the suffix, so two experiments in one folder never replace each
    other's snapshots."""
    if not os.path.lexists(path):
        return path
    # a whole-model snapshot, or one rank's file of a sharded one; unreadable: not ours
    with contextlib.suppress(EMAError), SafetensorsFile(path, "snapshot file") as f:
        meta = f.metadata
        if meta.get("format") in (SNAPSHOT_FORMAT, SHARD_FORMAT) and meta.get("run", "") == run:
            return path
    return path.with_name(f"{path.name[: -len(SNAPSHOT_SUFFIX)]}_run-{run}{SNAPSHOT_SUFFIX}")


# -- the folder lock --------------------------------------------------------------------------

_held: dict[str, tuple[int, str, int]] = {}  # folder -> (fd, run, holders) in this process
_held_lock = threading.Lock()


def _release(key: str) -> None:
    with _held_lock:
        entry = _held.get(key)
        if entry is None:
            return
        fd, run, holders = entry
        if holders > 1:
            _held[key] = (fd, run, holders - 1)
            return
        del _held[key]
        # Removed while still locked: a run that opened it meanwhile sees, once it holds
        # the lock, that the name points elsewhere (or nowhere), and opens it again.
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(key, LOCK_NAME))
    os.close(fd)  # the flock goes with the descriptor


class FolderLock:
    """An exclusive lock on a snapshot folder, held by one run while it writes.

    Objects of one run in one process share the lock; another run, in this process or
    another, is refused while it is held. The lock is released by [`release()`][emakit.posthoc.snapshots.folder.FolderLock.release], when
    this object is garbage-collected, or when the process ends (killed too). A copy or an
    unpickled object holds nothing until it locks again.

    Args:
        folder: the snapshot folder (it must exist).
        run: the run id taking the lock.

    Raises:
        EMARuntimeError: another run holds the folder (the message names it, its process
            and host, and the fix).
    """

    def __init__(self, folder: str | os.PathLike[str], run: str) -> None:
        self.folder = Path(folder)
        self.run = run
        self.locked = False
        self._finalizer: weakref.finalize | None = None
        key = os.path.realpath(self.folder)
        with _held_lock:
            entry = _held.get(key)
            if entry is not None:
                fd, holder, holders = entry
                if holder != run:
                    raise self._busy(f"run {holder!r} of this process")
                _held[key] = (fd, run, holders + 1)
            else:
                try:  # the lock file is created if missing
                    locked = lock_entry(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
                except BlockingIOError:
                    raise self._busy(self._holder()) from None
                if locked is None:  # no locks here: run ids keep runs apart
                    return
                info = {"run": run, "pid": os.getpid(), "host": socket.gethostname()}
                with contextlib.suppress(OSError):
                    os.ftruncate(locked, 0)
                    os.pwrite(locked, json.dumps(info).encode(), 0)
                _held[key] = (locked, run, 1)
            self.locked = True
            self._finalizer = weakref.finalize(self, _release, key)

    def _holder(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            info = parse_json((self.folder / LOCK_NAME).read_text(encoding="utf-8"))
            return f"run {info.get('run')!r} (process {info.get('pid')} on {info.get('host')!r})"
        return "another run"

    def _busy(self, holder: str) -> EMARuntimeError:
        return EMARuntimeError(
            f"snapshot folder {str(self.folder)!r} is being written by {holder}; run "
            f"{self.run!r} may not write there too (two runs in one folder mix their "
            f"snapshots): give this PostHocEMA another checkpoint_folder, or wait for that "
            f"run to end"
        )

    def release(self) -> None:
        """Release the lock (this object's share of it); a no-op when not held."""
        if self._finalizer is not None:
            self._finalizer()  # once: a finalizer runs at most once
        self.locked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "run": self.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self.run = state["folder"], state["run"]
        self.locked, self._finalizer = False, None
