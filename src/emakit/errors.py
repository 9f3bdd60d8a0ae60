"""The emakit exception family.

Every error emakit raises on bad input derives from [`EMAError`][emakit.errors.EMAError], and also from
the builtin that fits (``ValueError``, ``TypeError`` or ``RuntimeError``), so callers can
catch either. Messages echo the offending value and say how to fix it. Warnings raised
deep inside emakit point at the user's line with `user_stacklevel()`.
"""

from __future__ import annotations

import sys

__all__ = [
    "EMAError",
    "EMAFileNotFoundError",
    "EMARuntimeError",
    "EMAStateError",
    "EMATypeError",
    "EMAValueError",
    "EMAWriteError",
    "user_stacklevel",
]


class EMAError(Exception):
    """Base class of every exception emakit raises on purpose."""


class EMAValueError(EMAError, ValueError):
    """An argument has the right type but a value emakit cannot use."""


class EMATypeError(EMAError, TypeError):
    """An argument has a type emakit cannot use."""


class EMAStateError(EMAError, ValueError, RuntimeError):
    """A state dict, checkpoint or model structure does not match what is expected.

    Also a ``RuntimeError``, as torch's own ``load_state_dict`` raises for a strict
    mismatch, so ``except RuntimeError:`` fallbacks written for torch keep working.
    """


class EMARuntimeError(EMAError, RuntimeError):
    """An operation is not possible in the current state (e.g. updating inside ``swap()``)."""


class EMAFileNotFoundError(EMAError, FileNotFoundError):
    """A checkpoint or snapshot file or folder does not exist."""


class EMAWriteError(EMAError, OSError):
    """A file could not be written (disk full, no permission, read-only file system).

    Also an ``OSError`` with the original ``errno`` (e.g. ``errno.ENOSPC``); the message
    names the file. emakit's writes are atomic, so the file (or, for post-hoc snapshots,
    the step's whole set of files) is left as it was before the write.
    """


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that points at the first caller outside
    emakit: the user's ``ema.update()`` or ``checkpoint()`` line, however deep inside emakit
    the warning is raised (a fixed level would point at emakit's own code from some paths,
    and Python shows a warning once per place it points at). The frames of torch's
    ``@torch.no_grad()`` wrapper around an emakit method are passed over too."""
    frame, level = sys._getframe(1), 1  # the function that calls warnings.warn: level 1
    while frame.f_back is not None and _ours(frame.f_globals.get("__name__", "")):
        frame, level = frame.f_back, level + 1
    return level


def _ours(module: str) -> bool:
    """Whether a frame of ``module`` is emakit's, or torch's decorator wrapping emakit's."""
    return module.startswith("emakit.") or module == "torch.utils._contextlib"
