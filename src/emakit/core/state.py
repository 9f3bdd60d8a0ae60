"""The versioned state-dict codec shared by every EMA kind.

A :class:`StateCodec` writes a layout-version key and a few scalar (or vector) fields
next to a module's tensors, and reads them back: it refuses a layout newer than this
emakit reads, reports missing required fields (so a strict load can fail), and knows its
own keys (so a load does not call them unexpected). Each EMA kind declares its codec; a
subclass adds a codec of its own for its extra keys (``KarrasEMA`` adds ``gamma``, ``t``,
``dt`` under ``karras_version``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._validate import not_newer

__all__ = ["Field", "StateCodec", "flag", "integer", "real", "reals"]


@dataclass(frozen=True)
class Field:
    """One entry of a state: its key, how to write and read it, and whether it must exist.

    ``encode`` turns the value into a tensor; ``decode`` turns the stored tensor back. A
    ``required`` field missing from a state is reported in ``missing_keys``.
    """

    key: str
    encode: Callable[[Any], Tensor]
    decode: Callable[[Any], Any]
    required: bool = False


def integer(key: str, *, required: bool = False) -> Field:
    """An ``int`` field (stored as an int64 scalar)."""
    return Field(key, lambda v: torch.tensor(int(v)), lambda t: int(t), required)


def flag(key: str, *, required: bool = False) -> Field:
    """A ``bool`` field (stored as a bool scalar)."""
    return Field(key, lambda v: torch.tensor(bool(v)), lambda t: bool(t), required)


def real(key: str, *, required: bool = False) -> Field:
    """A ``float`` field (stored as a float64 scalar)."""
    return Field(key, lambda v: torch.tensor(float(v), dtype=torch.float64), float, required)


def reals(key: str, *, required: bool = False) -> Field:
    """A tuple of floats (stored as a float64 vector)."""
    return Field(
        key,
        lambda v: torch.tensor(list(v), dtype=torch.float64),
        lambda t: tuple(float(x) for x in torch.as_tensor(t).reshape(-1)),
        required,
    )


class StateCodec:
    """Writes and reads a versioned set of fields under a state-dict prefix.

    Args:
        version_key: the key holding the layout version (e.g. ``"version"``).
        version: the layout version this emakit writes (and the newest it reads).
        fields: the fields, in the order they are written.
    """

    def __init__(self, version_key: str, version: int, fields: Sequence[Field]) -> None:
        self.version_key = version_key
        self.version = version
        self.fields = tuple(fields)
        self.keys = frozenset([version_key, *(f.key for f in self.fields)])

    def encode(self, values: Mapping[str, Any], destination: dict[str, Any], prefix: str) -> None:
        """Write the version and every field whose value is not None."""
        destination[prefix + self.version_key] = torch.tensor(self.version)
        for f in self.fields:
            value = values.get(f.key)
            if value is not None:
                destination[prefix + f.key] = f.encode(value)

    def decode(
        self, state_dict: Mapping[str, Any], prefix: str, missing_keys: list[str]
    ) -> dict[str, Any]:
        """The fields present in ``state_dict`` (decoded); missing required ones are added
        to ``missing_keys``.

        Raises:
            EMAStateError: the state was written in a newer layout.
        """
        not_newer(
            "state_dict", self.version_key, state_dict.get(prefix + self.version_key), self.version
        )
        out: dict[str, Any] = {}
        for f in self.fields:
            key = prefix + f.key
            if key in state_dict:
                out[f.key] = f.decode(state_dict[key])
            elif f.required:
                missing_keys.append(key)
        return out

    def strip(self, unexpected_keys: list[str], start: int, prefix: str) -> None:
        """Drop this codec's keys from ``unexpected_keys[start:]`` (they were read)."""
        ours = {prefix + k for k in self.keys}
        unexpected_keys[start:] = [k for k in unexpected_keys[start:] if k not in ours]
