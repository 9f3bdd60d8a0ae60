"""Post-hoc EMA snapshots: safetensors files that describe themselves.

A snapshot is the state of one power-function EMA profile at one training step. Each
file carries, in its safetensors header, everything synthesis needs: the format and its
version, ``gamma`` and ``sigma_rel``, the ``step`` it was taken at and ``t``, the step its
averaging profile ends at (equal to ``step`` for snapshots written by
:class:`~emakit.PostHocEMA`), which tensors are copied rather than averaged, and the
profile index. A folder of snapshots can therefore be synthesized from without the model
or the training script (``emakit synthesize``), and files that are not snapshots
(logs, other checkpoints, temporary files) are ignored.

File names are readable and sort by step, e.g.
``step-000010000_sigma_rel-0.05_gamma-16.9722.safetensors``; the header, not the name, is
authoritative. Floating tensors are stored in the snapshot dtype (float16 by default);
integer and bool tensors (``num_batches_tracked``, step counters) are stored exactly.
Writes are atomic (temporary file, fsync, rename) and, under ``torch.distributed``, made
by rank 0 only.

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
    }
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .._io import TEMP_PREFIX, atomic_path
from .._validate import not_newer
from ..errors import EMAFileNotFoundError, EMAStateError, EMATypeError, EMAValueError
from .math import PostHocWarning

__all__ = [
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_SUFFIX",
    "SnapshotInfo",
    "is_writer",
    "list_snapshots",
    "read_snapshot_info",
    "snapshot_filename",
    "write_snapshot",
]

#: ``format`` value in a snapshot's header; other safetensors files are not snapshots.
SNAPSHOT_FORMAT = "emakit.posthoc.snapshot"
#: Layout version written by this emakit; newer files are refused with an upgrade hint.
SNAPSHOT_FORMAT_VERSION = 1
SNAPSHOT_SUFFIX = ".safetensors"


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
        profile: index of the profile in the :class:`~emakit.PostHocEMA` that wrote it.
        update_every: the profile's ``update_every`` (informational).
        copied: names of tensors taken as they are at synthesis (buffers, integer
            tensors, no-EMA and ignored names) instead of averaged.
        format_version: the header's ``format_version``.
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

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes."""
        return self.path.stat().st_size


def is_writer() -> bool:
    """Whether this process writes files: always, except on ranks other than 0 of an
    initialized ``torch.distributed`` process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return True


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def snapshot_filename(step: int, sigma_rel: float, gamma: float) -> str:
    """The readable file name of a snapshot, e.g.
    ``step-000010000_sigma_rel-0.05_gamma-16.9722.safetensors``.

    The zero-padded step makes a sorted listing chronological.
    """
    return f"step-{step:09d}_sigma_rel-{_fmt(sigma_rel)}_gamma-{_fmt(gamma)}{SNAPSHOT_SUFFIX}"


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
) -> Path:
    """Write one snapshot atomically (temporary file in the same folder, fsync, rename).

    Args:
        path: the destination file.
        tensors: name -> tensor, already in the dtype to store; tensors must not share
            memory (pass copies).
        step, t, gamma, sigma_rel, profile, update_every, copied: the header fields (see
            :class:`SnapshotInfo`).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    from safetensors.torch import save_file

    from .._version import __version__

    metadata = {
        "format": SNAPSHOT_FORMAT,
        "format_version": str(SNAPSHOT_FORMAT_VERSION),
        "emakit_version": __version__,
        "step": str(int(step)),
        "t": str(int(t)),
        "gamma": repr(float(gamma)),
        "sigma_rel": repr(float(sigma_rel)),
        "profile": str(int(profile)),
        "update_every": str(int(update_every)),
        "copied": json.dumps(sorted(copied)),
    }
    dest = Path(path)
    with atomic_path(dest) as tmp:
        save_file(dict(tensors), str(tmp), metadata=metadata)
    return dest


def _field(meta: Mapping[str, str], key: str, kind: type, path: Path) -> object:
    try:
        value = kind(meta[key])
    except (KeyError, ValueError) as e:
        raise EMAStateError(
            f"snapshot {path} has a missing or malformed {key!r} in its header "
            f"({meta.get(key)!r}); the file is damaged or was not written by emakit"
        ) from e
    return value


