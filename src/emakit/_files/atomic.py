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


def _lock_folder(name: str) -> tuple[int, bool | None]:
    """Lock the folder ``name``: ``(fd, True)`` held until ``fd`` is closed, ``(-1, False)``
    busy (a live owner) or gone, ``(-1, None)`` locks unsupported here."""
    if fcntl is None:
        return -1, None
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(name, flags)
    except OSError:
        return -1, False
    locked = try_lock(fd)
    try:  # the name may have moved to another folder between the open and the lock
        same = os.path.samestat(os.fstat(fd), os.stat(name, follow_symlinks=False))
    except OSError:
        same = False
    if locked and same:
        return fd, True
    os.close(fd)
    return -1, None if locked is None and same else False


def _make_folder(parent: str, prefix: str) -> tuple[int, str]:
    """Create and lock a new folder ``parent/prefix + XXXXXXXX``: ``(fd, path)``, ``fd``
    holding the lock (-1 where locks are unsupported)."""
    for _ in range(100):
        name = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(name, 0o777)  # the umask applies, as to any new folder (not mkdtemp's 0o700)
        except FileExistsError:
            continue
        with _live_lock:
            _live.add(name)
        fd, held = _lock_folder(name)
        if held is not False:
            return fd, name
        # Another save's cleaner took it for a leftover between mkdir and lock: start over.
        with _live_lock:
            _live.discard(name)
    raise OSError(f"could not create a staging folder in {parent}")  # pragma: no cover


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


def _leftovers(target: str) -> list[tuple[os.DirEntry[str], bool]]:
    """The folders beside ``target`` that `atomic_folder()` saves of it left, each with
    whether it is a replaced folder (``-old-``) rather than a staging one."""
    stem = re.escape(f".{_folder_stem(os.path.basename(target))}")
    pattern = re.compile(f"{stem}({re.escape(DIR_PREFIX)}|{re.escape(OLD_PREFIX)})[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(os.path.dirname(target)))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        with contextlib.suppress(OSError):
            if match and entry.is_dir(follow_symlinks=False):
                found.append((entry, match.group(1) == OLD_PREFIX))
    return found


def _ctime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_ctime
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
    leftovers = _leftovers(target)
    # A replaced folder goes back first (the newest, if several): it is the previous save.
    for entry in sorted((e for e, old in leftovers if old), key=_ctime, reverse=True):
        if os.path.lexists(target):
            break
        with _live_lock:
            if entry.path in _live:
                continue
        fd, held = _lock_folder(entry.path)
        with contextlib.suppress(OSError):
            if held is not False:
                os.rename(entry.path, target)
                fsync_dir(Path(target).parent)
        if fd >= 0:
            os.close(fd)
    removed: list[Path] = []
    now = time.time()
    for entry, old in leftovers:
        with _live_lock:
            if entry.path in _live:
                continue
        if old and not os.path.lexists(target):
            continue  # a live save between its two renames: the old folder is its to restore
        fd, held = _lock_folder(entry.path)
        with contextlib.suppress(OSError):  # gone meanwhile (put back above, or cleaned)
            aged = now - os.lstat(entry.path).st_mtime > STALE_TEMP_AGE_S
            if held or (held is None and aged):
                _remove_tree(entry.path)  # while holding the lock: no save can own it
                if not os.path.lexists(entry.path):
                    removed.append(Path(entry.path))
        if fd >= 0:
            os.close(fd)
    return removed


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link ``dst`` to ``src`` (a symbolic link itself, not its target), or a copy
    flushed to disk where the file system refuses the link."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
        if not os.path.islink(dst):
            _fsync_file(dst)


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


def _fsync_file(path: str) -> None:
    # POSIX fsyncs a read-only descriptor (the file may be read-only); Windows needs write.
    fd = os.open(
        path, (os.O_RDONLY if os.name == "posix" else os.O_RDWR) | getattr(os, "O_BINARY", 0)
    )
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_files(root: str) -> None:
    """Flush every regular file under ``root`` to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                _fsync_file(path)


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
    fd, _ = _lock_folder(target)  # the lock moves with the old folder to its -old- name
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
        if fd >= 0:
            os.close(fd)
        with _live_lock:
            _live.discard(old)


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
    fd, staging = _make_folder(parent, f".{_folder_stem(os.path.basename(target))}{DIR_PREFIX}")
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
        if fd >= 0:
            os.close(fd)
        with _live_lock:
            _live.discard(staging)
