"""ema-pytorch's post-hoc snapshot files: their names, their profiles, their tensors.

ema-pytorch's ``PostHocEMA`` writes ``<profile index>.<step>.pt`` files (``torch.save`` of a
``KarrasEMA.state_dict()``, every value in its ``checkpoint_dtype``) that record no gamma:
[`LegacyProfiles`][emakit.posthoc.snapshots.legacy.LegacyProfiles] says which profile each
index is. [`list_legacy_files()`][emakit.posthoc.snapshots.folder.list_legacy_files] finds
them by name, [`list_snapshots()`][emakit.posthoc.snapshots.folder.list_snapshots] reads
them as snapshots, `load_legacy_tensors()` loads one with
``torch.load(weights_only=True)``. The other way, `legacy_filename()` and `legacy_state()`
give the name and content of such a file
([`to_ema_pytorch()`][emakit.posthoc.convert.to_ema_pytorch] writes them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..._files.reading import open_regular, refusal_reason
from ..._validate import integer
from ...errors import EMAStateError, EMATypeError, EMAValueError
from ..math import check_gamma, check_sigma_rel, gamma_to_sigma_rel, sigma_rel_to_gamma

__all__ = [
    "LEGACY_NAME",
    "LEGACY_SOURCE",
    "LegacyFile",
    "LegacyProfiles",
    "legacy_filename",
    "legacy_state",
    "load_legacy_tensors",
]

#: `source` of snapshots written by ``ema_pytorch.PostHocEMA``.
LEGACY_SOURCE = "ema-pytorch"
#: ema-pytorch's snapshot file names: ``<profile index>.<step>.pt``.
LEGACY_NAME = re.compile(r"^(\d+)\.(\d+)\.pt$")


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
    [`PostHocEMA.legacy_profiles()`][emakit.posthoc.posthoc_ema.PostHocEMA.legacy_profiles] builds this from the PostHocEMA; the
    CLI from ``--legacy-sigma-rels`` / ``--legacy-gammas``.

    Attributes:
        gammas: gamma of each profile index, in ema-pytorch's order (its
            ``PostHocEMA.gammas``).
        sigma_rels: the matching relative widths. Default None: derived from ``gammas``.
        update_every: the ``update_every`` the ema-pytorch run used (its default is
            100): each file's last averaging update and the weights it holds depend on it.
            Default 1.
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
        integer("update_every", self.update_every, low=1)
        set_ = object.__setattr__  # a frozen dataclass: its fields normalized once, here
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
            EMAStateError: the index is out of range of `gammas`.
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


def load_legacy_tensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The EMA model's tensors in the ema-pytorch snapshot at ``path``, as stored: names
    without the ``ema_model.`` prefix, ``initted`` and ``step`` left out.

    Loaded with ``torch.load(weights_only=True)`` through one open descriptor: a file
    holding anything but tensors (e.g. a pickled object with code) is refused, never
    executed.

    Raises:
        EMAFileNotFoundError: the file does not exist.
        EMAValueError: it is not a regular file (a FIFO...).
        EMAStateError: the file cannot be loaded that way, or is not a ``KarrasEMA`` state.
    """
    with open_regular(path, "ema-pytorch snapshot") as f:
        try:
            obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise EMAStateError(
                f"{os.fspath(path)} could not be loaded as an ema-pytorch snapshot: torch.load("
                f"weights_only=True) refused it ({refusal_reason(e)}). emakit reads .pt "
                f"snapshots with weights_only=True and never runs pickled code; move the file "
                f"out of the snapshot folder if it is not one of ema-pytorch's snapshots"
            ) from e
    prefix = "ema_model."
    tensors = isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()
    )
    out = {k[len(prefix) :]: v for k, v in obj.items() if k.startswith(prefix)} if tensors else {}
    if not out or any(not k.startswith(prefix) and k not in ("initted", "step") for k in obj):
        got = sorted(map(str, obj))[:10] if isinstance(obj, Mapping) else f"a {type(obj).__name__}"
        raise EMAStateError(
            f"{os.fspath(path)} is not an ema-pytorch KarrasEMA state dict: expected the "
            f"tensors initted, step and ema_model.*, got {got}; move it out of the snapshot folder"
        )
    return out


def legacy_filename(profile: int, step: int) -> str:
    """The name ema-pytorch's ``PostHocEMA.checkpoint()`` gives the snapshot of profile
    index ``profile`` after ``step`` calls: ``<profile>.<step>.pt`` (its
    ``synthesize_ema_model`` parses both numbers back from the name)."""
    return f"{int(profile)}.{int(step)}.pt"


def legacy_state(tensors: Mapping[str, Tensor], step: int) -> dict[str, Tensor]:
    """What ema-pytorch's snapshot file holds for an EMA model whose state is ``tensors``:
    its ``KarrasEMA.state_dict()``, ``initted``, ``step`` and ``ema_model.<name>``, which
    ``KarrasEMA.load_state_dict`` reads strictly. Values keep their dtype (ema-pytorch casts
    everything, integers included, to its ``checkpoint_dtype``; its loader casts back)."""
    state = {"initted": torch.tensor(True), "step": torch.tensor(int(step))}
    state.update({f"ema_model.{name}": value for name, value in tensors.items()})
    return state
