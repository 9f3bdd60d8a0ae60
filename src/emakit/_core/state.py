"""The versioned state-dict codec shared by every EMA kind.

An EMA's ``state_dict()`` has exactly ema-pytorch's keys (``initted``, ``step``,
``ema_model.*``), so it loads into ema-pytorch and into code that strips prefixes. What
emakit adds goes into torch's own per-module metadata (``state_dict()._metadata``, the
dict torch passes back to ``_load_from_state_dict`` as ``local_metadata``, where it
already records each module's ``_version``): the layout version, the skip count, the
power-function EMA's profile time.

A `StateCodec` declares a kind's fields: which are keys (tensors) and which are
metadata, how each is written and read back, and the keys that earlier layouts wrote
(version 1 wrote ``version``, ``num_skipped_nonfinite``, ``karras_version``, ``gamma``,
``t``, ``dt`` and ``gammas`` as keys): those still load. Metadata survives
``torch.save``/``torch.load`` of the state dict; code that rebuilds the dict loses it, and
the fields then keep the loading EMA's values (or are derived, as documented per kind).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._validate import few, not_newer, stored_count, stored_flag, stored_real
from ..errors import EMAError, EMAStateError, EMATypeError, EMAValueError


@dataclass(frozen=True)
class Field:
    """One entry of a state.

    ``key`` is its name; ``meta`` puts it in the module's metadata instead of the keys.
    ``encode`` turns the value into what is stored (a tensor for a key, a plain Python
    value for metadata); ``decode(stored, where)`` checks a stored value (a tensor from a
    key, of this layout or an earlier one, or a metadata value) and turns it back, raising
    an [`EMAStateError`][emakit.errors.EMAStateError] that names ``where`` (the state and the field) for a
    value of the wrong kind. A ``required`` key missing from a state is reported in
    ``missing_keys``.
    """

    key: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any, str], Any]
    required: bool = False
    meta: bool = False


def integer(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """An ``int`` field (an int64 scalar tensor as a key, an int in metadata), read back
    as a whole number in ``[0, 2**53]`` (a negative, huge, fractional or vector value is
    refused)."""
    encode: Callable[[Any], Any] = int if meta else (lambda v: torch.tensor(int(v)))
    return Field(key, encode, lambda t, where: stored_count(where, key, t), required, meta)


def flag(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A ``bool`` field (a bool scalar tensor as a key, a bool in metadata), read back
    from a bool or 0/1."""
    encode: Callable[[Any], Any] = bool if meta else (lambda v: torch.tensor(bool(v)))
    return Field(key, encode, lambda t, where: stored_flag(where, key, t), required, meta)


