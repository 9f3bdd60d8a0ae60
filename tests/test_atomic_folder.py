"""Whole-folder replacement (``emakit._files.atomic.atomic_folder``): one exchange or
nothing, what is carried from the old folder, permissions, symbolic links, the two-rename
fallback, and the leftovers of killed saves (locked while live, cleaned or put back after).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from emakit._files import atomic as _io
from emakit._files.atomic import DIR_PREFIX, OLD_PREFIX, atomic_folder, remove_stale_folders

IO_FILE = Path(_io.__file__)
posix_only = pytest.mark.skipif(_io.fcntl is None, reason="needs POSIX flock")


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` by relative path: a file's bytes, None for a folder."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if DIR_PREFIX in p.name or OLD_PREFIX in p.name)


def fill(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def save(path: Path, files: dict[str, bytes], **kwargs) -> None:
    with atomic_folder(path, **kwargs) as staged:
        fill(staged, files)


def refusing(code: int) -> Callable[[bytes, bytes], int]:
    """A stand-in for libc's exchange that fails with ``errno`` ``code``."""

    def swap(a: bytes, b: bytes) -> int:
        ctypes.set_errno(code)
        return -1

    return swap


def test_a_new_folder_appears_whole_with_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        save(tmp_path / "a" / "out", {"config.json": b"{}", "sub/w.bin": b"w"})
    finally:
        os.umask(old)
    out = tmp_path / "a" / "out"
    assert tree(out) == {"config.json": b"{}", "sub": None, "sub/w.bin": b"w"}
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # not mkdtemp's 0o700
    assert leftovers(out.parent) == []


def test_an_existing_folder_is_replaced_by_one_exchange(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save(out, {"config.json": b"1", "old.bin": b"old"})
    out.chmod(0o751)
    calls: list[str] = []
    exchange, rename = _io._exchange, os.rename
    monkeypatch.setattr(_io, "_exchange", lambda a, b: calls.append("exchange") or exchange(a, b))
    monkeypatch.setattr(os, "rename", lambda a, b: calls.append("rename") or rename(a, b))
    save(out, {"config.json": b"2"})
    assert calls == ["exchange"]
    assert tree(out) == {"config.json": b"2"}  # nothing carried by default
    assert stat.S_IMODE(out.stat().st_mode) == 0o751
    assert leftovers(tmp_path) == []


def test_carry_keeps_the_chosen_entries_as_hard_links(tmp_path):
    out = tmp_path / "out"
    save(out, {"config.json": b"1", "w.bin": b"old", "notes.txt": b"mine", "pics/a.png": b"a"})
    fill(out, {f".w.bin{_io.TEMP_PREFIX}0badf00d": b"half"})  # an old-style leftover
    (out / "link").symlink_to("notes.txt")
    before = (out / "notes.txt").stat().st_ino, (out / "pics" / "a.png").stat().st_ino
    seen: list[tuple[str, frozenset[str]]] = []

    def carry(name: str, written) -> bool:
        seen.append((name, frozenset(written)))
        return name != "w.bin"

    save(out, {"config.json": b"2"}, carry=carry)
    assert tree(out) == {
        "config.json": b"2",
        "link": b"mine",
        "notes.txt": b"mine",
        "pics": None,
        "pics/a.png": b"a",
    }
    assert (out / "link").is_symlink() and os.readlink(out / "link") == "notes.txt"
    assert ((out / "notes.txt").stat().st_ino, (out / "pics" / "a.png").stat().st_ino) == before
    # asked about every old entry the new folder lacks (never its own leftovers)
    assert sorted(name for name, _ in seen) == ["link", "notes.txt", "pics", "w.bin"]
    assert all(written == {"config.json"} for _, written in seen)


def test_carry_copies_where_links_fail(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save(out, {"config.json": b"1", "notes.txt": b"mine", "pics/a.png": b"a"})
    (out / "notes.txt").chmod(0o444)

    def no_links(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    save(out, {"config.json": b"2"}, carry=lambda name, written: True)
    assert tree(out) == {
        "config.json": b"2",
        "notes.txt": b"mine",
        "pics": None,
        "pics/a.png": b"a",
    }
    assert stat.S_IMODE((out / "notes.txt").stat().st_mode) == 0o444


def test_a_symlinked_folder_is_replaced_behind_its_link(tmp_path):
    real = tmp_path / "real"
    save(real, {"config.json": b"1"})
    link = tmp_path / "link"
    link.symlink_to("real")
    save(link, {"config.json": b"2"})
    assert link.is_symlink() and os.readlink(link) == "real"
    assert tree(real) == {"config.json": b"2"}
    assert leftovers(tmp_path) == []


def test_a_raise_in_the_block_leaves_the_folder_and_removes_the_staging(tmp_path):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})

    def disk_full() -> None:
        with atomic_folder(out) as staged:
            fill(staged, {"config.json": b"2", "sub/half.bin": b"ha"})
            (staged / "sub").chmod(0o500)  # even a read-only folder in it goes
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        disk_full()
    assert tree(out) == {"config.json": b"1"}
    assert leftovers(tmp_path) == []
    with pytest.raises(KeyError), atomic_folder(tmp_path / "never"):
        raise KeyError("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(NotADirectoryError), atomic_folder(tmp_path / "f"):
        pass  # pragma: no cover
    assert (tmp_path / "f").read_bytes() == b"x"


def test_permissions_of_a_read_only_folder_are_kept(tmp_path):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    out.chmod(0o555)
    try:
        save(out, {"config.json": b"2"})
        assert stat.S_IMODE(out.stat().st_mode) == 0o555
        assert tree(out) == {"config.json": b"2"}
        assert leftovers(tmp_path) == []  # the old content went, read-only or not
    finally:
        out.chmod(0o755)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, None])
