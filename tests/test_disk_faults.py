"""Disk full and odd paths (issue 14, item 11).

* A full disk while a step's post-hoc snapshots are written: an ``OSError`` naming the
  path (an ``EMAWriteError``), and none of the step's files (all or nothing).
* A file or folder name that is not UTF-8 is refused when writing, not written unreadable.
* ``emakit inspect`` (and the loaders) refuse a FIFO instead of waiting forever.
* Malformed headers give a one-line error, never a traceback.
* ``inspect`` on an unrelated file never repeats torch's advice to use weights_only=False.

Everything that could hang runs in a forked child waited for with a bound; nothing sleeps.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import pickle
import signal
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
from click.testing import CliRunner
from torch import nn

from _models import bn_mlp
from emakit import EMA, EMAError, EMAValueError, PostHocEMA
from emakit.checkpoint import load_ema_weights, save_ema_weights
from emakit.inspection import inspect_cmd
from emakit.posthoc.commands import synthesize
from emakit.posthoc.snapshots import format as snapshots_module

JOIN_S = 30  # the bound on anything that could block


def posthoc(folder: Path, **kw: object) -> tuple[nn.Module, PostHocEMA]:
    net = bn_mlp(4, 8, 2)
    ema = PostHocEMA(
        net, update_every=1, checkpoint_every_num_steps=5, checkpoint_folder=folder, **kw
    )
    return net, ema


def steps(ema: PostHocEMA, n: int) -> None:
    for _ in range(n):
        ema.update()


# -- a full disk ------------------------------------------------------------------------------


class DiskFull:
    """Fails the ``fail_on``-th snapshot file written with ENOSPC, half-way through."""

    def __init__(self, fail_on: int, real: Callable) -> None:
        self.calls, self.fail_on, self.real = 0, fail_on, real

    def write_safetensors(self, f, tensors, metadata, dtype=None):  # emakit's writer
        self.calls += 1
        if self.calls == self.fail_on:
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(f, tensors, metadata, dtype)

    def write_tensor(self, f, t, dtype=None):  # emakit's streamed EMA weights writer
        self.calls += 1
        if self.calls == self.fail_on:
            f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def save_file(self, tensors, filename, metadata=None):  # safetensors' writer
        self.calls += 1
        if self.calls == self.fail_on:
            Path(filename).write_bytes(b"\0" * 100)
            raise safetensors.SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull })"
            )
        return self.real(tensors, filename, metadata=metadata)


def test_disk_full_mid_step_writes_none_of_the_steps_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch

    _, ema = posthoc(tmp_path)
    steps(ema, 5)  # step 5: two snapshots written
    before = {p: p.read_bytes() for p in tmp_path.glob("step-*")}
    assert len(before) == 2
    ours = getattr(snapshots_module, "write_safetensors", None)
    if ours is not None:
        monkeypatch.setattr(
            snapshots_module, "write_safetensors", DiskFull(2, ours).write_safetensors
        )
    theirs = DiskFull(2, safetensors.torch.save_file)
    monkeypatch.setattr(safetensors.torch, "save_file", theirs.save_file)
    with pytest.raises(OSError) as info:  # the second profile's file of step 10
        steps(ema, 5)
    assert isinstance(info.value, EMAError) and info.value.errno == errno.ENOSPC
    assert "step-000000010" in str(info.value)  # names the files
    files = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".emakit-posthoc"))
    assert files == sorted(p.name for p in before), files  # no step-10 file, no temporary
    assert {p: p.read_bytes() for p in before} == before
    monkeypatch.undo()  # space freed: the next step writes its whole set
    steps(ema, 5)
    assert len(list(tmp_path.glob("step-000000015*"))) == 2


def test_disk_full_while_saving_ema_weights_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from emakit._files import export

    path = tmp_path / "ema.safetensors"
    ema = EMA(nn.Linear(2, 2))
    save_ema_weights(ema, path)
    before = path.read_bytes()
    monkeypatch.setattr(export, "write_tensor", DiskFull(1, None).write_tensor)
    with pytest.raises(OSError) as info:
        save_ema_weights(ema, path)
    assert isinstance(info.value, EMAError) and info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value) and path.read_bytes() == before


def test_a_full_disk_during_save_sharded_ema_names_enospc_and_removes_the_partial_folder(
    tmp_path: Path, monkeypatch
):
    import torch.distributed.checkpoint.filesystem as fs

    from emakit import EMARuntimeError
    from emakit.distributed import load_sharded_ema, save_sharded_ema

    ema = EMA(nn.Linear(3, 2))
    save_sharded_ema(ema, tmp_path)
    (previous,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]

    def full(*args, **kwargs):  # what torch's zip writer raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(EMARuntimeError, match=rf"ENOSPC.*{tmp_path}.*partial version folder"):
        save_sharded_ema(ema, tmp_path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [previous]  # no partial
    load_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)  # the previous one is still current


# -- names that are not UTF-8 ----------------------------------------------------------------

NOT_UTF8 = os.fsdecode(b"run-\xff\xfe")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX byte file names")
def test_a_non_utf8_checkpoint_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / NOT_UTF8
    with pytest.raises(EMAValueError, match=r"checkpoint_folder.*UTF-8"):
        posthoc(folder)
    assert not folder.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX byte file names")
def test_a_non_utf8_file_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / f"{NOT_UTF8}.safetensors"
    with pytest.raises(EMAValueError, match="UTF-8"):
        save_ema_weights(EMA(nn.Linear(2, 2)), path)
    with pytest.raises(EMAValueError, match="UTF-8"):
        snapshots_module.write_snapshot(
            path, {"w": torch.zeros(1)}, step=1, t=1, gamma=1.0, sigma_rel=0.2, profile=0,
            update_every=1, copied=set(),
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


# -- FIFOs ------------------------------------------------------------------------------------


def bounded(fn: Callable[[], object]) -> object:
    """``fn()`` in a forked child, waited for with a bound (a call blocked on a FIFO may
    hold the GIL, so a thread cannot be waited for); its result or its exception comes
    back through a pipe, and a child still blocked after the bound is killed."""
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            writer.send(("value", fn()))
        except BaseException as e:  # reported to the test
            writer.send(("error", (type(e), str(e))))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        proc = ctx.Process(target=child, daemon=True)
        proc.start()
    writer.close()
    try:
        if not reader.poll(JOIN_S):
            pytest.fail(f"blocked for {JOIN_S} s on a FIFO")
        kind, payload = reader.recv()
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(JOIN_S)
    if kind == "error":
        error, message = payload
        raise error(message)
    return payload


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["ema.safetensors", "ema.pt"])
def test_inspect_refuses_a_fifo(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)

    def inspect() -> tuple[int, str]:
        result = CliRunner().invoke(inspect_cmd, [str(fifo)])
        return result.exit_code, result.output

    code, output = bounded(inspect)  # type: ignore[misc]
    assert code == 1 and "FIFO" in output, output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_loaders_refuse_a_fifo(tmp_path: Path) -> None:
    from emakit.foreign import load_foreign_state

    fifo = tmp_path / "ema.safetensors"
    os.mkfifo(fifo)
    for load in (load_ema_weights, load_foreign_state):
        with pytest.raises(EMAValueError, match="FIFO"):
            bounded(lambda load=load: load(EMA(nn.Linear(2, 2)), fifo))


def test_a_fifo_as_the_sharded_pointer_file_is_refused_not_waited_on(tmp_path: Path):
    import os
    import threading

    from emakit.distributed import load_sharded_ema, save_sharded_ema

    ema = EMA(nn.Linear(3, 2))
    save_sharded_ema(ema, tmp_path)
    pointer = tmp_path / "emakit-sharded.json"
    pointer.unlink()
    os.mkfifo(pointer)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # the hang this replaces: unblock the reader, then fail
        with open(pointer, "wb"):
            pass
        worker.join(timeout=10)
        pytest.fail("load_sharded_ema waited on a FIFO")
    (error,) = outcome
    assert isinstance(error, EMAError) and "FIFO" in str(error), error


# -- malformed headers: one line, no traceback ------------------------------------------------


def safetensors_bytes(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(blob) if length is None else length
    return struct.pack("<Q", n) + blob + data


MALFORMED = {
    "empty": b"",
    "truncated length": b"\x05\x00",
    "huge header length": struct.pack("<Q", 2**60) + b"{}",
    "header longer than the file": safetensors_bytes({}, length=500),
    "not JSON": safetensors_bytes(b"{not json"),
    "a JSON list": safetensors_bytes([1, 2]),
    "unknown dtype": safetensors_bytes(
        {"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "offsets past the end": safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 4
    ),
    "a float shape": safetensors_bytes(
        {"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "metadata not strings": safetensors_bytes({"__metadata__": {"step": 3}}),
    "snapshot with a bad profile": safetensors_bytes(
        {
            "__metadata__": {
                "format": "emakit.posthoc.snapshot",
                "format_version": "1",
                "step": "5",
                "gamma": "6.9",
                "sigma_rel": "0.1",
                "profile": "zero",
            }
        }
    ),
    "weights with a damaged format": safetensors_bytes(
        {"__metadata__": {"format": "emakit.ema_weighus", "format_version": "1", "step": "7"}}
    ),
}


def one_line_error(result) -> None:
    assert result.exit_code == 1, result.output
    assert type(result.exception) is SystemExit, repr(result.exception)  # not a crash
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_inspect_prints_one_line_for_a_malformed_header(tmp_path: Path, case: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(MALFORMED[case])
    one_line_error(CliRunner().invoke(inspect_cmd, [str(path)]))


def test_synthesize_prints_one_line_for_a_malformed_snapshot(tmp_path: Path) -> None:
    _, ema = posthoc(tmp_path)
    steps(ema, 10)
    (tmp_path / "step-000000011_x.safetensors").write_bytes(
        MALFORMED["snapshot with a bad profile"]
    )
    out = tmp_path / "out.safetensors"
    args = [str(tmp_path), "--sigma-rel", "0.1", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(synthesize, args)
    one_line_error(result)
    assert "profile" in result.output
    one_line_error(CliRunner().invoke(inspect_cmd, [str(tmp_path)]))


# -- unrelated torch files --------------------------------------------------------------------


class Gadget:
    def __init__(self) -> None:
        self.x = 1


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("what", ["an object", "text", "a pickle"])
def test_inspect_never_advises_weights_only_false(tmp_path: Path, what: str) -> None:
    path = tmp_path / "thing.pt"
    if what == "an object":
        torch.save({"gadget": Gadget()}, path)
    elif what == "text":
        path.write_text("hello, not a checkpoint\n")
    else:
        path.write_bytes(pickle.dumps(Gadget()))
    result = CliRunner().invoke(inspect_cmd, [str(path)])
    one_line_error(result)
    text = result.output.replace("`", "").lower()
    assert "weights_only=false" not in text and "weights_only set to false" not in text
