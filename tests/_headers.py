"""Edits of safetensors headers, shared by the tests that damage files on purpose."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def rewrite_metadata(path: Path, **changes: str) -> None:
    """Rewrite ``path``'s safetensors header with ``changes`` in its ``__metadata__``,
    keeping the tensor data as it is."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"].update(changes)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
