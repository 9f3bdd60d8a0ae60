"""safetensors files: read through the ``safetensors`` package, written streamed.

**Reading** goes through ``safetensors.safe_open``, which validates the whole header
(lengths, JSON, dtypes, shapes, offsets that tile the data exactly, string metadata)
before any tensor is read and never unpickles. `SafetensorsFile` adds what the package
does not do:

* a FIFO, a socket or a device is refused at once (`open_regular()`): ``safe_open`` would
  wait forever for a FIFO's writer;
* the package reads the very file emakit opened and checked: it is given that open
  descriptor's name (``/dev/fd/N``), not the path. ``safe_open`` opens a path twice, once
  to parse the header and once (torch's ``UntypedStorage.from_file``) to map the data, so a
  save that replaces the path in between would pair one save's header with the next
  save's data (``tests/test_torn_reads.py``). Where there is no ``/dev/fd`` (Windows) the
  path is given, and that pairing stays possible;
* every failure is an [`EMAStateError`][emakit.errors.EMAStateError] that names the file,
  on one line (the package's ``SafetensorError`` names neither);
* a bool tensor holding bytes other than 0 and 1 is refused (the package hands them on).

Tensors come back mapped from the file (copy-on-write), as ``safe_open`` gives them: a
file emakit reads must not be truncated in place meanwhile (emakit's own writes replace
files, see `emakit._files.atomic`).

**Writing** is emakit's one piece of the format, `write_safetensors()`: the header, then
each tensor's bytes, one tensor in host memory at a time. ``safetensors.torch.save_file``
cannot stand in: it refuses tensors that share storage (tied weights, and the views into
one flat buffer that an EMA's shadow is), and it holds a host copy of every tensor at
once (cast to the export dtype, moved off the GPU), where the EMA is one copy of the
model already. Measured (``benchmarks/bench_weights_file.py``, safetensors 0.8): saving a
512 MiB float32 EMA raises the process's peak RSS by 1 MiB with `write_safetensors()` and
by 513 MiB with ``save_file`` (the clone it needs); in bfloat16, by 9 MiB and 257 MiB.
The sharded full export (`emakit._files.export`) writes the header first, from
shapes alone (`safetensors_layout()`), then each tensor as it is gathered
(`write_tensor()`). ``safetensors.torch.load_file`` reads every file written here.

``safetensors`` is imported on first use, not with emakit.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from ..errors import EMARuntimeError, EMAStateError, EMATypeError
from .reading import open_regular

#: safetensors dtype codes of the torch dtypes emakit writes and reads.
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
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_TORCH_DTYPES = {code: dtype for dtype, code in ST_DTYPES.items()}


def out_dtype(t: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is written in: ``dtype`` for a floating tensor when given."""
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


def near_format(found: str, expected: str) -> bool:
    """Whether a header's ``format`` entry ``found`` is ``expected`` with one or two
    characters changed (a flipped bit): a damaged header of that format, not another."""
    same_length = len(found) == len(expected)
    return same_length and sum(a != b for a, b in zip(found, expected, strict=True)) <= 2


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
        raise EMARuntimeError("emakit writes safetensors files on little-endian hosts only")
    out = {name: out_dtype(t, dtype) for name, t in tensors.items()}
    for name, dt in out.items():
        if dt not in ST_DTYPES:
            raise EMATypeError(f"tensor {name!r} has dtype {dt}, which safetensors cannot store")
    order = sorted(tensors, key=lambda name: -out[name].itemsize)
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        nbytes = tensors[name].numel() * out[name].itemsize
        header[name] = {
            "dtype": ST_DTYPES[out[name]],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, order


def write_tensor(f: IO[bytes], t: Tensor, dtype: torch.dtype | None = None) -> None:
    """Append ``t``'s bytes (cast to ``dtype`` when floating and given, moved to the CPU)
    to a file whose header `safetensors_layout()` wrote."""
    t = t.detach().to("cpu", out_dtype(t, dtype)).contiguous().reshape(-1)
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
    views into one flat buffer) are each written in full. Floating tensors are cast to
    ``dtype`` (when given) one at a time, on the way out.
    """
    head, order = safetensors_layout(tensors, metadata, dtype)
    f.write(head)
    for name in order:
        write_tensor(f, tensors[name], dtype)


class SafetensorsFile:
    """One safetensors file, open for reading (``safe_open`` of the file emakit opened).

    Use it as a context manager. The header is validated on opening; tensors are read on
    demand (`get()`).

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
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self._f = open_regular(path, what)
        try:
            st = os.fstat(self._f.fileno())
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            same_file = f"/dev/fd/{self._f.fileno()}"
            try:
                self._st = safe_open(same_file if os.path.exists(same_file) else path, "pt")
            except (SafetensorError, OSError, RuntimeError) as e:
                raise self._bad(" ".join(str(e).split())) from None
            self.metadata: dict[str, str] = self._st.metadata() or {}
            self._names = self._st.keys()
            (n,) = struct.unpack("<Q", self._f.read(8))  # the package checked it
            self.header_digest = hashlib.sha256(self._f.read(n)).hexdigest()
        except BaseException:
            self._f.close()
            raise

    def _bad(self, why: str) -> EMAStateError:
        return EMAStateError(
            f"{self.path} is not a readable safetensors file: {why}; it may be truncated, "
            f"corrupt or of another format"
        )

    def keys(self) -> list[str]:
        """The tensor names, sorted."""
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape."""
        return tuple(self._st.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """A tensor's stored dtype."""
        return _TORCH_DTYPES[str(self._st.get_slice(name).get_dtype())]

    def get(self, name: str) -> Tensor:
        """Read one tensor (a CPU tensor in its stored dtype).

        Raises:
            KeyError: no tensor of that name.
            EMAStateError: a bool tensor holds bytes other than 0/1.
        """
        if name not in self._names:
            raise KeyError(name)
        t: Tensor = self._st.get_tensor(name)
        if t.dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):
            raise self._bad(f"the bool tensor {name!r} holds bytes other than 0 and 1")
        return t

    def close(self) -> None:
        """Close the file."""
        self._st.__exit__(None, None, None)
        self._f.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_safetensors(
    path: str | os.PathLike[str], what: str = "checkpoint file"
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and header metadata of a safetensors file (`SafetensorsFile`).

    Raises:
        EMAFileNotFoundError: ``path`` does not exist.
        EMAValueError: ``path`` is not a regular file.
        EMAStateError: the file is truncated, corrupt or of another format.
    """
    with SafetensorsFile(path, what) as f:
        return {k: f.get(k) for k in f.keys()}, dict(f.metadata)  # noqa: SIM118 - not a dict
