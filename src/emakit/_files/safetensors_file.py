"""safetensors files, written streamed and read back (emakit's own writer and reader).

* `write_safetensors()` writes tensors in the safetensors layout one tensor at a time
  (no second copy of the model in host memory), tied and aliased tensors included;
  `safetensors_layout()` and `write_tensor()` are its two halves, for a writer
  that gathers each tensor just before writing it (the sharded full export).
* `SafetensorsFile` reads one: the header and every tensor through **one** open
  file descriptor, so a reader sees exactly one complete save even while another process
  replaces the file (emakit's writes are atomic renames: the open descriptor keeps the
  file it opened). ``safetensors.safe_open`` parses the header from one open and maps the
  data by name with a second one, which can pair one save's header with the next save's
  data. The header is validated in full (lengths, JSON, dtypes, shapes, offsets that
  tile the data exactly, string metadata) before any tensor is read.
* `read_safetensors()` reads a file's tensors and header metadata, or raises an
  [`EMAError`][emakit.errors.EMAError] that names the file.

Nothing here unpickles: a safetensors file is a JSON header and raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
from torch import Tensor

from ..errors import EMARuntimeError, EMAStateError, EMATypeError
from .reading import open_regular

__all__ = [
    "MAX_HEADER_BYTES",
    "ST_DTYPES",
    "SafetensorsFile",
    "read_safetensors",
    "safetensors_layout",
    "write_safetensors",
    "write_tensor",
]

#: Longest JSON header read (safetensors' own limit): a corrupt length is refused, not
#: allocated.
MAX_HEADER_BYTES = 100_000_000

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


def safetensors_layout(
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> tuple[bytes, list[str]]:
    """The start of a safetensors file for ``tensors`` and the order their bytes follow in.

    Only names, dtypes and shapes are read (a ``DTensor``'s global shape is its shape), so
    the header can be written before any tensor is gathered. Returns ``(head, order)``:
    ``head`` is the 8-byte little-endian header length and the JSON header (padded with
    spaces to a multiple of 8) mapping each name to ``dtype``/``shape``/``data_offsets``;
    ``order`` lists the names widest element first (so each tensor starts aligned to its
    element size), then by the order of ``tensors``. Floating tensors are described in
    ``dtype`` when given.

    Raises:
        EMATypeError: a tensor's dtype cannot be stored in safetensors.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in use
        raise EMARuntimeError("save_ema_weights needs a little-endian host")
    out = {n: _out_dtype(t, dtype) for n, t in tensors.items()}
    sizes = {n: torch.empty(0, dtype=dt).element_size() for n, dt in out.items()}
    order = sorted(tensors, key=lambda n: -sizes[n])
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t, dt = tensors[name], out[name]
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
    return struct.pack("<Q", len(blob)) + blob, order


def _out_dtype(t: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def write_tensor(f: IO[bytes], t: Tensor, dtype: torch.dtype | None = None) -> None:
    """Append ``t``'s bytes (cast to ``dtype`` when floating and given, moved to the CPU)
    to a file whose header `safetensors_layout()` wrote."""
    t = t.detach()
    t = t.to("cpu", _out_dtype(t, dtype)).contiguous().reshape(-1)
    if t.numel():
        f.write(t.view(torch.uint8).numpy().data)


def write_safetensors(
    f: IO[bytes],
    tensors: Mapping[str, Tensor],
    metadata: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``tensors`` in the safetensors layout, one tensor in host memory at a time.

    The layout is `safetensors_layout()`'s: the header, then each tensor's raw
    little-endian bytes, widest element first. Tensors sharing storage (tied weights,
    views into one flat buffer) are each written in full, which
    ``safetensors.torch.save_file`` refuses to do. Floating tensors are cast to ``dtype``
    (when given) one at a time, on the way out.
    """
    head, order = safetensors_layout(tensors, metadata, dtype)
    f.write(head)
    for name in order:
        write_tensor(f, tensors[name], dtype)


class SafetensorsFile:
    """One safetensors file, open for reading: header and data through one descriptor.

    Use it as a context manager. The header is read and validated on opening; tensors are
    read on demand (`get()`), each into its own memory, from the same descriptor.

    Args:
        path: the file.
        what: what the file is, for messages (``"checkpoint file"``, ``"snapshot"``).

    Attributes:
        path: the file.
        metadata: the header's ``__metadata__`` (``{}`` when absent), str -> str.
        header_digest: SHA-256 (hex) of the header bytes: two opens saw the same save when
            their digests and `identity` agree.
        identity: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the open file.

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is a folder, a FIFO or another non-regular file.
        EMAStateError: the file is truncated, or its header is malformed (the message
            names the file and what is wrong, on one line).

    Example:
        >>> import tempfile, torch
        >>> path = tempfile.mkdtemp() + "/w.safetensors"
        >>> with open(path, "wb") as f:
        ...     write_safetensors(f, {"w": torch.ones(2)}, {"note": "hi"})
        >>> with SafetensorsFile(path) as f:
        ...     f.metadata, f.get("w")
        ({'note': 'hi'}, tensor([1., 1.]))
    """

    def __init__(self, path: str | os.PathLike[str], what: str = "file") -> None:
        self.path = Path(path)
        self._f = open_regular(path, what)
        try:
            st = os.fstat(self._f.fileno())
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            self._parse(st.st_size)
        except BaseException:
            self._f.close()
            raise

    def _bad(self, why: str) -> EMAStateError:
        return EMAStateError(
            f"{self.path} is not a readable safetensors file: {why}; it may be truncated, "
            f"corrupt or of another format"
        )

    def _parse(self, size: int) -> None:
        head = self._f.read(8)
        if len(head) < 8:
            raise self._bad(f"it is {size} bytes long, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or n + 8 > size:
            raise self._bad(
                f"its header length field says {n} bytes, but the file holds {size - 8} "
                f"after it (limit {MAX_HEADER_BYTES})"
            )
        raw = self._f.read(n)
        if len(raw) != n:
            raise self._bad(f"its header ends after {len(raw)} of {n} bytes")
        self.header_digest = hashlib.sha256(raw).hexdigest()
        try:
            header = json.loads(
                raw.decode("utf-8"),
                object_pairs_hook=_unique_keys,
                parse_constant=_no_constant,
            )
        except (UnicodeDecodeError, ValueError) as e:
            raise self._bad(f"its header is not valid UTF-8 JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._bad(f"its header is a JSON {type(header).__name__}, not an object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad("its __metadata__ is not a mapping of strings to strings")
        self.metadata: dict[str, str] = meta
        self._start = 8 + n
        data = size - self._start
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        spans = []
        for name, entry in header.items():
            dtype, shape, begin, end = self._entry(name, entry)
            width = torch.empty(0, dtype=dtype).element_size()
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * width:
                raise self._bad(
                    f"tensor {name!r} ({entry['dtype']} {list(shape)}) needs {numel * width} "
                    f"bytes but its data_offsets {[begin, end]} span {end - begin}"
                )
            self._entries[name] = (dtype, shape, begin, end)
            spans.append((begin, end, name))
        spans.sort()
        at = 0
        for begin, end, name in spans:
            if begin != at:
                raise self._bad(
                    f"tensor {name!r} starts at byte {begin} of the data, expected {at} "
                    f"(tensors must tile the data without gaps or overlaps)"
                )
            at = end
        if at != data:
            raise self._bad(f"its tensors cover {at} bytes of data, but the file holds {data}")

    def _entry(self, name: str, entry: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if not isinstance(entry, dict):
            raise self._bad(f"the header entry of tensor {name!r} is not an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        dtype = _CODES.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise self._bad(f"tensor {name!r} has dtype {code!r}, which emakit does not read")
        if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
            raise self._bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes >= 0")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_nonneg_int(o) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise self._bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
        return dtype, tuple(shape), offsets[0], offsets[1]

    def keys(self) -> list[str]:
        """The tensor names, in header order."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return self._entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype."""
        return self._entries[name][0]

    def code(self, name: str) -> str:
        """A tensor's safetensors dtype code (``"F32"``, ``"I64"``...)."""
        return ST_DTYPES[self._entries[name][0]]

    def get(self, name: str) -> Tensor:
        """Read one tensor (a fresh CPU tensor in its stored dtype).

        Raises:
            KeyError: no tensor of that name.
            EMAStateError: the file ends early, or a bool tensor holds bytes other than 0/1.
        """
        dtype, shape, begin, end = self._entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        if end > begin:
            self._f.seek(self._start + begin)
            got = self._f.readinto(buf.numpy())  # type: ignore[arg-type]
            if got != end - begin:
                raise self._bad(f"it ends inside tensor {name!r}")
        if dtype == torch.bool and bool((buf > 1).any()):
            raise self._bad(f"the bool tensor {name!r} holds bytes other than 0 and 1")
        return buf.view(dtype).reshape(shape)

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


#: torch dtype of each safetensors dtype code emakit reads.
_CODES = {code: dtype for dtype, code in ST_DTYPES.items()}


def _nonneg_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_safetensors(
    path: str | os.PathLike[str], what: str = "checkpoint file"
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file, read through one open file.

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is not a regular file.
        EMAStateError: the file is truncated, corrupt or of another format.
    """
    with SafetensorsFile(path, what) as f:
        return {k: f.get(k) for k in f.keys()}, dict(f.metadata)  # noqa: SIM118 - not a dict