def test_without_an_exchange_two_renames_replace_the_folder(tmp_path, monkeypatch, code):
    out = tmp_path / "out"
    save(out, {"config.json": b"1", "notes.txt": b"mine"})
    swap = None if code is None else refusing(code)
    monkeypatch.setattr(_io, "_swap_function", lambda: swap)
    renames: list[tuple[str, str]] = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: renames.append((a, b)) or rename(a, b))
    save(out, {"config.json": b"2"}, carry=lambda name, written: True)
    assert tree(out) == {"config.json": b"2", "notes.txt": b"mine"}
    assert [Path(b).name for _, b in renames][1] == "out"
    assert OLD_PREFIX in Path(renames[0][1]).name and Path(renames[0][0]).name == "out"
    assert leftovers(tmp_path) == []


def test_an_exchange_failing_otherwise_raises_and_changes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    monkeypatch.setattr(_io, "_swap_function", lambda: refusing(errno.EACCES))
    with pytest.raises(PermissionError):
        save(out, {"config.json": b"2"})
    assert tree(out) == {"config.json": b"1"}
    assert leftovers(tmp_path) == []


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    monkeypatch.setattr(_io, "_swap_function", lambda: None)
    rename = os.rename

    def second_fails(a, b):
        if DIR_PREFIX in Path(a).name:
            raise OSError(errno.EIO, "I/O error")
        rename(a, b)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(OSError, match="I/O error"):
        save(out, {"config.json": b"2"})
    assert tree(out) == {"config.json": b"1"}
    assert leftovers(tmp_path) == []


