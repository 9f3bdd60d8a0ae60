"""safetensors files, written streamed and read back (emakit's own writer and reader).

* :func:`write_safetensors` writes tensors in the safetensors layout one tensor at a time
  (no second copy of the model in host memory), tied and aliased tensors included.
* :func:`read_safetensors` reads a file's tensors and header metadata, or raises an
  :class:`~emakit.EMAError` that names the file.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from .errors import (
    EMAFileNotFoundError,
    EMARuntimeError,
    EMAStateError,
    EMATypeError,
    EMAValueError,
)

__all__ = ["ST_DTYPES", "read_safetensors", "require_file", "write_safetensors"]

#: safetensors dtype codes of the torch dtypes it can store.
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code


def write_safetensors(
    f: IO[bytes],
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``tensors`` in the safetensors layout, one tensor in host memory at a time.

    Layout: 8-byte little-endian header length, a JSON header (padded with spaces to a
    multiple of 8) mapping each name to ``dtype``/``shape``/``data_offsets``, then the raw
    little-endian bytes. Tensors are written widest element first, so each starts aligned
    to its element size. Tensors sharing storage (tied weights, views into one flat
    buffer) are each written in full, which ``safetensors.torch.save_file`` refuses to do.
    Floating tensors are cast to ``dtype`` (when given) one at a time, on the way out.
    """

    def out_dtype(t: Tensor) -> torch.dtype:
        return dtype if (dtype is not None and t.is_floating_point()) else t.dtype

    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in use
        raise EMARuntimeError("save_ema_weights needs a little-endian host")
    sizes = {n: torch.empty(0, dtype=out_dtype(t)).element_size() for n, t in tensors.items()}
    order = sorted(tensors, key=lambda n: -sizes[n])
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t, dt = tensors[name], out_dtype(tensors[name])
        if dt not in ST_DTYPES:
            raise EMATypeError(f"tensor {name!r} has dtype {dt}, which safetensors cannot store")
        nbytes = t.numel() * sizes[name]
        header[name] = {
            "dtype": ST_DTYPES[dt],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in order:
        t = tensors[name].detach()
        t = t.to("cpu", out_dtype(t)).contiguous().reshape(-1)
        if t.numel():
            f.write(t.view(torch.uint8).numpy().data)


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file, or an error naming ``path``."""
    from safetensors import safe_open

    require_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:
        raise EMAStateError(
            f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); it may be "
            f"truncated, corrupt or of another format"
        ) from e
    return tensors, metadata


def require_file(path: Path) -> None:
    """Raise unless ``path`` is an existing file (not a folder)."""
    if not path.exists():
        raise EMAFileNotFoundError(f"checkpoint file {path} does not exist")
    if not path.is_file():
        raise EMAValueError(f"path must be a file, got path={str(path)!r}, which is a folder")
