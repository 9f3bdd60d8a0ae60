"""The versioned state-dict codec shared by every EMA kind.

An EMA's ``state_dict()`` has exactly ema-pytorch's keys (``initted``, ``step``,
``ema_model.*``), so it loads into ema-pytorch and into code that strips prefixes. What
emakit adds goes into torch's own per-module metadata (``state_dict()._metadata``, the
dict torch passes back to ``_load_from_state_dict`` as ``local_metadata``, where it
already records each module's ``_version``): the layout version, the skip count, the
power-function EMA's profile time.

A :class:`StateCodec` declares a kind's fields: which are keys (tensors) and which are
metadata, how each is written and read back, and the keys that earlier layouts wrote
(version 1 wrote ``version``, ``num_skipped_nonfinite``, ``karras_version``, ``gamma``,
``t``, ``dt`` and ``gammas`` as keys): those still load. Metadata survives
``torch.save``/``torch.load`` of the state dict; code that rebuilds the dict loses it, and
the fields then keep the loading EMA's values (or are derived, as documented per kind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import not_newer
from ..errors import EMAStateError

__all__ = [
    "Field",
    "StateCodec",
    "check_loadable",
    "flag",
    "integer",
    "metadata_of",
    "real",
    "reals",
]


@dataclass(frozen=True)
class Field:
    """One entry of a state.

    ``key`` is its name; ``meta`` puts it in the module's metadata instead of the keys.
    ``encode`` turns the value into what is stored (a tensor for a key, a plain Python
    value for metadata); ``decode`` turns a stored value (a tensor from a key, of this
    layout or an earlier one, or a metadata value) back. A ``required`` key missing from
    a state is reported in ``missing_keys``.
    """

    key: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    required: bool = False
    meta: bool = False


def integer(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """An ``int`` field (an int64 scalar tensor as a key, an int in metadata)."""
    encode: Callable[[Any], Any] = int if meta else (lambda v: torch.tensor(int(v)))
    return Field(key, encode, lambda t: int(t), required, meta)


def flag(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A ``bool`` field (a bool scalar tensor as a key, a bool in metadata)."""
    encode: Callable[[Any], Any] = bool if meta else (lambda v: torch.tensor(bool(v)))
    return Field(key, encode, lambda t: bool(t), required, meta)


def real(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A ``float`` field (a float64 scalar tensor as a key, a float in metadata)."""
    encode: Callable[[Any], Any] = (
        float if meta else (lambda v: torch.tensor(float(v), dtype=torch.float64))
    )
    return Field(key, encode, float, required, meta)


def reals(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A tuple of floats (a float64 vector as a key, a list in metadata)."""
    encode: Callable[[Any], Any] = (
        (lambda v: [float(x) for x in v])
        if meta
        else (lambda v: torch.tensor(list(v), dtype=torch.float64))
    )

    def decode(t: Any) -> tuple[float, ...]:
        if isinstance(t, torch.Tensor):  # a key (float64 vector)
            return tuple(float(x) for x in t.reshape(-1))
        return tuple(float(x) for x in t)  # metadata: Python floats, exact

    return Field(key, encode, decode, required, meta)


def metadata_of(destination: Mapping[str, Any], prefix: str) -> dict[str, Any] | None:
    """The metadata dict torch keeps for the module saved under ``prefix`` (None when the
    destination keeps none, e.g. a plain dict passed to ``state_dict(destination=...)``)."""
    metadata = getattr(destination, "_metadata", None)
    if metadata is None:
        return None
    return metadata.setdefault(prefix[:-1], {})  # type: ignore[no-any-return]


class StateCodec:
    """Writes and reads a kind's fields under a state-dict prefix.

    Args:
        version: the layout version this emakit writes (the module's ``_version``) and the
            newest it reads.
        fields: the fields, in the order they are written.
        legacy_keys: keys that earlier layouts wrote and that are read (as the field of
            the same name) or ignored; ``legacy_version_key`` among them holds a version.
        legacy_version_key: the key earlier layouts kept their version in, if any.
        version_name: the metadata entry holding the version. Default ``"version"``
            (torch's own entry); a kind with extra fields of its own versions them under
            another name.
    """

    def __init__(
        self,
        version: int,
        fields: Sequence[Field],
        *,
        legacy_keys: Sequence[str] = (),
        legacy_version_key: str | None = None,
        version_name: str = "version",
    ) -> None:
        self.version = version
        self.fields = tuple(fields)
        self.legacy_version_key = legacy_version_key
        self.version_name = version_name
        self.keys = frozenset(
            [*(f.key for f in self.fields if not f.meta), *legacy_keys]
            + ([legacy_version_key] if legacy_version_key else [])
        )

    def encode(self, values: Mapping[str, Any], destination: dict[str, Any], prefix: str) -> None:
        """Write every field whose value is not None: keys into ``destination``,
        metadata into its ``_metadata`` for ``prefix`` (with the version)."""
        meta = metadata_of(destination, prefix)
        if meta is not None and self.version_name != "version":
            meta[self.version_name] = self.version
        for f in self.fields:
            value = values.get(f.key)
            if value is None:
                continue
            if not f.meta:
                destination[prefix + f.key] = f.encode(value)
            elif meta is not None:
                meta[f.key] = f.encode(value)

    def decode(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        missing_keys: list[str],
    ) -> dict[str, Any]:
        """The fields found (decoded), from keys or metadata, this layout or an earlier one;
        missing required keys are added to ``missing_keys``.

        Raises:
            EMAStateError: the state was written in a newer layout than this emakit reads.
        """
        not_newer(
            "state_dict", self.version_name, local_metadata.get(self.version_name), self.version
        )
        if self.legacy_version_key is not None:
            legacy = state_dict.get(prefix + self.legacy_version_key)
            not_newer("state_dict", self.legacy_version_key, legacy, 1)
        out: dict[str, Any] = {}
        for f in self.fields:
            key = prefix + f.key
            if key in state_dict:
                out[f.key] = f.decode(state_dict[key])
            elif f.meta and f.key in local_metadata:
                out[f.key] = f.decode(local_metadata[f.key])
            elif f.required:
                missing_keys.append(key)
        return out

    def strip(self, unexpected_keys: list[str], start: int, prefix: str) -> None:
        """Drop this codec's keys (and earlier layouts') from ``unexpected_keys[start:]``."""
        ours = {prefix + k for k in self.keys}
        unexpected_keys[start:] = [k for k in unexpected_keys[start:] if k not in ours]


def check_loadable(
    expected: Mapping[str, Any],
    state_dict: Mapping[str, Any],
    *,
    strict: bool,
    owned: Callable[[str], bool],
) -> None:
    """Refuse a state before anything of it is loaded, so a failed load changes nothing.

    Args:
        expected: the loading module's own ``state_dict(keep_vars=True)``.
        state_dict: the state to load.
        strict: also refuse missing and unexpected keys.
        owned: keys the module reads or ignores itself (earlier layouts' keys, ...).

    Raises:
        EMAStateError: missing or unexpected keys (``strict``), an entry that is not a
            tensor, or a tensor of another shape; the message lists them.
    """
    problems = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected and not owned(k)]
        if missing:
            problems.append(f"missing keys {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            problems.append(
                f"unexpected keys {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
            )
    for key, value in state_dict.items():
        mine = expected.get(key)
        if mine is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.shape != mine.shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the EMA {tuple(mine.shape)}")
    if problems:
        raise EMAStateError(
            "state_dict does not fit this EMA (nothing was loaded): " + "; ".join(problems)
        )
