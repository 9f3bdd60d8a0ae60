"""Runs in a snapshot folder: who wrote which snapshots, one writer at a time.

Two experiments that share a snapshot folder (the default folder name, a copy-pasted
config) would otherwise be mixed at synthesis without a word, and the result is garbage.
So:

* Each [`PostHocEMA`][emakit.PostHocEMA] run has an id (`new_run_id()`, or the ``run_id=``
  it was given), written into every snapshot header (``run``) and kept in its
  ``state_dict()``, so a resumed run keeps writing under its id.
* While a run writes, it holds an exclusive lock on the folder ([`FolderLock`][emakit.posthoc.runs.FolderLock], a
  ``flock`` on ``.emakit-posthoc.lock``, removed when released): a second run writing to
  the same folder at the same time is refused. The lock dies with the process (a killed
  run leaves the file, unlocked); where the file system has no locks the run ids still
  keep runs apart.
* Synthesis and ``emakit inspect`` refuse a folder holding more than one run unless the
  caller picks one ([`pick_run()`][emakit.posthoc.runs.pick_run]); `synthesize_ema_model()`
  picks its own run.

Snapshots written before emakit recorded run ids have the run ``""`` (shown as
``(none)``): pick them with ``run=""``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._files.atomic import LOCKS_AVAILABLE, try_lock
from .._files.safetensors_file import SafetensorsFile
from ..errors import EMAError, EMARuntimeError, EMAStateError, EMATypeError, EMAValueError
from .shards import SHARD_FORMAT
from .snapshots import (
    RUN_PATTERN,
    SNAPSHOT_FORMAT,
    SNAPSHOT_SUFFIX,
    SnapshotInfo,
    list_legacy_files,
    list_snapshots,
)

__all__ = [
    "LOCK_NAME",
    "FolderLock",
    "check_run_id",
    "describe_runs",
    "first_write_warnings",
    "new_run_id",
    "own_path",
    "pick_run",
    "run_to_continue",
    "runs_in",
]

#: The lock file a writing run holds in its snapshot folder.
LOCK_NAME = ".emakit-posthoc.lock"


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
        snaps: the folder's snapshots ([`list_snapshots()`][emakit.posthoc.snapshots.list_snapshots]).
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


def run_to_continue(folder: Path, own: str) -> str | None:
    """The run a resumed [`PostHocEMA`][emakit.PostHocEMA] whose state records no run id
    continues: the folder's only identified run, when it is not ``own`` already."""
    runs = [r for r in runs_in(list_snapshots(folder)) if r]
    return runs[0] if len(runs) == 1 and runs[0] != own else None


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


def _lock_file(path: Path) -> int | None:
    """A descriptor holding the flock of ``path`` (created if missing), None where the
    file system has no locks; raises BlockingIOError while another process holds it."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        held = try_lock(fd)
        if held is False:
            os.close(fd)
            raise BlockingIOError(f"{path} is locked")
        if held is None:  # a file system without locks
            os.close(fd)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed it as we opened it: take the new one
    raise EMARuntimeError(f"could not lock {path}")  # pragma: no cover


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(path.read_text(encoding="utf-8"))
        return f"run {info.get('run')!r} (process {info.get('pid')} on {info.get('host')!r})"
    return "another run"


class FolderLock:
    """An exclusive lock on a snapshot folder, held by one run while it writes.

    Objects of one run in one process share the lock; another run, in this process or
    another, is refused while it is held. The lock is released by [`release()`][emakit.posthoc.runs.FolderLock.release], when
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
        self._acquire()

    def _acquire(self) -> None:
        key = os.path.realpath(self.folder)
        path = self.folder / LOCK_NAME
        with _held_lock:
            entry = _held.get(key)
            if entry is not None:
                fd, run, holders = entry
                if run != self.run:
                    raise self._busy(f"run {run!r} of this process")
                _held[key] = (fd, run, holders + 1)
                self._hold(key)
                return
            if not LOCKS_AVAILABLE:
                return  # no locks on this platform: run ids still keep runs apart
            try:
                locked = _lock_file(path)
            except BlockingIOError:
                raise self._busy(_holder(path)) from None
            if locked is None:
                return
            fd = locked
            info = {"run": self.run, "pid": os.getpid(), "host": socket.gethostname()}
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
            _held[key] = (fd, self.run, 1)
            self._hold(key)

    def _hold(self, key: str) -> None:
        self.locked = True
        self._finalizer = weakref.finalize(self, _release, key)

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
            self._finalizer()
            self._finalizer = None
        self.locked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "run": self.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self.run = state["folder"], state["run"]
        self.locked, self._finalizer = False, None

    def __deepcopy__(self, memo: dict[int, Any]) -> FolderLock:
        copy = FolderLock.__new__(FolderLock)
        copy.__setstate__(self.__getstate__())
        return copy


def _run_of(path: Path) -> str:
    """The run id in the header of a snapshot: a whole-model one or one rank's file of a
    sharded one (whose rewrite of a step must replace the rank's own file)."""
    with SafetensorsFile(path, "snapshot file") as f:
        meta = f.metadata
    if meta.get("format") not in (SNAPSHOT_FORMAT, SHARD_FORMAT):
        raise EMAStateError(f"{path} is not an emakit post-hoc snapshot")
    return meta.get("run", "")


def own_path(path: Path, run: str) -> Path:
    """Where run ``run`` writes the snapshot named ``path``: ``path`` itself, unless a file
    another run wrote (or an unreadable one) has that name; then ``path`` with
    ``_run-<run>`` before the suffix, so two experiments in one folder never replace each
    other's snapshots."""
    if not os.path.lexists(path):
        return path
    try:
        theirs = _run_of(path) != run
    except EMAError:
        theirs = True  # unreadable: not ours to replace either
    if not theirs:
        return path
    return path.with_name(f"{path.name[: -len(SNAPSHOT_SUFFIX)]}_run-{run}{SNAPSHOT_SUFFIX}")
