"""Atomic writes (emakit._files.atomic): replace-or-nothing, permissions, and stale temporary
files; and the saves built on them (``save_checkpoint``, ``save_ema_weights``, snapshots): the
data and then its folder synced around the rename, the old file kept on failure, a killed
save's temporary file removed by the next save."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import _peers
from _models import TINY_LORA_POSTHOC, TINY_LORA_SGD, TinyLora, train
from emakit import EMA, PostHocEMA
from emakit._files import atomic as _io
from emakit._files.atomic import (
    TEMP_PREFIX,
    atomic_path,
    atomic_paths,
    atomic_write,
    atomic_write_bytes,
    remove_stale_temps,
)
from emakit.checkpoint import save_checkpoint, save_ema_weights

IO_FILE = Path(_io.__file__)
posix_only = pytest.mark.skipif(_io.fcntl is None, reason="needs POSIX flock")


def temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if TEMP_PREFIX in p.name)


def fake_temp(folder: Path, dest: str = "ckpt.pt") -> Path:
    p = folder / f".{dest}{TEMP_PREFIX}abc123"
    p.write_bytes(b"half a checkpoint")
    return p


# Loads _io.py on its own (it imports nothing from emakit), so children start fast.
CHILD_PRELUDE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("emakit_io", {str(IO_FILE)!r})
io = importlib.util.module_from_spec(spec); spec.loader.exec_module(io)
"""


def test_write_creates_folders_and_replaces(tmp_path):
    dest = tmp_path / "a" / "b" / "file.bin"
    assert atomic_write_bytes(dest, b"one") == dest
    assert dest.read_bytes() == b"one"
    atomic_write(dest, lambda f: f.write(b"two"))
    assert dest.read_bytes() == b"two"
    assert temps(dest.parent) == []


def test_atomic_path_with_a_named_writer(tmp_path):
    dest = tmp_path / "w.pt"
    with atomic_path(dest) as tmp:
        assert tmp.parent == tmp_path and TEMP_PREFIX in tmp.name
        assert not dest.exists()
        torch.save({"w": torch.arange(3)}, tmp)
    assert torch.equal(torch.load(dest)["w"], torch.arange(3))
    assert temps(tmp_path) == []


def test_failure_keeps_previous_file_and_removes_temp(tmp_path):
    dest = tmp_path / "file.bin"
    atomic_write_bytes(dest, b"previous")

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        atomic_write(dest, boom)
    assert dest.read_bytes() == b"previous"
    assert temps(tmp_path) == []

    def interrupted() -> None:
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"partial")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert dest.read_bytes() == b"previous"
    assert temps(tmp_path) == []


def test_before_replace_sees_complete_files_and_can_veto_the_replace(tmp_path):
    """The hook of a write several processes make together: called once every temporary
    file is complete, before any rename; if it raises, nothing is replaced."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    atomic_write_bytes(a, b"old a")
    atomic_write_bytes(b, b"old b")
    seen: list[list[bytes]] = []

    def veto() -> None:
        seen.append([t.read_bytes() for t in temps(tmp_path)])
        raise OSError(28, "another process could not write")

    def write(hook) -> None:
        with atomic_paths([a, b], before_replace=hook) as (ta, tb):
            ta.write_bytes(b"new a")
            tb.write_bytes(b"new b")

    with pytest.raises(OSError, match="another process"):
        write(veto)
    assert sorted(seen[0]) == [b"new a", b"new b"]  # both complete when it was asked
    assert (a.read_bytes(), b.read_bytes()) == (b"old a", b"old b")
    assert temps(tmp_path) == []
    calls: list[int] = []
    write(lambda: calls.append(1))
    assert calls == [1] and (a.read_bytes(), b.read_bytes()) == (b"new a", b"new b")


def test_new_file_gets_umask_mode_and_existing_mode_is_kept(tmp_path):
    old = os.umask(0o027)
    try:
        dest = tmp_path / "new.bin"
        atomic_write_bytes(dest, b"x")
        assert stat.S_IMODE(dest.stat().st_mode) == 0o640  # not mkstemp's 0o600
    finally:
        os.umask(old)
    dest.chmod(0o604)
    atomic_write_bytes(dest, b"y")
    assert stat.S_IMODE(dest.stat().st_mode) == 0o604
    dest.chmod(0o444)  # read-only: replaced all the same (the folder is writable), mode kept
    atomic_write(dest, lambda f: torch.save(torch.zeros(1), f))
    assert stat.S_IMODE(dest.stat().st_mode) == 0o444
    assert torch.equal(torch.load(dest), torch.zeros(1))


def test_long_destination_name(tmp_path):
    dest = tmp_path / ("n" * 240 + ".pt")
    atomic_write_bytes(dest, b"ok")
    assert dest.read_bytes() == b"ok"


def test_concurrent_writers_of_one_file(tmp_path):
    dest = tmp_path / "shared.bin"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=atomic_write_bytes, args=(dest, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dest.read_bytes() in payloads
    assert temps(tmp_path) == []


@posix_only
def test_unlocked_leftover_is_removed_by_next_write(tmp_path):
    left = fake_temp(tmp_path, "other.pt")
    (tmp_path / ".hidden").write_bytes(b"not ours")
    folder_like = tmp_path / f".x{TEMP_PREFIX}dir"
    folder_like.mkdir()
    atomic_write_bytes(tmp_path / "ckpt.pt", b"data")
    assert not left.exists()
    assert (tmp_path / ".hidden").exists() and folder_like.is_dir()
    assert temps(tmp_path) == [folder_like]


@posix_only
def test_temp_locked_by_a_live_writer_is_kept(tmp_path):
    held = fake_temp(tmp_path)
    code = (
        CHILD_PRELUDE
        + f"""