def real(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A ``float`` field (a float64 scalar tensor as a key, a float in metadata), read
    back as a finite float."""
    encode: Callable[[Any], Any] = (
        float if meta else (lambda v: torch.tensor(float(v), dtype=torch.float64))
    )
    return Field(key, encode, lambda t, where: stored_real(where, key, t), required, meta)


def reals(key: str, *, required: bool = False, meta: bool = False) -> Field:
    """A tuple of floats (a float64 vector as a key, a list in metadata)."""

    def encode(v: Any) -> Any:
        values = [float(x) for x in v]
        return values if meta else torch.tensor(values, dtype=torch.float64)

    def decode(t: Any, where: str) -> tuple[float, ...]:
        if isinstance(t, torch.Tensor):  # a key (float64 vector)
            values = t.reshape(-1).tolist()
        elif isinstance(t, (list, tuple)):  # metadata: Python floats, exact
            values = list(t)
        else:
            raise EMAStateError(
                f"{where}: {key} must be a list of numbers, got {type(t).__name__} {t!r:.80}"
            )
        return tuple(stored_real(where, key, x) for x in values)

    return Field(key, encode, decode, required, meta)


def text(key: str, pattern: re.Pattern[str]) -> Field:
    """A ``str`` field (metadata only: state-dict keys hold tensors), read back as a
    string that ``pattern`` matches (a PostHocEMA's run id)."""

    def decode(value: Any, where: str) -> str:
        if not isinstance(value, str) or not pattern.match(value):
            raise EMAStateError(
                f"{where}: {key} must be a string matching {pattern.pattern}, got "
                f"{key}={value!r:.80} ({type(value).__name__}); the state is corrupt"
            )
        return value

    return Field(key, str, decode, False, True)


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
        metadata = getattr(destination, "_metadata", None)  # None for a plain dict
        meta = None if metadata is None else metadata.setdefault(prefix[:-1], {})
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
            EMAStateError: the state was written in a newer layout than this emakit reads,
                or a field holds a value of the wrong kind (a negative, huge, fractional or
                vector step, a malformed version, a non-finite number); the message names
                the key or metadata entry.
        """
        meta_of = f"state_dict metadata of {prefix[:-1] or 'the root module'!r}"
        not_newer(meta_of, self.version_name, local_metadata.get(self.version_name), self.version)
        if self.legacy_version_key is not None:
            legacy_key = prefix + self.legacy_version_key
            not_newer(f"state_dict[{legacy_key!r}]", "version", state_dict.get(legacy_key), 1)
        out: dict[str, Any] = {}
        for f in self.fields:
            key = prefix + f.key
            if key in state_dict:
                out[f.key] = f.decode(state_dict[key], f"state_dict[{key!r}]")
            elif f.meta and f.key in local_metadata:
                out[f.key] = f.decode(local_metadata[f.key], meta_of)
            elif f.required:
                missing_keys.append(key)
        return out


def refuse_other_settings(kind: str, saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Refuse a state that a ``kind`` (``"BEMA"``, ``"KarrasEMA"``...) saved with other
    settings than ``mine``; only the settings ``saved`` records are compared, numbers to a
    relative 1e-9 and sequences (a PostHocEMA's gammas) element by element.

    Raises:
        EMAStateError: naming the setting, both values and the fix.
    """
    for name, value in mine.items():
        theirs = saved.get(name)
        if theirs is not None and not _same(theirs, value):
            raise EMAStateError(
                f"state_dict is of a {kind} with {name}={theirs!r}, but this {kind} has "
                f"{name}={value!r}; build the {kind} with the settings it was saved with"
            )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Sequence) and isinstance(b, Sequence):
        return len(a) == len(b) and all(map(_same, a, b))
    return math.isclose(a, b, rel_tol=1e-9)


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
            tensor, a tensor of another shape, or of another kind (see
            `kind_problem()`); the message lists them.
    """
    problems = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected and not owned(k)]
        for what, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                problems.append(f"{what} keys {few(keys)}")
    for key, value in state_dict.items():
        mine = expected.get(key)
        if mine is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is a {type(value).__name__}, not a tensor")
        elif value.shape != mine.shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the EMA {tuple(mine.shape)}")
        elif (why := kind_problem(key, value, mine)) is not None:
            problems.append(why)
    if problems:
        raise EMAStateError(
            "state_dict does not fit this EMA (nothing was loaded): " + "; ".join(problems)
        )


def refuse_load_arguments(state_dict: object, assign: bool) -> None:
    """Refuse what no EMA's ``load_state_dict()`` takes: a ``state_dict`` that is not a
    mapping, and ``assign=True`` (an EMA keeps its own storage)."""
    if not isinstance(state_dict, Mapping):
        raise EMATypeError(
            f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    if assign:
        raise EMAValueError(
            "assign=True is not supported: an EMA keeps its own storage (values are copied in)"
        )


def load_or_restore(load: Callable[[], Any], trackers: Sequence[Any]) -> Any:
    """Run ``load`` (torch's ``load_state_dict``, after `check_loadable()` refused what does
    not fit) and rebuild every tracker's plan; if it fails anyway, put every tracker's
    counters back first and raise (torch's RuntimeError as an
    [`EMAStateError`][emakit.errors.EMAStateError]; emakit's own errors as they are), so a
    failed load changes nothing. Every EMA kind's ``load_state_dict()`` ends here (a
    ``PostHocEMA`` with the trackers of all its profiles)."""
    saved = [t.snapshot() for t in trackers]
    try:
        result = load()
    except Exception as e:
        for tracker, counters in zip(trackers, saved, strict=True):
            tracker.restore(counters)
        if isinstance(e, RuntimeError) and not isinstance(e, EMAError):
            raise EMAStateError(f"{e}\nloading failed; the counters were restored") from e
        raise
    for tracker in trackers:
        tracker.invalidate()
    return result


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def kind_problem(key: str, value: torch.Tensor, mine: torch.Tensor) -> str | None:
    """Why ``value`` may not be copied into the EMA's tensor ``mine``, or None.

    Values are copied into the EMA's own tensors, converting the dtype, so a tensor of
    another *kind* would be changed silently: integers, bools and complex numbers into a
    floating tensor, floats into an integer or bool buffer (truncated). Only floating
    into floating (any width: the shadow keeps its dtype), integer into integer, bool into
    bool, and floating or complex into complex are accepted.
    """
    have, want = _kind(value.dtype), _kind(mine.dtype)
    if have == want or (want == "complex" and have == "floating"):
        return None
    return (
        f"{key!r} holds {str(value.dtype).replace('torch.', '')} ({have}) data, but the EMA's "
        f"tensor is {str(mine.dtype).replace('torch.', '')} ({want}): it would be converted "
        f"silently; the checkpoint is of another model or corrupt"
    )


def tensor_list_like(
    source: str, name: str, values: Any, mine: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``values``, a stored list of tensors (torch_ema's and diffusers' ``shadow_params``),
    checked against the tensors it will be copied into: a list of tensors, as many, each of
    the same shape. Raises `EMAStateError` naming ``source``, ``name`` and the first
    mismatch; changes nothing."""
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, torch.Tensor) for v in values
    ):
        raise EMAStateError(f"{source}: {name} must be a list of tensors, got {values!r:.80}")
    if len(values) != len(mine):
        raise EMAStateError(
            f"{source} holds {len(values)} {name} but this EMA averages {len(mine)} "
            f"parameters; it was saved from other parameters (another model)"
        )
    for i, (v, s) in enumerate(zip(values, mine, strict=True)):
        if v.shape != s.shape:
            raise EMAStateError(
                f"{source}: {name}[{i}] has shape {tuple(v.shape)}, the parameter "
                f"{tuple(s.shape)}; it was saved from other parameters (another model)"
            )
    return list(values)
