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

A whole folder is replaced with [`atomic_folder()`][emakit._files.atomic.atomic_folder]:
the block fills a staging folder ``.<name>.emakit-dir-XXXXXXXX`` beside it, which then
takes the place of the old folder in one step (an exchange of the two folders), so a reader
sees the old folder or the new one, never a mix. Its leftovers are locked and cleaned like
temporary files.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Set
from pathlib import Path
from typing import IO

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


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

# How a temporary file, or a staging folder, is opened to be locked (never through a link).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDWR | _NOFOLLOW | getattr(os, "O_BINARY", 0)
_DIR_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_DIRECTORY", 0)


def _fsync(path: str | os.PathLike[str]) -> None:
    """Flush the file or folder ``path`` to disk."""
    # POSIX fsyncs a read-only descriptor (the file may be read-only); Windows needs write.
    fd = os.open(
        path, (os.O_RDONLY if os.name == "posix" else os.O_RDWR) | getattr(os, "O_BINARY", 0)
    )
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (a rename in it) to disk; a no-op where unsupported."""
    with contextlib.suppress(OSError):
        _fsync(folder)


def lock_entry(path: str | os.PathLike[str], flags: int, mode: int = 0o777) -> int | None:
    """Open ``path`` (``os.open(path, flags, mode)``) and take an exclusive ``flock`` on it.

    An entry that another process removes or replaces under the name between the open and
    the lock is let go, and the name opened again, so the lock held is on what ``path``
    names now.

    Returns:
        A descriptor holding the lock until it is closed, or None where locks are not
        available (this platform, or this file system), nothing held then.

    Raises:
        BlockingIOError: another process holds the lock.
        OSError: ``path`` cannot be opened.
    """
    if fcntl is None:
        return None
    for _ in range(100):
        fd = os.open(path, flags, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:  # a file system without locks
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        os.close(fd)
    raise OSError(f"could not lock {path}")  # pragma: no cover


def _create_locked(stem: str, folder: bool, what: str) -> tuple[int | None, str]:
    """Create and lock a new file (a folder if ``folder``) ``stem + XXXXXXXX``: ``(fd, path)``,
    ``fd`` holding the lock until closed (None where locks are not available). ``what`` names
    it in the error raised when no free name is found."""
    for _ in range(100):
        path = stem + secrets.token_hex(4)
        try:  # the umask applies, as to any new file or folder (not tempfile's 0o600, 0o700)
            if folder:
                os.mkdir(path, 0o777)
            else:
                Path(path).touch(0o666, exist_ok=False)
        except FileExistsError:
            continue
        with _live_lock:
            _live.add(path)
        # A cleaner in another process may lock and delete it between its creation and our
        # lock; then we start over with a new name.
        with contextlib.suppress(OSError):
            return lock_entry(path, _DIR_FLAGS if folder else _FILE_FLAGS), path
        _release(None, path)
    raise OSError(f"could not create {what}")  # pragma: no cover


def _release(fd: int | None, path: str) -> None:
    """Let go of the lock ``fd`` (if any) and of ``path`` as one of this process's writes."""
    if fd is not None:
        os.close(fd)
    with _live_lock:
        _live.discard(path)


