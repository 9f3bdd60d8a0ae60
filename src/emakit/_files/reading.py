"""Opening files emakit reads, and checking names of files it writes.

* `open_regular()` opens a file for reading without ever blocking: a FIFO, a socket or
  a device is refused (opening a FIFO for reading would wait for a writer forever), and
  the check is made on the open descriptor, so the file cannot be swapped in between.
* `torch_load()` reads a torch file through one open descriptor with
  ``weights_only=True`` and turns torch's refusal into an [`EMAStateError`][emakit.errors.EMAStateError]
  that names the file and never repeats torch's advice to load with ``weights_only=False``.
* `write_errors()` turns an ``OSError`` while writing (disk full, read-only file
  system) into an [`EMAWriteError`][emakit.errors.EMAWriteError] that names the file and keeps the
  ``errno``.
* `parse_json()` reads JSON from a file with too-deep nesting reported as malformed JSON.
* `as_path()` checks a path argument; [`writable_path`][emakit._files.reading.writable_path] refuses, at write time, a file or folder name that is not valid
  UTF-8 (on POSIX a name is bytes, and Python keeps undecodable bytes as surrogates):
  safetensors' own reader, JSON headers and most tools cannot name such a file, so it
  could be written but not read back.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from ..errors import (
    EMAError,
    EMAFileNotFoundError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
    EMAWriteError,
)

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``"a regular file"``, ``"a FIFO (named pipe)"``...)."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], what: str = "file") -> io.BufferedReader:
    """Open ``path`` for binary reading, refusing anything but a regular file.

    The file is opened non-blocking (a FIFO opens at once instead of waiting for a
    writer) and its type is checked on the open descriptor.

    Args:
        path: the file.
        what: what the file is, for messages (``"checkpoint file"``, ``"snapshot"``).

    Returns:
        A buffered binary file object; the caller closes it.

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is a folder, a FIFO, a socket or a device.
        EMAStateError: it cannot be opened (permissions, I/O error).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise EMAFileNotFoundError(f"{what} {os.fsdecode(path)} does not exist") from None
    except IsADirectoryError:
        raise EMAValueError(
            f"{what} must be a regular file, got path={os.fsdecode(path)!r}, which is a folder"
        ) from None
    except OSError as e:
        raise EMAStateError(
            f"{what} {os.fsdecode(path)} cannot be opened ({e.strerror or type(e).__name__})"
        ) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise EMAValueError(
                f"{what} must be a regular file, got path={os.fsdecode(path)!r}, which is "
                f"{file_kind(mode)}; pass the path of a file"
            )
        return cast(io.BufferedReader, os.fdopen(fd, "rb"))
    except BaseException:
        os.close(fd)
        raise


def refusal_reason(e: BaseException) -> str:
    """One line saying why ``torch.load(weights_only=True)`` refused a file, without
    torch's advice to retry with ``weights_only=False``."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it holds objects other than tensors and plain containers ({found.group(1)})"
    if "weights_only" in text or "Weights only" in text:
        return "it holds objects other than tensors and plain containers"
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def torch_load(path: str | os.PathLike[str], what: str = "file", *, yours: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of ``path`` through one open descriptor.

    With ``yours`` (a file the user hands over, e.g. to ``load_foreign_state``), a refusal
    also says how to load a trusted file and pass the result instead.

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is not a regular file.
        EMAStateError: torch refuses or cannot read it; the message names the file and
            the reason, and says that emakit never unpickles code (or that the file may
            be truncated or corrupt).
    """
    import torch

    with open_regular(path, what) as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            reason = refusal_reason(e)
            fix = "it may be truncated or corrupt"
            if reason.startswith("it holds"):
                fix = (
                    "emakit reads only tensors and plain containers from torch files and "
                    "never runs pickled code"
                )
                if yours:
                    fix += (
                        "; if you trust the file, load it yourself with torch.load(path, "
                        "weights_only=False) and pass the result"
                    )
            raise EMAStateError(
                f"{os.fsdecode(path)} could not be read as a torch file with weights_only="
                f"True ({reason}); {fix}"
            ) from e


def parse_json(text: str | bytes, **hooks: Any) -> Any:
    """``json.loads(text, **hooks)`` of JSON read from a file, with nesting too deep for
    Python's parser (a crafted file: a list 100,000 brackets deep) raised as the
    ``ValueError`` that any malformed JSON raises, so a reader's one ``except ValueError``
    names the file instead of letting a ``RecursionError`` escape. ``hooks`` are
    ``json.loads``' keywords (``object_pairs_hook``, ``parse_constant``)."""
    try:
        return json.loads(text, **hooks)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply to be read") from None


def as_path(name: str, value: object) -> Path:
    """``value`` as a `Path` to read, or an error naming the argument ``name``.

    Raises:
        EMATypeError: ``value`` is not a str or ``os.PathLike`` (bytes included).
    """
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise EMATypeError(
            f"{name} must be a str or os.PathLike file name, got {name}={value!r} "
            f"({type(value).__name__})"
        )
    return Path(text)


def writable_path(name: str, value: object) -> Path:
    """``value`` as a `Path` to write, or an error naming the argument: as `as_path()`,
    and refusing a name that is not valid UTF-8 (undecodable bytes on POSIX).

    Raises:
        EMATypeError: ``value`` is not a str or ``os.PathLike``.
        EMAValueError: the name is not valid UTF-8.
    """
    path = as_path(name, value)
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise EMAValueError(
            f"{name} must be a UTF-8 file name, got {name}={str(path)!r}, which holds bytes "
            f"that are not UTF-8; a file written there could not be read back by "
            f"safetensors or named in a header: choose a UTF-8 name"
        ) from None
    return path


def writable_folder(name: str, value: object) -> Path:
    """``value`` as a folder to write into (created later if missing), or an error naming
    the argument: as [`writable_path`][emakit._files.reading.writable_path], and refusing a path that exists and is not a
    folder (a regular file, a FIFO...).

    Raises:
        EMATypeError: ``value`` is not a str or ``os.PathLike``.
        EMAValueError: the name is not valid UTF-8, or it names something that is not a
            folder.
    """
    path = writable_path(name, value)
    if os.path.lexists(path) and not path.is_dir():
        raise EMAValueError(
            f"{name} must be a folder, got {name}={str(path)!r}, which is "
            f"{file_kind(os.lstat(path).st_mode)}; "
            f"choose another path (or move that file away)"
        )
    return path


@contextlib.contextmanager
def write_errors(paths: Sequence[str | os.PathLike[str]], what: str = "file") -> Iterator[None]:
    """Turn an ``OSError`` raised inside the block into an
    [`EMAWriteError`][emakit.errors.EMAWriteError] naming ``paths`` (the files being written).

    Args:
        paths: the destinations of the write.
        what: what they are, for the message (``"snapshot"``, ``"EMA weights file"``).
    """
    try:
        yield
    except EMAError:
        raise
    except OSError as e:
        names = ", ".join(os.fsdecode(p) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        plural = "s" if len(paths) > 1 else ""
        raise EMAWriteError(
            e.errno or 0,
            f"could not write the {what}{plural} {names} ({e.strerror or e}); "
            f"{'they were' if plural else 'it was'} left as before the write: free space or "
            f"fix the folder's permissions, then save again",
        ) from e
