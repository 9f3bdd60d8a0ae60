"""emakit's safetensors reader and writer (`emakit._files.safetensors_file`), unit by unit.

Written for the mutants that survived the suite (docs/development.md, "Mutation testing"):
each test pins one behaviour a change of the code would alter, against the
``safetensors`` package or the format's definition.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from emakit._files.safetensors_file import (
    SafetensorsFile,
    near_format,
    out_dtype,
    read_safetensors,
    safetensors_layout,
    write_safetensors,
    write_tensor,
)
from emakit.errors import EMAStateError


def written(tmp_path: Path, tensors: dict[str, torch.Tensor], dtype=None, name="t") -> Path:
    path = tmp_path / f"{name}.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, tensors, {"k": "v"}, dtype)
    return path


def header_of(path: Path) -> tuple[int, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, data[8 : 8 + n]


def test_out_dtype_casts_floating_tensors_only() -> None:
    assert out_dtype(torch.zeros(1), torch.bfloat16) == torch.bfloat16
    assert out_dtype(torch.zeros(1), None) == torch.float32
    assert out_dtype(torch.zeros(1, dtype=torch.int64), torch.bfloat16) == torch.int64


def test_a_dtype_casts_floating_tensors_on_the_way_out(tmp_path: Path) -> None:
    w = torch.randn(5, 3, dtype=torch.float32)
    n = torch.arange(4)
    path = written(tmp_path, {"w": w, "n": n}, dtype=torch.bfloat16)
    got = load_file(path)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))
    assert got["n"].dtype == torch.int64 and torch.equal(got["n"], n)
    with SafetensorsFile(path) as f:
        assert f.dtype("w") == torch.bfloat16 and f.shape("w") == (5, 3)


def test_write_tensor_casts_and_flattens() -> None:
    t = torch.randn(3, 4).t()  # not contiguous
    buf = io.BytesIO()
    write_tensor(buf, t, torch.float16)
    assert buf.getvalue() == t.contiguous().to(torch.float16).numpy().tobytes()
    buf = io.BytesIO()
    write_tensor(buf, t)
    assert buf.getvalue() == t.contiguous().numpy().tobytes()
    buf = io.BytesIO()
    write_tensor(buf, torch.zeros(0))
    assert buf.getvalue() == b""


@pytest.mark.parametrize(
    ("found", "same"),
    [("abcd", True), ("abcX", True), ("aXcX", True), ("XXcX", False), ("abc", False)],
)
def test_near_format_allows_two_flipped_characters(found: str, same: bool) -> None:
    assert near_format(found, "abcd") is same


def test_layout_orders_widest_first_then_as_given_and_pads_to_8(tmp_path: Path) -> None:
    tensors = {
        "a": torch.zeros(3, dtype=torch.int8),
        "b": torch.zeros(2, dtype=torch.float64),
        "c": torch.zeros(1, dtype=torch.float32),
        "d": torch.zeros(1, dtype=torch.float64),
        "e": torch.zeros(2, dtype=torch.float16),
    }
    head, order = safetensors_layout(tensors, {})
    assert order == ["b", "d", "c", "e", "a"]
    (n,) = struct.unpack("<Q", head[:8])
    blob = head[8:]
    assert n == len(blob) and n % 8 == 0
    text = blob.decode()
    assert text == text.rstrip() + " " * (len(text) - len(text.rstrip()))
    assert len(text) - len(text.rstrip()) < 8  # no more padding than needed
    header = json.loads(text)
    assert ", " not in text.rstrip() and '": ' not in text  # compact separators
    assert header["b"]["data_offsets"] == [0, 16] and header["a"]["data_offsets"] == [32, 35]
    for names in ("a", "ab", "abc", "abcd", "abcde"):  # headers of several lengths
        head, _ = safetensors_layout({k: tensors[k] for k in names}, {"x": "y" * len(names)})
        assert (len(head) - 8) % 8 == 0 and struct.unpack("<Q", head[:8])[0] == len(head) - 8
        stripped = head[8:].rstrip(b" ")
        assert len(head) - 8 - len(stripped) == -len(stripped) % 8


def test_a_dtype_safetensors_cannot_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"tensor 'z' has dtype torch.complex128"):
        safetensors_layout({"z": torch.zeros(1, dtype=torch.complex128)}, {})


def test_the_file_identity_and_header_digest(tmp_path: Path) -> None:
    path = written(tmp_path, {"w": torch.ones(3)})
    _, header = header_of(path)
    with SafetensorsFile(path) as f:
        st = os.stat(path)
        assert f.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        assert f.header_digest == hashlib.sha256(header).hexdigest()
        assert f.metadata == {"k": "v"}
    # the same bytes written again: a new mtime, so another identity, the same digest
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    with SafetensorsFile(path) as f:
        assert f.identity[:3] == (st.st_dev, st.st_ino, st.st_size)
        assert f.identity[3] == st.st_mtime_ns + 1000
        assert f.header_digest == hashlib.sha256(header).hexdigest()
    # a header that differs only after its 64th byte has another digest
    long = {f"tensor_with_a_long_name_{i}": torch.ones(1) for i in range(3)}
    p1 = written(tmp_path, long, name="p1")
    p2 = written(tmp_path, {**long, "tensor_with_a_long_name_2": torch.ones(2)}, name="p2")
    assert header_of(p1)[1][:64] == header_of(p2)[1][:64]
    with SafetensorsFile(p1) as f1, SafetensorsFile(p2) as f2:
        assert f1.header_digest != f2.header_digest


def test_the_reader_keeps_the_file_it_opened(tmp_path: Path) -> None:
    """A save replacing the path after the open does not reach the tensors read."""
    path = written(tmp_path, {"w": torch.ones(4)})
    other = written(tmp_path, {"w": torch.full((4,), 2.0)}, name="other")
    with SafetensorsFile(path) as f:
        os.replace(other, path)
        assert torch.equal(f.get("w"), torch.ones(4))


def test_errors_name_the_file_what_it_is_and_the_packages_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 2) + b"{]")
    with pytest.raises(EMAStateError) as info:
        SafetensorsFile(path, "snapshot")
    text = str(info.value)
    assert text.startswith(f"{path} is not a readable safetensors file: ")
    reason = text.split(": ", 1)[1].split("; it may be")[0]
    assert reason and reason != "None" and "  " not in reason and "XX" not in reason
    assert " " in reason  # the package's words, joined by single spaces
    with pytest.raises(FileNotFoundError, match=r"^file "):  # the default
        SafetensorsFile(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"^snapshot "):
        SafetensorsFile(tmp_path / "missing.safetensors", "snapshot")
    with pytest.raises(FileNotFoundError, match=r"^checkpoint file "):
        read_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"^weights "):
        read_safetensors(tmp_path / "missing.safetensors", "weights")


def test_get_refuses_unknown_names_and_bool_bytes_other_than_0_and_1(tmp_path: Path) -> None:
    path = written(tmp_path, {"b": torch.tensor([True, False, True])})
    with SafetensorsFile(path) as f:
        assert torch.equal(f.get("b"), torch.tensor([True, False, True]))
        with pytest.raises(KeyError) as info:
            f.get("nope")
        assert info.value.args == ("nope",)
    for byte in (2, 255):  # 255 is -1 as an int8: the check reads unsigned bytes
        data = bytearray(path.read_bytes())
        data[-2] = byte
        bad = tmp_path / f"bad{byte}.safetensors"
        bad.write_bytes(bytes(data))
        with SafetensorsFile(bad) as f, pytest.raises(EMAStateError) as info:
            f.get("b")
        assert "the bool tensor 'b' holds bytes other than 0 and 1" in str(info.value)
        assert str(bad) in str(info.value)


def test_read_safetensors_returns_every_tensor_and_the_metadata(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(2, 2), "n": torch.arange(3)}
    got, metadata = read_safetensors(written(tmp_path, tensors))
    assert metadata == {"k": "v"} and got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