@contextlib.contextmanager
def _lock_leftover(path: str, flags: int) -> Iterator[bool]:
    """Hold the lock of ``path``, left by a write that may have been killed, for the block;
    yields whether it is held (False: locks are not available here).

    Raises:
        BlockingIOError: a live write owns it (another process's, or one of this process's:
            where locks are per process, this process's own lock would not keep it out).
        OSError: ``path`` is gone.
    """
    with _live_lock:
        if path in _live:
            raise BlockingIOError(errno.EAGAIN, "written by this process", path)
    fd = lock_entry(path, flags)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def _leftovers(
    folder: str | os.PathLike[str], ours: Callable[[str], object], dirs: bool
) -> list[str]:
    """The paths of the entries of ``folder`` whose names ``ours`` accepts: its folders if
    ``dirs``, else its files (never symbolic links)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    kind = stat.S_ISDIR if dirs else stat.S_ISREG
    found = []
    for entry in entries:
        with contextlib.suppress(OSError):
            if ours(entry.name) and kind(entry.stat(follow_symlinks=False).st_mode):
                found.append(entry.path)
    return found


def _remove_stale(paths: list[str], dirs: bool) -> list[Path]:
    """Delete the leftovers ``paths`` (folders if ``dirs``, else files) that no live write
    owns: those whose lock nobody holds, or, where locks are not available, older than
    `STALE_TEMP_AGE_S`. Returns the paths deleted; never raises."""
    flags = _DIR_FLAGS if dirs else _FILE_FLAGS
    removed: list[Path] = []
    now = time.time()
    for path in paths:
        with contextlib.suppress(OSError), _lock_leftover(path, flags) as held:
            if held or now - os.lstat(path).st_mtime > STALE_TEMP_AGE_S:
                # while holding the lock: no write can own it
                if dirs:
                    _remove_tree(path)
                else:
                    os.unlink(path)
                if not os.path.lexists(path):
                    removed.append(Path(path))
    return removed


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

    def ours(name: str) -> bool:
        return name.startswith(".") and TEMP_PREFIX in name

    return _remove_stale(_leftovers(folder, ours, dirs=False), dirs=False)


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
    made: list[tuple[int | None, str]] = []
    try:
        for dest in dests:
            dest.parent.mkdir(parents=True, exist_ok=True)
            stem = os.path.join(dest.parent, f".{dest.name[:_MAX_STEM]}{TEMP_PREFIX}")
            made.append(_create_locked(stem, False, f"a temporary file next to {dest}"))
        yield [Path(tmp) for _, tmp in made]
        for (_, tmp), dest in zip(made, dests, strict=True):
            # Reopen by name: the writer may have replaced the inode we created.
            _fsync(tmp)
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
                os.unlink(tmp)
            _release(fd, tmp)  # the lock only once the temporary file is gone
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


# -- whole folders ---------------------------------------------------------------------------

#: Marker in the names of `atomic_folder()`'s staging folders (``.<name>.emakit-dir-XXXXXXXX``).
DIR_PREFIX = ".emakit-dir-"
#: Marker of a replaced folder on its way out where the system cannot exchange two folders
#: (``.<name>.emakit-old-XXXXXXXX``).
OLD_PREFIX = ".emakit-old-"

#: Errors that say the system or the file system has no atomic exchange (not a failure).
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP})
_AT_FDCWD = -100  # Linux: paths relative to the working directory
_RENAME_EXCHANGE = 2  # Linux <linux/fs.h>; macOS RENAME_SWAP has the same value


@functools.cache
def _swap_function() -> Callable[[bytes, bytes], int] | None:
    """libc's exchange of two paths (returns 0, or -1 with ``errno`` set): Linux
    ``renameat2(RENAME_EXCHANGE)``, macOS ``renamex_np(RENAME_SWAP)``; None where libc has
    neither."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # pragma: no cover - no libc to open (Windows)
        return None
    if hasattr(libc, "renameat2"):
        renameat2 = libc.renameat2
        renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p) * 2 + (ctypes.c_uint,)
        renameat2.restype = ctypes.c_int
        return lambda a, b: int(renameat2(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE))
    if hasattr(libc, "renamex_np"):  # pragma: no cover - macOS
        renamex_np = libc.renamex_np
        renamex_np.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint)
        renamex_np.restype = ctypes.c_int
        return lambda a, b: int(renamex_np(a, b, _RENAME_EXCHANGE))
    return None  # pragma: no cover


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` in one step. False where the system or the file
    system cannot (then nothing changed); any other failure raises ``OSError``."""
    swap = _swap_function()
    if swap is None:
        return False
    if swap(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _folder_stem(name: str) -> str:
    """``name`` as the names of its leftovers hold it: whole when short, else a prefix and a
    hash, so that two long names never share leftovers (a restore must find its own)."""
    raw = os.fsencode(name)
    if len(raw) <= _MAX_STEM:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return f"{raw[: _MAX_STEM - 20].decode('utf-8', 'ignore')}~{digest}"


def _remove_tree(path: str) -> None:
    """Delete the folder ``path``, read-only folders in it included; never raises."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError:
        for folder, _, _ in os.walk(path):
            with contextlib.suppress(OSError):
                os.chmod(folder, stat.S_IMODE(os.lstat(folder).st_mode) | stat.S_IRWXU)
        shutil.rmtree(path, ignore_errors=True)


def _saves_of(target: str, marker: str) -> list[str]:
    """The folders ``.<name><marker>XXXXXXXX`` beside ``target`` that `atomic_folder()`
    saves of it left: staging folders (`DIR_PREFIX`) or replaced ones (`OLD_PREFIX`)."""
    stem = f".{_folder_stem(os.path.basename(target))}{marker}"
    pattern = re.compile(re.escape(stem) + "[0-9a-f]{8}")
    return _leftovers(os.path.dirname(target), pattern.fullmatch, dirs=True)


def _ctime(path: str) -> float:
    try:
        return os.lstat(path).st_ctime
    except OSError:
        return 0.0


def remove_stale_folders(path: str | os.PathLike[str]) -> list[Path]:
    """Clean up after [`atomic_folder()`][emakit._files.atomic.atomic_folder] saves of
    ``path`` that were killed: put a replaced folder back where ``path`` is missing, and
    delete the staging and replaced folders no live save owns.

    A leftover is stale when no process holds its lock, or, where locks cannot be tested,
    when it is older than `STALE_TEMP_AGE_S`. A replaced folder (``-old-``) whose save was
    killed between its two renames is the only copy of the previous folder: while ``path``
    is missing it is renamed back (whatever its age), never deleted. Never raises.

    Args:
        path: the folder `atomic_folder()` writes (symbolic links are followed).

    Returns:
        The leftovers deleted.
    """
    target = os.path.realpath(path)
    olds = _saves_of(target, OLD_PREFIX)
    # A replaced folder goes back first (the newest, if several): it is the previous save.
    for old in sorted(olds, key=_ctime, reverse=True):
        if os.path.lexists(target):
            break
        with contextlib.suppress(OSError), _lock_leftover(old, _DIR_FLAGS):  # else live, or gone
            os.rename(old, target)
            fsync_dir(Path(target).parent)
    stale = _saves_of(target, DIR_PREFIX)
    if os.path.lexists(target):  # else the old folders belong to a live save, between renames
        stale += olds
    return _remove_stale(stale, dirs=True)


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link ``dst`` to ``src`` (a symbolic link itself, not its target), or a copy
    flushed to disk where the file system refuses the link."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
        if not os.path.islink(dst):
            _fsync(dst)


def _carry_entries(old: str, new: str, carry: Callable[[str, Set[str]], bool]) -> None:
    """Bring the entries of ``old`` that ``new`` lacks and ``carry`` keeps into ``new``,
    as hard links (copies where linking fails); emakit's own leftovers are never carried."""
    written = frozenset(os.listdir(new))
    with os.scandir(old) as entries:
        olds = list(entries)
    for entry in olds:
        name = entry.name
        ours = name.startswith(".") and any(
            m in name for m in (TEMP_PREFIX, DIR_PREFIX, OLD_PREFIX)
        )
        if name in written or ours or not carry(name, written):
            continue
        dst = os.path.join(new, name)
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dst)


def _fsync_files(root: str) -> None:
    """Flush every regular file under ``root`` to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                _fsync(path)


def _publish(staging: str, target: str) -> None:
    """Make the complete folder ``staging`` appear at ``target`` in one step. Where
    ``target`` existed, its old content ends under the name ``staging`` (exchange) or is
    removed (the two-rename fallback)."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        try:
            os.rename(staging, target)
            return
        except OSError as e:  # created meanwhile: exchange with it
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    if _exchange(staging, target):
        return
    # No exchange here: two renames, with nothing at ``target`` between them. The old
    # folder waits under a locked ``-old-`` name; a save killed in that window leaves it
    # there, and the next save (remove_stale_folders) renames it back.
    fd = None
    with contextlib.suppress(OSError):  # the lock moves with the old folder to its -old- name
        fd = lock_entry(target, _DIR_FLAGS)
    old = ""
    try:
        for _ in range(100):
            old = os.path.join(parent, f".{_folder_stem(os.path.basename(target))}{OLD_PREFIX}")
            old += secrets.token_hex(4)
            if not os.path.lexists(old):
                break
        with _live_lock:
            _live.add(old)
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        fsync_dir(Path(parent))
        _remove_tree(old)
    finally:
        _release(fd, old)


@contextlib.contextmanager
def atomic_folder(
    path: str | os.PathLike[str], *, carry: Callable[[str, Set[str]], bool] | None = None
) -> Iterator[Path]:
    """Yield a new empty folder beside ``path``; on success it replaces ``path`` as a whole.

    The block writes the new content into the yielded staging folder
    (``.<name>.emakit-dir-XXXXXXXX``, in ``path``'s parent). When it completes, the entries
    of the old folder that ``carry`` keeps are brought in, every file and folder is
    fsynced, and the staging folder takes ``path``'s place in one step: a rename where
    ``path`` does not exist, else an atomic exchange of the two folders (Linux
    ``renameat2(RENAME_EXCHANGE)``, macOS ``renamex_np(RENAME_SWAP)``), after which the old
    content (now under the staging name) is deleted. A reader, or a process killed at any
    moment, sees the old folder or the new one, whole.

    Where the exchange is unavailable (no such libc function, or a file system that
    refuses it: ``EINVAL``/``ENOSYS``/``ENOTSUP``), two renames are used instead: ``path``
    to ``.<name>.emakit-old-XXXXXXXX``, then the staging folder to ``path``. A process
    killed between them leaves no folder at ``path``, the old one under the ``-old-``
    name, until the next `atomic_folder()` of ``path`` (or
    [`remove_stale_folders()`][emakit._files.atomic.remove_stale_folders]) renames it back.

    ``path`` is resolved through symbolic links first: the folder a link points to is
    replaced, the link stays. The new folder keeps the old one's permission bits (a new
    one gets ``0o777 & ~umask``). If the block raises, ``path`` is left as it was and the
    staging folder is deleted. Leftovers of killed saves of ``path`` (the staging folder,
    or the old content under its name) are deleted by the next save: each save holds an
    ``flock`` on its staging folder, and one no process holds is stale.

    Args:
        path: the folder to write. Its parent is created if missing.
        carry: keyword-only; called as ``carry(name, written)`` for each top-level entry
            of the old folder that the new one lacks (``written``: the new folder's
            top-level names); True brings it into the new folder, as a hard link (a
            copy where the file system refuses links; folders entry by entry). Default
            None: nothing is carried, the new folder is exactly what the block wrote.

    Yields:
        The staging folder to fill.

    Raises:
        NotADirectoryError: ``path`` exists and is not a folder.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "model"
        >>> with atomic_folder(out) as staged:
        ...     _ = (staged / "config.json").write_text("{}")
        >>> sorted(p.name for p in out.iterdir())
        ['config.json']
    """
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise NotADirectoryError(errno.ENOTDIR, "atomic_folder needs a folder", target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    remove_stale_folders(target)
    stem = os.path.join(parent, f".{_folder_stem(os.path.basename(target))}{DIR_PREFIX}")
    fd, staging = _create_locked(stem, True, f"a staging folder in {parent}")
    try:
        yield Path(staging)
        _fsync_files(staging)
        if os.path.isdir(target):
            if carry is not None:
                _carry_entries(target, staging, carry)
            os.chmod(staging, stat.S_IMODE(os.stat(target).st_mode))
        for folder, _, _ in os.walk(staging):
            fsync_dir(Path(folder))
        _publish(staging, target)
        fsync_dir(Path(parent))
    finally:
        _remove_tree(staging)  # the failed save's files, or the old content after an exchange
        _release(fd, staging)
