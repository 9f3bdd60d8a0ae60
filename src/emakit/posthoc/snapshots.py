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

**ema-pytorch's snapshots** (``<profile index>.<step>.pt``, ``torch.save`` of a
``KarrasEMA.state_dict()`` with every value in float16 by default) record no gamma; given
the profiles by index (:class:`LegacyProfiles`), :func:`list_snapshots` reads them too,
with ``torch.load(weights_only=True)``. See :meth:`LegacyProfiles.t_of` for their ``t``.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .._io import TEMP_PREFIX, atomic_path
from .._validate import not_newer
from ..errors import EMAFileNotFoundError, EMAStateError, EMATypeError, EMAValueError
from .math import (
    PostHocWarning,
    check_gamma,
    check_sigma_rel,
    gamma_to_sigma_rel,
    sigma_rel_to_gamma,
)

__all__ = [
    "LEGACY_NAME",
    "LEGACY_SOURCE",
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_FORMAT_VERSION",
    "SNAPSHOT_SUFFIX",
    "LegacyFile",
    "LegacyProfiles",
    "SnapshotInfo",
    "is_writer",
    "list_legacy_files",
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
#: :attr:`SnapshotInfo.source` of snapshots written by ``ema_pytorch.PostHocEMA``.
LEGACY_SOURCE = "ema-pytorch"
#: ema-pytorch's snapshot file names: ``<profile index>.<step>.pt``.
LEGACY_NAME = re.compile(r"^(\d+)\.(\d+)\.pt$")


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
        format_version: the header's ``format_version`` (0 for ema-pytorch files).
        source: ``"emakit"``, or :data:`LEGACY_SOURCE` (``"ema-pytorch"``) for an
            ema-pytorch ``<index>.<step>.pt`` file read through :class:`LegacyProfiles`.
        exact_dtypes: for ema-pytorch files, the dtype each integer or bool tensor is
            restored to (ema-pytorch stored it as a float); empty for emakit snapshots.
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

    @property
    def nbytes(self) -> int:
        """Size of the file in bytes."""
        return self.path.stat().st_size

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


def _existing_folder(folder: object) -> Path:
    root = _as_folder(folder)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        error = EMAValueError if root.exists() else EMAFileNotFoundError
        raise error(
            f"snapshot folder {str(root)!r} {what}; pass the checkpoint_folder that "
            f"PostHocEMA wrote its snapshots to"
        )
    return root


# -- ema-pytorch's snapshot files -----------------------------------------------------------


@dataclass(frozen=True)
class LegacyFile:
    """An ema-pytorch snapshot file, ``<profile index>.<step>.pt``, known by its name only.

    Attributes:
        path: the file.
        profile: the profile index (ema-pytorch's ``PostHocEMA.gammas[profile]``).
        step: ``update()`` calls when it was written.
    """

    path: Path
    profile: int
    step: int


@dataclass(frozen=True)
class LegacyProfiles:
    """The profiles of an ema-pytorch run, to read its ``<index>.<step>.pt`` snapshots.

    ema-pytorch's files record neither gamma nor which tensors are buffers.
    :meth:`emakit.posthoc.PostHocEMA.legacy_profiles` builds this from the PostHocEMA; the
    CLI from ``--legacy-sigma-rels`` / ``--legacy-gammas``.

    Attributes:
        gammas: gamma of each profile index, in ema-pytorch's order (its
            ``PostHocEMA.gammas``).
        sigma_rels: the matching relative widths. Default None: derived from ``gammas``.
        update_every: the ``update_every`` the ema-pytorch run used, to find each file's
            last averaging update. Default 1.
        copied: EMA-model state names taken rather than averaged at synthesis (buffers,
            integer tensors). Default None: those of the folder's latest emakit snapshot,
            or none (everything averaged) without one.
        exact_dtypes: ``(name, dtype)`` of integer and bool tensors, restored (rounded)
            from ema-pytorch's float copies. Default ``()`` (with ``copied=None``: the
            dtypes in the emakit snapshot).

    Example:
        >>> LegacyProfiles.from_sigma_rels((0.05, 0.28)).gammas[0]  # doctest: +ELLIPSIS
        16.97...
    """

    gammas: tuple[float, ...]
    sigma_rels: tuple[float, ...] | None = None
    update_every: int = 1
    copied: frozenset[str] | None = None
    exact_dtypes: tuple[tuple[str, torch.dtype], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.gammas, (str, bytes)) or not isinstance(self.gammas, Sequence):
            raise EMATypeError(f"gammas must be a tuple of numbers, got {self.gammas!r}")
        gammas = tuple(check_gamma(g, "gammas") for g in self.gammas)
        srs = self.sigma_rels
        if not gammas or (srs is not None and len(srs) != len(gammas)):
            raise EMAValueError(
                f"gammas must hold one value per profile index (and sigma_rels, if given, "
                f"as many), got gammas={self.gammas!r}, sigma_rels={srs!r}"
            )
        every = self.update_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise EMAValueError(f"update_every must be an int >= 1, got update_every={every!r}")
        set_ = object.__setattr__
        set_(self, "gammas", gammas)
        if srs is not None:
            set_(self, "sigma_rels", tuple(check_sigma_rel(s, "sigma_rels") for s in srs))
        set_(self, "copied", None if self.copied is None else frozenset(self.copied))
        set_(self, "exact_dtypes", tuple(self.exact_dtypes))

    @classmethod
    def from_sigma_rels(
        cls, sigma_rels: Sequence[float], *, update_every: int = 1
    ) -> LegacyProfiles:
        """The profiles of an ema-pytorch ``PostHocEMA(sigma_rels=...)`` run.

        Args:
            sigma_rels: its ``sigma_rels``, in order.
            update_every: its ``update_every``. Default 1.
        """
        srs = tuple(check_sigma_rel(s, "sigma_rels") for s in sigma_rels)
        return cls(
            tuple(sigma_rel_to_gamma(s) for s in srs), sigma_rels=srs, update_every=update_every
        )

    def profile(self, file: LegacyFile) -> tuple[float, float]:
        """``(gamma, sigma_rel)`` of ``file``'s profile index.

        Raises:
            EMAStateError: the index is out of range of :attr:`gammas`.
        """
        i = file.profile
        if i >= len(self.gammas):
            raise EMAStateError(
                f"ema-pytorch snapshot {file.path} is of profile index {i}, but only "
                f"{len(self.gammas)} profile(s) are known (gammas={list(self.gammas)}); "
                f"ema-pytorch names its files <profile index>.<step>.pt and takes gamma from "
                f"its PostHocEMA.gammas[index]. Give the sigma_rels (or gammas) of the run that "
                f"wrote the file, in order and at least {i + 1} of them (PostHocEMA(sigma_rels="
                f"...), or emakit's --legacy-sigma-rels / --legacy-gammas), or move the file "
                f"out of the folder"
            )
        gamma = self.gammas[i]
        return gamma, (self.sigma_rels[i] if self.sigma_rels else gamma_to_sigma_rel(gamma))

    def t_of(self, step: int) -> int:
        """``t`` of the file ``<index>.<step>.pt``: the step its profile ends at.

        ema-pytorch's ``update()`` increments ``step``, averages on the calls ``c`` with
        ``(c - 1) % update_every == 0`` (decay ``(1 - 1/(c + 1))^(gamma + 1)``), and
        ``checkpoint()`` names the file after the calls so far. The last weights averaged
        in are those of the last such call at or before ``step``: ``step`` itself for
        ``update_every=1``, as for emakit's own snapshots (so the two kinds mix).
        """
        k = self.update_every
        return 1 + k * ((step - 1) // k)


def list_legacy_files(folder: str | os.PathLike[str]) -> list[LegacyFile]:
    """ema-pytorch's snapshot files (``<profile index>.<step>.pt``) in ``folder``, by
    ``(step, profile)``; found by name, nothing is read.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
    """
    root = _existing_folder(folder)
    found = []
    for path in root.iterdir():
        m = LEGACY_NAME.match(path.name)
        if m and path.is_file():
            found.append(LegacyFile(path, int(m.group(1)), int(m.group(2))))
    found.sort(key=lambda f: (f.step, f.profile, f.path.name))
    return found


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
        from safetensors import safe_open

        ref = emakit[-1]
        with safe_open(str(ref.path), framework="pt", device="cpu") as f:
            codes = {n: f.get_slice(n).get_dtype() for n in sorted(ref.copied)}
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
    :class:`LegacyProfiles`; without it they are left out: :func:`list_legacy_files`
    finds them). Anything else in the folder (other files, other safetensors files,
    emakit's temporary files) is ignored. A ``.safetensors`` file whose header cannot be
    read is skipped with a :class:`~emakit.posthoc.PostHocWarning`.

    Args:
        folder: the snapshot folder.
        legacy: the profiles of ema-pytorch's files by index. Default None: leave them out.

    Returns:
        The snapshots' headers; empty if the folder holds none.

    Raises:
        EMAFileNotFoundError: ``folder`` does not exist.
        EMAValueError: ``folder`` is not a folder.
        EMAStateError: a snapshot was written by a newer emakit, or its header is damaged;
            an ema-pytorch file's profile index is out of range of ``legacy.gammas``.
    """
    root = _existing_folder(folder)
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
    if legacy is not None:
        found.extend(_legacy_snapshots(root, found, legacy))
        found.sort(key=lambda s: (s.step, s.gamma, s.path.name))
    return found
