"""The evaluations a run folder may name for ``emakit sweep``: a fixed registry, typed
arguments, and the one reader and writer of ``emakit-eval.json``.

A run folder (an ``emakit demo`` output, say) may say how ``emakit sweep FOLDER`` scores
each synthesized EMA, so that the sweep needs no ``--eval``::

    {"eval": "emakit.demo.training:held_out_loss",
     "kwargs": {"seed": 0, "test_fraction": 0.3}}

**The folder is data, never code.** ``"eval"`` is a key of `EVALUATIONS`, looked up as a
string: nothing named in the file is imported, resolved as an attribute or called, nothing
is added to ``sys.path``, and nothing is written. Each keyword of ``"kwargs"`` must be one
the entry declares, of its JSON type and in its range. Anything else (another name, an
unknown key or keyword, a value of the wrong type or out of range, duplicate keys, NaN,
JSON nested too deeply, a file over `MAX_EVAL_FILE_BYTES`, a FIFO or a folder) is refused
with an `EMAStateError` naming the file and the entry, before anything runs. A scoring
function of the user's own comes from the command line (``--eval module:function``), the
user's explicit choice, never from a file.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .. import _validate as check
from .._files.atomic import atomic_write_bytes
from .._files.reading import open_regular, parse_json
from ..demo.settings import SEED_RANGE, TEST_FRACTION_RANGE
from ..errors import EMAError, EMAStateError

__all__ = [
    "EVALUATIONS",
    "EVAL_FILE_NAME",
    "MAX_EVAL_FILE_BYTES",
    "Evaluation",
    "find_eval_file",
    "read_eval_file",
    "write_eval_file",
]

#: The file, in a snapshot folder or the folder above it, naming how ``emakit sweep``
#: scores a length when ``--eval`` is not given. ``emakit demo`` writes one.
EVAL_FILE_NAME = "emakit-eval.json"
#: The largest such file read: a real one is under 200 bytes.
MAX_EVAL_FILE_BYTES = 64 * 1024
#: The keys of the file's top-level object.
_KEYS = ("eval", "kwargs")
#: The longest text of a value from the file shown in a message.
_SHOWN = 80

#: A keyword's check: ``check(keyword, value) -> the value to pass``, raising an EMAError.
ArgumentCheck = Callable[[str, object], object]


@dataclass(frozen=True)
class Evaluation:
    """An entry of `EVALUATIONS`: one of emakit's scoring functions,
    ``function(state_dict, **kwargs) -> float``.

    Attributes:
        summary: what the score is, for messages and docs.
        arguments: each keyword the file may give, with its check (type and range).
        load: returns the function; it imports emakit's own module, chosen here in code.
    """

    summary: str
    arguments: Mapping[str, ArgumentCheck]
    load: Callable[[], Callable[..., float]]


def _held_out_loss() -> Callable[..., float]:
    from ..demo.training import held_out_loss

    return held_out_loss


#: Every evaluation a file may name, by the name it uses; nothing else is reachable.
EVALUATIONS: Mapping[str, Evaluation] = MappingProxyType(
    {
        "emakit.demo.training:held_out_loss": Evaluation(
            summary="the held-out cross-entropy of emakit demo's model (lower is better)",
            arguments=MappingProxyType(
                {
                    "seed": functools.partial(check.integer, low=SEED_RANGE[0], high=SEED_RANGE[1]),
                    "test_fraction": functools.partial(
                        check.real, low=TEST_FRACTION_RANGE[0], high=TEST_FRACTION_RANGE[1]
                    ),
                }
            ),
            load=_held_out_loss,
        ),
    }
)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"the key {_shown(repeated[0])} appears more than once")
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def _checked(name: object, kwargs: object) -> tuple[str, dict[str, object]]:
    """``(name, keywords)`` checked against `EVALUATIONS`; ValueError saying which entry
    is wrong otherwise."""
    if not isinstance(name, str) or name not in EVALUATIONS:
        raise ValueError(
            f'"eval" is {_shown(name)}, which is not one of emakit\'s evaluations '
            f"{sorted(EVALUATIONS)}; to score with a function of your own, pass "
            f"--eval MODULE:FUNCTION on the command line"
        )
    entry = EVALUATIONS[name]
    if not isinstance(kwargs, dict):
        raise ValueError(f'"kwargs" must be a JSON object, got {_shown(kwargs)}')
    unknown = sorted(k for k in kwargs if k not in entry.arguments)
    if unknown:
        raise ValueError(
            f'"kwargs" entry {_shown(unknown[0])} is not a keyword of {name} (it takes '
            f"{sorted(entry.arguments)})"
        )
    checked: dict[str, object] = {}
    for key, value in kwargs.items():
        try:
            checked[key] = entry.arguments[key](key, value)
        except EMAError as e:
            raise ValueError(f'"kwargs" entry {key!r}: {e}') from None
    return name, checked


def read_eval_file(path: Path) -> tuple[str, Callable[..., float]]:
    """The evaluation an ``emakit-eval.json`` names, with its keywords bound.

    Args:
        path: the file.

    Returns:
        ``(name, score)``: the `EVALUATIONS` key and ``score(state_dict) -> float``.

    Raises:
        EMAStateError: the file is not a usable ``emakit-eval.json`` (the message names
            the file and the entry; nothing has run).
        EMAFileNotFoundError, EMAValueError: ``path`` is missing or not a regular file.
    """
    with open_regular(path, EVAL_FILE_NAME) as f:
        data = f.read(MAX_EVAL_FILE_BYTES + 1)
    try:
        if len(data) > MAX_EVAL_FILE_BYTES:
            raise ValueError(f"it is larger than {MAX_EVAL_FILE_BYTES} bytes")
        spec = parse_json(
            data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant
        )
        if not isinstance(spec, dict):
            raise ValueError(f'it must hold a JSON object with "eval", got {_shown(spec)}')
        extra = sorted(k for k in spec if k not in _KEYS)
        if extra:
            raise ValueError(f"the key {_shown(extra[0])} is not one of {list(_KEYS)}")
        if "eval" not in spec:
            raise ValueError('it has no "eval" naming the evaluation')
        name, kwargs = _checked(spec["eval"], spec.get("kwargs", {}))
    except ValueError as e:  # UnicodeDecodeError and malformed JSON included
        raise EMAStateError(f"{path} is not a usable {EVAL_FILE_NAME}: {e}") from None
    return name, functools.partial(EVALUATIONS[name].load(), **kwargs)


def find_eval_file(folder: Path) -> Path | None:
    """``folder``'s ``emakit-eval.json``, else the one in the folder above (a demo run
    keeps its snapshots in a subfolder), else None."""
    for candidate in (folder / EVAL_FILE_NAME, folder.parent / EVAL_FILE_NAME):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return None


def write_eval_file(folder: Path, name: str, **kwargs: object) -> Path:
    """Write ``folder``'s ``emakit-eval.json`` naming ``name`` with ``kwargs``, checked
    by the rules `read_eval_file()` applies (atomically: a failed write leaves the
    previous file).

    Raises:
        EMAStateError: ``name`` is not in `EVALUATIONS`, or a keyword is unknown or out
            of range.
    """
    try:
        _checked(name, kwargs)
    except ValueError as e:
        raise EMAStateError(f"cannot write {EVAL_FILE_NAME}: {e}") from None
    text = json.dumps({"eval": name, "kwargs": kwargs}, indent=2, allow_nan=False) + "\n"
    return atomic_write_bytes(folder / EVAL_FILE_NAME, text.encode())