def test_long_names_get_leftovers_of_their_own(tmp_path):
    a, b = tmp_path / ("n" * 240 + "a"), tmp_path / ("n" * 240 + "b")
    save(a, {"x": b"a"})
    save(b, {"x": b"b"})
    stale_a = tmp_path / f".{_io._folder_stem(a.name)}{OLD_PREFIX}0123abcd"
    stale_a.mkdir()
    assert _io._folder_stem(a.name) != _io._folder_stem(b.name)
    assert len(os.fsencode(stale_a.name)) < 255
    save(b, {"x": b"b2"})
    assert stale_a.is_dir()  # not b's to clean
    save(a, {"x": b"a2"})
    assert not stale_a.exists()
    assert tree(a) == {"x": b"a2"} and tree(b) == {"x": b"b2"}


def stale_leftover(out: Path, marker: str, files: dict[str, bytes]) -> Path:
    folder = out.parent / f".{out.name}{marker}0123abcd"
    folder.mkdir()
    fill(folder, files)
    return folder


@posix_only
def test_stale_leftovers_go_and_a_missing_folder_comes_back(tmp_path):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    staging = stale_leftover(out, DIR_PREFIX, {"config.json": b"half"})
    old = stale_leftover(out, OLD_PREFIX, {"config.json": b"0"})
    other = tmp_path / f".outer{DIR_PREFIX}0123abcd"  # another folder's leftover
    other.mkdir()
    save(out, {"config.json": b"2"})
    assert not staging.exists() and not old.exists() and other.is_dir()
    assert tree(out) == {"config.json": b"2"}
    # A save killed between the fallback's two renames: the old folder is put back.
    out.rename(tmp_path / f".out{OLD_PREFIX}0badcafe")
    stale_leftover(out, DIR_PREFIX, {"config.json": b"3"})  # its complete staging
    assert remove_stale_folders(out) == [tmp_path / f".out{DIR_PREFIX}0123abcd"]
    assert tree(out) == {"config.json": b"2"}
    assert leftovers(tmp_path) == [other.name]


CHILD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # holds the lock until killed (or its parent is gone)
"""


@posix_only
def test_a_live_staging_folder_is_kept(tmp_path):
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    live = stale_leftover(out, DIR_PREFIX, {"config.json": b"writing"})
    out.rename(tmp_path / "gone")
    live_old = stale_leftover(out, OLD_PREFIX, {"config.json": b"1"})
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(p)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in (live, live_old)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "locked"
        # a live save between its two renames: its old folder is neither put back nor deleted
        assert remove_stale_folders(out) == []
        assert not out.exists() and tree(live_old) == {"config.json": b"1"}
        (tmp_path / "gone").rename(out)
        save(out, {"config.json": b"2"})
        assert live.is_dir() and tree(live) == {"config.json": b"writing"}
        assert live_old.is_dir()
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert sorted(remove_stale_folders(out)) == sorted([live, live_old])  # the locks died
    assert tree(out) == {"config.json": b"2"}


def test_own_live_staging_folder_is_kept(tmp_path, monkeypatch):
    # Even where locks are per process, this process's own saves in flight are kept.
    monkeypatch.setattr(_io, "STALE_TEMP_AGE_S", 0.0)
    monkeypatch.setattr(_io, "fcntl", None)
    out = tmp_path / "out"
    with atomic_folder(out) as outer:
        fill(outer, {"config.json": b"outer"})
        past = time.time() - 10
        os.utime(outer, (past, past))
        assert remove_stale_folders(out) == []
        assert (outer / "config.json").exists()
    assert tree(out) == {"config.json": b"outer"}


def test_without_locks_leftovers_expire_by_age(tmp_path, monkeypatch):
    monkeypatch.setattr(_io, "fcntl", None)
    out = tmp_path / "out"
    save(out, {"config.json": b"1"})
    fresh = stale_leftover(out, DIR_PREFIX, {})
    aged = tmp_path / f".out{DIR_PREFIX}0badf00d"
    aged.mkdir()
    past = time.time() - _io.STALE_TEMP_AGE_S - 60
    os.utime(aged, (past, past))
    save(out, {"config.json": b"2"})
    assert fresh.is_dir() and not aged.exists()
    assert tree(out) == {"config.json": b"2"}
