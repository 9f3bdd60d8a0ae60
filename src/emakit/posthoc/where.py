"""Where a folder's post-hoc snapshots are: the folder itself, or its one subfolder that
holds them.

``emakit demo`` writes its snapshots to ``OUT/posthoc-snapshots``, next to
``summary.json``; ``emakit inspect OUT`` and ``emakit synthesize OUT`` find them there
through [`find_snapshot_folder()`][emakit.posthoc.where.find_snapshot_folder] instead of failing on a folder with no snapshots.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import EMAValueError
from .snapshots import list_legacy_files, list_snapshots

__all__ = ["find_snapshot_folder"]


def _holds_snapshots(folder: Path) -> bool:
    return bool(list_snapshots(folder) or list_legacy_files(folder))


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
    folder = Path(folder)
    if not folder.is_dir() or _holds_snapshots(folder):
        return folder
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and _holds_snapshots(p))
    if len(subs) > 1:
        raise EMAValueError(
            f"{str(folder)!r} holds no post-hoc snapshots itself, but {len(subs)} of its "
            f"subfolders do ({', '.join(repr(str(p)) for p in subs[:5])}); pass one of them"
        )
    return subs[0] if subs else folder