def _parse(path: Path, meta: Mapping[str, str]) -> SnapshotInfo:
    version = int(_field(meta, "format_version", int, path))  # type: ignore[call-overload]
    not_newer(f"snapshot {path}", "format_version", version, SNAPSHOT_FORMAT_VERSION)
    try:
        copied = json.loads(meta.get("copied", "[]"))
    except ValueError as e:
        raise EMAStateError(f"snapshot {path} has a malformed 'copied' list in its header") from e
    gamma = float(_field(meta, "gamma", float, path))  # type: ignore[arg-type]
    step = int(_field(meta, "step", int, path))  # type: ignore[call-overload]
    t = int(_field(meta, "t", int, path)) if "t" in meta else step  # type: ignore[call-overload]
    if not (math.isfinite(gamma) and gamma > 0 and 0 < t <= step):
        raise EMAStateError(
            f"snapshot {path} has an invalid header: gamma={gamma!r}, t={t}, step={step} "
            f"(need gamma > 0 and 0 < t <= step)"
        )
    return SnapshotInfo(
        path=path,
        step=step,
        t=t,
        gamma=gamma,
        sigma_rel=float(_field(meta, "sigma_rel", float, path)),  # type: ignore[arg-type]
        profile=int(meta.get("profile", "0")),
        update_every=int(meta.get("update_every", "1")),
        copied=frozenset(copied),
        format_version=version,
    )


def _header_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return dict(f.metadata() or {})


def read_snapshot_info(path: str | os.PathLike[str]) -> SnapshotInfo:
    """Read a snapshot's header (no tensor is loaded).

    Raises:
        EMAFileNotFoundError: the file does not exist.
        EMAStateError: it is not a readable emakit snapshot, or one from a newer emakit.
    """
    p = Path(path)
    if not p.is_file():
        error = EMAValueError if p.exists() else EMAFileNotFoundError
        raise error(f"snapshot file {str(p)!r} does not exist (or is not a file)")
    try:
        meta = _header_metadata(p)
    except Exception as e:
        raise EMAStateError(
            f"{p} is not a readable safetensors file ({type(e).__name__}: {e})"
        ) from e
    if meta.get("format") != SNAPSHOT_FORMAT:
        raise EMAStateError(
            f"{p} is not an emakit post-hoc snapshot (its header format is "
            f"{meta.get('format')!r}, expected {SNAPSHOT_FORMAT!r})"
        )
    return _parse(p, meta)


def _as_folder(folder: object) -> Path:
    if not isinstance(folder, (str, os.PathLike)):
        raise EMATypeError(
            f"checkpoint_folder must be a str or os.PathLike, got {folder=!r} "
            f"({type(folder).__name__})"
        )
    return Path(folder)


def list_snapshots(folder: str | os.PathLike[str]) -> list[SnapshotInfo]:
    """The snapshots in ``folder``, sorted by ``(step, gamma)``.

    Only ``*.safetensors`` files whose header says ``format = emakit.posthoc.snapshot``
    count; anything else in the folder (other files, other safetensors files, emakit's
    temporary files) is ignored. A ``.safetensors`` file whose header cannot be read is
    skipped with a :class:`~emakit.posthoc.PostHocWarning`.

    Args:
        folder: the snapshot folder.

    Returns:
        The snapshots' headers; empty if the folder holds none.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
        EMAStateError: a snapshot was written by a newer emakit, or its header is damaged.
    """
    root = _as_folder(folder)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        error = EMAValueError if root.exists() else EMAFileNotFoundError
        raise error(
            f"snapshot folder {str(root)!r} {what}; pass the checkpoint_folder that "
            f"PostHocEMA wrote its snapshots to"
        )
    found: list[SnapshotInfo] = []
    for path in sorted(root.iterdir()):
        name = path.name
        if name.startswith(".") or TEMP_PREFIX in name or not name.endswith(SNAPSHOT_SUFFIX):
            continue
        if not path.is_file():
            continue
        try:
            meta = _header_metadata(path)
        except Exception as e:
            warnings.warn(
                f"skipping {path}: not a readable safetensors file ({type(e).__name__}: {e})",
                PostHocWarning,
                stacklevel=2,
            )
            continue
        if meta.get("format") != SNAPSHOT_FORMAT:
            continue
        found.append(_parse(path, meta))
    found.sort(key=lambda s: (s.step, s.gamma, s.path.name))
    return found
