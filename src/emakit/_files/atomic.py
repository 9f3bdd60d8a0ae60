"""Atomic file writes: a crash mid-write leaves the previous file whole.

Every file emakit writes goes through [`atomic_path()`][emakit._files.atomic.atomic_path] (or [`atomic_write()`][emakit._files.atomic.atomic_write], built
on it): the bytes go to a temporary file in the destination's folder, are flushed and
fsynced, and the temporary file is then renamed over the destination (``os.replace``,
atomic on POSIX and Windows). The folder is fsynced too where the platform allows, so the
rename itself survives a power cut. Readers therefore see either the previous file or the
new one, never a mix.

Temporary files are named ``.<name>.emakit-tmp-XXXXXXXX``. A write that fails with an
exception removes its own. A process killed mid-write (SIGKILL, OOM killer, power cut)
runs no cleanup, so it leaves at most one temporary file per write in flight. Such
leftovers are removed by the next successful write into the same folder: each writer holds
an exclusive ``flock`` on its temporary file while writing, the lock dies with the process,
and a temporary file nobody holds a lock on is stale. Where locks are not available
(Windows, some network file systems) a leftover is removed once it is older than
`STALE_TEMP_AGE_S`.

The new file keeps the permission bits of the file it replaces; a new file gets the usual
``0o666 & ~umask`` (not ``tempfile``'s private ``0o600``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

#: Whether this platform has advisory file locks (``fcntl.flock``).
LOCKS_AVAILABLE = fcntl is not None


#: Marker in the names of emakit's temporary files (``.<name>.emakit-tmp-XXXXXXXX``).
TEMP_PREFIX = ".emakit-tmp-"

#: Age in seconds after which an unlockable-to-test temporary file counts as stale.
STALE_TEMP_AGE_S = 3600.0

# Longest part of the destination name kept in a temporary name, so that a destination
# whose name is near the 255-byte limit still gets a valid temporary name.
_MAX_STEM = 100

# Temporary files this process is writing right now. Guards against deleting a live one
# where locks are per process (POSIX fcntl locks, e.g. flock emulated over NFS).
_live: set[str] = set()
_live_lock = threading.Lock()


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename in it) to disk; a no-op where unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def try_lock(fd: int) -> bool | None:
    """Try an exclusive non-blocking lock: True held, False busy, None not supported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _make_temp(dest: Path) -> tuple[int, Path]:
    """Create and lock a temporary file next to ``dest``.

    Returns ``(fd, path)``: ``fd`` holds the lock until closed, or is -1 where locks are
    not supported.
    """
    prefix = f".{dest.name[:_MAX_STEM]}{TEMP_PREFIX}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        name = os.path.join(dest.parent, prefix + secrets.token_hex(4))
        try:  # 0o666: the umask applies, as to any new file (not tempfile's private 0o600)
            fd = os.open(name, flags, 0o666)
        except FileExistsError:
            continue
        with _live_lock:
            _live.add(name)
        # A cleaner in another process may lock and delete the file between its creation and
        # our lock; then the name no longer points at our file, and we start over.
        locked = try_lock(fd)
        try:
            ours = locked is not False and os.path.samestat(os.fstat(fd), os.stat(name))
        except OSError:
            ours = False
        if ours:
            if locked is None:
                # Nothing to hold open for; Windows also cannot rename an open file.
                os.close(fd)
                fd = -1
            return fd, Path(name)
        os.close(fd)
        with _live_lock:
            _live.discard(name)
    raise OSError(f"could not create a temporary file next to {dest}")  # pragma: no cover


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete emakit temporary files in ``folder`` that no live write owns.

    A temporary file is stale when no process holds its lock (the writer was killed), or,
    where locks cannot be tested, when it is older than `STALE_TEMP_AGE_S`. Called
    after every successful atomic write; never raises.

    Args:
        folder: the folder to clean.

    Returns:
        The paths removed.
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        with contextlib.suppress(OSError):
            ours = entry.name.startswith(".") and TEMP_PREFIX in entry.name
            if not ours or not entry.is_file(follow_symlinks=False):
                continue
            with _live_lock:
                if entry.path in _live:
                    continue
            fd = os.open(entry.path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
            try:
                locked = try_lock(fd)
                stale = locked is True or (
                    locked is None and now - os.fstat(fd).st_mtime > STALE_TEMP_AGE_S
                )
                if stale:
                    os.unlink(entry.path)  # while holding the lock: no writer can own it
                    removed.append(Path(entry.path))
            finally:
                os.close(fd)
    return removed


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    Use it with writers that want a file name (``torch.save``, ``matplotlib``'s
    ``savefig``). The writer must write to the yielded path in place (open it for
    writing); if the block raises, ``path`` is left as it was and the temporary file is
    removed.

    Args:
        path: the destination. Its folder is created if missing.

    Yields:
        The temporary path to write.

    Example:
        >>> import tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> with atomic_path(f"{folder}/w.pt") as tmp:
        ...     torch.save({"w": torch.zeros(2)}, tmp)
    """
    with atomic_paths([path]) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(
    paths: Sequence[str | os.PathLike[str]], *, before_replace: Callable[[], None] | None = None
) -> Iterator[list[Path]]:
    """Like [`atomic_path()`][emakit._files.atomic.atomic_path] for several files that must appear together (all or none).

    The block writes every temporary path; only when it completes is each one fsynced and
    then renamed over its destination, in order. If the block raises (a failed or
    interrupted write, a full disk), no destination is touched and every temporary file
    is removed. Only a crash *between* two renames, after every file is complete on disk,
    can leave some destinations replaced and others not.

    Args:
        paths: the destinations, all different. Their folders are created if missing.
        before_replace: keyword-only; called once every file is complete and fsynced,
            right before the first rename (default None: nothing). If it raises, nothing
            is replaced and the temporary files are removed, as when the block raises: the
            last word of a write that several processes make together (every rank's
            files of a sharded snapshot replace the old ones only if every rank wrote).

    Yields:
        The temporary paths to write, in the order of ``paths``.
    """
    dests = [Path(p) for p in paths]
    if len({os.path.abspath(d) for d in dests}) != len(dests):
        raise ValueError(f"atomic_paths needs different destinations, got {dests}")
    made: list[tuple[int, Path]] = []
    try:
        for dest in dests:
            dest.parent.mkdir(parents=True, exist_ok=True)
            made.append(_make_temp(dest))
        yield [tmp for _, tmp in made]
        for (_, tmp), dest in zip(made, dests, strict=True):
            # Reopen by name: the writer may have replaced the inode we created.
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            # The replaced file's mode (a new file keeps the umask's), only now: a read-only
            # mode set earlier would stop the writer from opening it.
            with contextlib.suppress(OSError):
                os.chmod(tmp, dest.stat().st_mode & 0o777)
        if before_replace is not None:
            before_replace()
        for (_, tmp), dest in zip(made, dests, strict=True):
            os.replace(tmp, dest)
        for folder in {d.parent for d in dests}:
            fsync_dir(folder)
    finally:
        for fd, tmp in made:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            if fd >= 0:
                os.close(fd)  # releases the lock only once the temporary file is gone
            with _live_lock:
                _live.discard(str(tmp))
    for folder in {d.parent for d in dests}:
        remove_stale_temps(folder)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``path`` atomically by calling ``write(file_object)`` on a temporary file.

    Args:
        path: the destination.
        write: called once with a binary file object opened for writing (seekable); what
            it returns is ignored.

    Returns:
        ``path`` as a `Path`.

    Example:
        >>> import tempfile, torch
        >>> folder = tempfile.mkdtemp()
        >>> _ = atomic_write(f"{folder}/w.pt", lambda f: torch.save(torch.zeros(2), f))
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        write(f)
        f.flush()
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see [`atomic_write()`][emakit._files.atomic.atomic_write])."""

    return atomic_write(path, lambda f: f.write(data))
