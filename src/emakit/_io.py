"""Atomic file writes: a crash mid-write leaves the previous file whole.

Every file emakit writes goes through :func:`atomic_write`: the bytes go to a temporary
file in the destination's folder, are flushed and fsynced, and the temporary file is then
renamed over the destination (``os.replace``, atomic on POSIX and Windows). The folder is
fsynced too where the platform allows, so the rename itself survives a power cut. A failed
write removes its temporary file, so temporaries do not pile up.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

__all__ = ["TEMP_PREFIX", "atomic_path", "atomic_write", "atomic_write_bytes"]

#: Prefix of emakit's temporary files (``.<name>.emakit-tmp-XXXX``).
TEMP_PREFIX = ".emakit-tmp-"


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path`` atomically.

    Use it with writers that want a file name (``safetensors.torch.save_file``,
    ``torch.save``, ``matplotlib``'s ``savefig``)::

        with atomic_path("ema.safetensors") as tmp:
            save_file(tensors, tmp)
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}{TEMP_PREFIX}", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """Write ``path`` atomically by calling ``write(file_object)`` on a temporary file."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda f: f.write(data) and None)