import fcntl, os
fd = os.open({str(held)!r}, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # holds the lock until killed
"""
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        assert remove_stale_temps(tmp_path) == []
        assert held.exists()
    finally:
        child.kill()
        child.wait()
    assert remove_stale_temps(tmp_path) == [held]  # the lock died with the process


def test_own_live_temp_is_kept(tmp_path, monkeypatch):
    # Even where locks are per process (fcntl emulation on NFS), this process's own
    # in-flight temporary files are never taken for leftovers.
    monkeypatch.setattr(_io, "STALE_TEMP_AGE_S", 0.0)
    with atomic_path(tmp_path / "outer.pt") as outer:
        outer.write_bytes(b"outer")
        os.utime(outer, (time.time() - 10, time.time() - 10))
        atomic_write_bytes(tmp_path / "inner.pt", b"inner")
        monkeypatch.setattr(_io, "fcntl", None)
        assert remove_stale_temps(tmp_path) == []
        assert outer.exists()
    assert (tmp_path / "outer.pt").read_bytes() == b"outer"


def test_a_finished_write_is_no_longer_this_processs_own(tmp_path):
    """The set of this process's in-flight temporary files and staging folders is empty
    once the writes are done, failed ones included: it neither grows with every write nor
    shields a path from a later cleaner."""
    atomic_write_bytes(tmp_path / "a.pt", b"a")
    with _io.atomic_folder(tmp_path / "folder") as staged:
        (staged / "x").write_bytes(b"x")
    try:
        with atomic_path(tmp_path / "b.pt") as tmp:
            tmp.write_bytes(b"b")
            raise RuntimeError("the writer failed")
    except RuntimeError:
        pass
    assert _io._live == set()


def test_without_locks_leftovers_expire_by_age(tmp_path, monkeypatch):
    monkeypatch.setattr(_io, "fcntl", None)
    fresh, old = fake_temp(tmp_path, "a.pt"), fake_temp(tmp_path, "b.pt")
    past = time.time() - _io.STALE_TEMP_AGE_S - 60
    os.utime(old, (past, past))
    atomic_write_bytes(tmp_path / "c.pt", b"c")
    assert fresh.exists() and not old.exists()
    assert (tmp_path / "c.pt").read_bytes() == b"c"


@posix_only
def test_sigkill_mid_write_leaves_one_temp_then_cleaned(tmp_path):
    dest = tmp_path / "ckpt.bin"
    atomic_write_bytes(dest, b"previous")
    code = (
        CHILD_PRELUDE
        + f"""
with io.atomic_path({str(dest)!r}) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half")
        f.flush()
        print("writing", flush=True)
        sys.stdin.read()  # stops here, mid-write, until killed
"""
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait()
    # No cleanup runs on SIGKILL: the previous file is whole and one temp file remains.
    assert dest.read_bytes() == b"previous"
    (left,) = temps(tmp_path)
    assert left.read_bytes() == b"half"
    atomic_write_bytes(dest, b"next")
    assert dest.read_bytes() == b"next"
    assert temps(tmp_path) == []


def test_remove_stale_temps_never_raises(tmp_path):
    assert remove_stale_temps(tmp_path / "missing") == []


@posix_only
def test_lock_entry_holds_what_the_name_names_and_refuses_a_held_lock(tmp_path, monkeypatch):
    path = tmp_path / "entry"
    path.write_bytes(b"first")
    flock = _io.fcntl.flock
    replaced = []

    def replace_then_lock(fd: int, op: int) -> None:
        if not replaced:  # another process replaces the entry between the open and the lock
            replaced.append(True)
            path.unlink()
            path.write_bytes(b"second")
        flock(fd, op)

    monkeypatch.setattr(_io.fcntl, "flock", replace_then_lock)
    fd = _io.lock_entry(path, os.O_RDWR)
    assert fd is not None and os.pread(fd, 6, 0) == b"second"  # the new entry's lock
    with pytest.raises(BlockingIOError):  # a second holder, even in this process
        _io.lock_entry(path, os.O_RDWR)
    os.close(fd)

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "no locks on this file system")

    monkeypatch.setattr(_io.fcntl, "flock", no_locks)
    assert _io.lock_entry(path, os.O_RDWR) is None


# -- saves through emakit's API: fsync, failures, killed saves ----------------------------------


KILLED_SAVE = """
import os, signal, sys, time
import torch
from emakit import EMA
from emakit._files import safetensors_file
from emakit.checkpoint import save_ema_weights

real = safetensors_file.write_tensor
def write_and_die(f, t, dtype=None):
    real(f, t, dtype)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
import emakit._files.export as export
export.write_tensor = write_and_die
save_ema_weights(EMA(torch.nn.Linear(64, 64)), sys.argv[1])
"""

LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # holds the lock until killed (or its parent is gone)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX only")
def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tmp_path: Path):
    dest = tmp_path / "ema.safetensors"
    save_ema_weights(EMA(nn.Linear(64, 64)), dest)
    before = dest.read_bytes()
    env = {**os.environ, "PYTHONPATH": _peers.child_pythonpath()}
    child = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(dest)], env=env)
    assert child.returncode == -signal.SIGKILL
    (left,) = [p for p in tmp_path.iterdir() if ".emakit-tmp-" in p.name]
    assert dest.read_bytes() == before  # the previous file is whole
    # a concurrent writer's temporary file (its lock held by a live process) is not stale
    live = tmp_path / ".other.safetensors.emakit-tmp-0000abcd"
    live.write_bytes(b"in flight")
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(live)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
        save_ema_weights(EMA(nn.Linear(64, 64)), dest)
        assert not left.exists()  # the killed save's: removed
        assert live.read_bytes() == b"in flight"  # the live one: kept
        other = tmp_path / ".notes.txt"  # not emakit's: never touched
        other.write_text("mine")
        save_ema_weights(EMA(nn.Linear(64, 64)), dest)
        assert other.exists() and live.exists()
    finally:
        holder.kill()
        holder.wait()


def _fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Record each fsync (the inode and kind of what it flushed) and each rename."""
    events: list[tuple[str, Any]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        events.append(("fsync", (st.st_ino, "dir" if os.path.stat.S_ISDIR(st.st_mode) else "file")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _check_synced(events: list[tuple[str, Any]], files: list[Path]) -> None:
    replaced = [ino for kind, ino in events if kind == "replace"]
    for path in files:
        ino = path.stat().st_ino
        assert ino in replaced, path
        at = next(i for i, (kind, v) in enumerate(events) if kind == "replace" and v == ino)
        assert ("fsync", (ino, "file")) in events[:at], f"{path} renamed before its data was synced"
        folder = os.stat(path.parent).st_ino
        assert ("fsync", (folder, "dir")) in events[at + 1 :], f"{path.parent} not synced after"


def test_every_atomic_write_fsyncs_the_file_then_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    torch.manual_seed(0)
    net = TinyLora()
    events = _fsyncs(monkeypatch)
    save_checkpoint({"x": torch.zeros(2)}, tmp_path / "c.pt")
    _check_synced(events, [tmp_path / "c.pt"])
    events.clear()
    save_ema_weights(EMA(nn.Linear(3, 3)), tmp_path / "w" / "ema.safetensors")
    _check_synced(events, [tmp_path / "w" / "ema.safetensors"])
    events.clear()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "snaps", **TINY_LORA_POSTHOC)
    train(net, [ema], range(4), **TINY_LORA_SGD)  # one step's set: a side file and two snapshots
    written = sorted((tmp_path / "snaps").glob("*.safetensors"))
    assert len(written) == 3
    _check_synced(events, written)


def test_save_checkpoint_is_torch_save_and_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    import os

    import emakit
    from emakit import EMAWriteError

    net = nn.Linear(3, 2)
    ema = EMA(net)
    path = tmp_path / "ckpt.pt"
    assert emakit.save_checkpoint({"ema": ema.state_dict(), "step": 1}, path) == path
    old = path.read_bytes()
    back = torch.load(path, weights_only=True)
    assert back["step"] == 1 and set(back["ema"]) == set(ema.state_dict())

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(EMAWriteError, match="No space left"):
        emakit.save_checkpoint({"ema": ema.state_dict(), "step": 2}, path)
    monkeypatch.undo()
    assert path.read_bytes() == old  # the previous checkpoint, intact
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left


def test_atomic_writes_fsync_the_file_before_the_rename(tmp_path, monkeypatch):
    import os

    import emakit

    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    emakit.save_checkpoint({"x": torch.zeros(2)}, tmp_path / "c.pt")
    assert "replace" in calls
    first_replace = calls.index("replace")
    assert "fsync" in calls[:first_replace]  # the data is on disk before it is renamed
    assert "fsync" in calls[first_replace + 1 :]  # and the folder after
