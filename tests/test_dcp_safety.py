"""Sharded (DCP) checkpoints: loading never runs code from the files (issue 14, item 3), and
the folder layout that makes saves crash-safe (item 2; the SIGKILL test is in
test_dcp_crash.py).

DCP's own reader unpickles ``.metadata`` with ``pickle`` and loads entries stored as
pickled bytes with ``torch.load(weights_only=False)``; each test here plants a file that
would create a canary file if it were unpickled, and checks that loading raises an
``EMAStateError`` and the canary never appears; the ``.metadata`` allow-list is tried
against each gadget one at a time (issue 30). A truncated data file is named.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from emakit import EMA, EMAStateError
from emakit.distributed import load_sharded_ema, save_sharded_ema

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def make_ema(value: float = 1.0) -> EMA:
    torch.manual_seed(0)
    ema = EMA(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), update_after_step=0)
    ema.update()
    with torch.no_grad():
        for p in ema.ema_model.parameters():
            p.fill_(value)
    return ema


class Canary:
    """Unpickling it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_crafted_metadata_file_is_refused_not_run(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_sharded_ema(make_ema(), folder)
    canary = tmp_path / "canary"
    (metadata,) = folder.rglob(".metadata")  # in the version folder the pointer names
    metadata.write_bytes(pickle.dumps(Canary(canary)))
    ema = make_ema(0.0)
    with pytest.raises(EMAStateError, match="does not unpickle"):
        load_sharded_ema(ema, folder)
    assert not canary.exists()
    assert all(bool((p == 0).all()) for p in ema.ema_model.parameters())  # nothing loaded


def test_a_plain_dcp_folder_with_a_crafted_metadata_file_is_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "plain"
    dcp.save(make_ema().state_dict(), checkpoint_id=folder)  # DCP's own layout, no pointer
    canary = tmp_path / "canary"
    (folder / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
    with pytest.raises(EMAStateError, match="not part of DCP's checkpoint metadata"):
        load_sharded_ema(make_ema(0.0), folder)
    assert not canary.exists()


def test_an_entry_stored_as_a_pickle_is_refused_not_run(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    canary = tmp_path / "canary"
    state = make_ema().state_dict()
    state["step"] = Canary(canary)  # DCP stores a non-tensor entry as torch.save bytes
    folder = tmp_path / "bytes"
    dcp.save(state, checkpoint_id=folder)
    with pytest.raises(EMAStateError, match="pickled objects"):
        load_sharded_ema(make_ema(0.0), folder)
    assert not canary.exists()


def test_a_data_file_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_sharded_ema(make_ema(), folder)
    (path,) = folder.rglob(".metadata")
    metadata = pickle.loads(path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(EMAStateError, match="not a file inside the checkpoint"):
        load_sharded_ema(make_ema(0.0), folder)


def test_a_genuine_checkpoint_loads_and_layouts_switch(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from emakit.distributed import sharded_checkpoint_dir

    folder = tmp_path / "ckpt"
    dcp.save(make_ema(2.0).state_dict(), checkpoint_id=folder)  # an old, plain folder
    ema = make_ema(0.0)
    load_sharded_ema(ema, folder)
    assert all(bool((p == 2).all()) for p in ema.ema_model.parameters())
    save_sharded_ema(make_ema(3.0), folder)  # switches it to the pointer layout
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == "emakit-sharded.json" and len(names) == 2, names  # old files gone
    save_sharded_ema(make_ema(4.0), folder)
    assert len(list(folder.iterdir())) == 2  # the previous version was removed
    load_sharded_ema(ema, folder)
    assert all(bool((p == 4).all()) for p in ema.ema_model.parameters())
    # the version folder is a plain DCP checkpoint of what save_sharded_ema writes
    plain = make_ema(0.0).state_dict(include_online_model=False)
    dcp.load(plain, checkpoint_id=sharded_checkpoint_dir(folder))
    assert bool((plain["ema_model.0.weight"] == 4).all())


def test_a_damaged_pointer_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_sharded_ema(make_ema(), folder)
    (folder / "emakit-sharded.json").write_text('{"current": "../../etc"}')
    with pytest.raises(EMAStateError, match="damaged"):
        load_sharded_ema(make_ema(0.0), folder)


def test_a_url_or_a_non_utf8_checkpoint_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="file-system folder"):
        save_sharded_ema(make_ema(), "s3://bucket/ckpt")
    bad = tmp_path / os.fsdecode(b"ckpt-\xff")
    with pytest.raises(ValueError, match="UTF-8"):
        save_sharded_ema(make_ema(), bad)
    assert not bad.exists()


def test_restricted_unpickler_reads_what_dcp_writes(tmp_path: Path) -> None:
    """Every class a real .metadata refers to (dtypes of every kind, sizes, chunks) resolves."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "kinds"
    state = {k: v.clone() for k, v in make_ema(5.0).state_dict().items()}
    state["extra.bf16"] = torch.ones(2, 3, dtype=torch.bfloat16)
    state["extra.c64"] = torch.ones(2, dtype=torch.complex64)
    state["extra.u8"] = torch.ones(2, dtype=torch.uint8)
    dcp.save(state, checkpoint_id=folder)
    from emakit._files.dcp import SafeReader

    metadata = SafeReader(folder).read_metadata()
    assert "extra.bf16" in metadata.state_dict_metadata
    buf = io.BytesIO((folder / ".metadata").read_bytes())
    assert type(pickle.load(buf)) is type(metadata)


def test_torch_2_4_reader_without_get_metadata_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.4's FileSystemReader has no ``_get_metadata_path``: the reader falls back to
    the one ``.metadata`` file that torch wrote (issue 31: every load failed there)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = tmp_path / "ckpt"
    save_sharded_ema(make_ema(6.0), folder)
    monkeypatch.delattr(FileSystemReader, "_get_metadata_path", raising=False)
    ema = make_ema(0.0)
    load_sharded_ema(ema, folder)
    assert all(bool((p == 6).all()) for p in ema.ema_model.parameters())


def test_python_3_13_pathlib_local_names_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.13 pickles a path as ``pathlib._local.PosixPath``: such a ``.metadata``
    (rewritten here as 3.13 writes it, on any Python) loads (issue 31)."""
    import sys
    import types
    from pathlib import PurePath

    folder = tmp_path / "ckpt"
    save_sharded_ema(make_ema(7.0), folder)
    (path,) = folder.rglob(".metadata")
    metadata = pickle.loads(path.read_bytes())
    metadata.storage_meta.checkpoint_id = Path(folder)  # a path in it, whatever torch wrote

    def rebuild(text: str) -> Path:
        return Path(text)

    rebuild.__module__ = "pathlib._local"
    rebuild.__qualname__ = rebuild.__name__ = "PosixPath"
    monkeypatch.setitem(sys.modules, "pathlib._local", types.ModuleType("pathlib._local"))
    sys.modules["pathlib._local"].PosixPath = rebuild  # type: ignore[attr-defined]

    class As313(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if isinstance(obj, PurePath):
                return (rebuild, (str(obj),))
            return NotImplemented

    buf = io.BytesIO()
    As313(buf).dump(metadata)
    assert b"pathlib._local" in buf.getvalue()
    path.write_bytes(buf.getvalue())
    monkeypatch.delitem(sys.modules, "pathlib._local")
    ema = make_ema(0.0)
    load_sharded_ema(ema, folder)
    assert all(bool((p == 7).all()) for p in ema.ema_model.parameters())


def test_a_garbled_distcp_file_is_named(tmp_path: Path):
    from emakit.distributed import load_sharded_ema, save_sharded_ema

    save_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)
    (data,) = tmp_path.rglob("*.distcp")
    data.write_bytes(data.read_bytes()[:10])  # truncated
    with pytest.raises(EMAStateError, match=rf"data file .*{data.name}.*truncated or damaged"):
        load_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)


# -- the metadata allow-list, one gadget at a time (issue 30) ----------------------------------


def _global(module: str, name: str) -> bytes:
    """Pickle opcodes pushing ``module.name`` (STACK_GLOBAL: dotted names work)."""
    out = b""
    for text in (module, name):
        raw = text.encode()
        out += b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE
    return out + b"\x93"  # STACK_GLOBAL


def _call(module: str, name: str, *args: Any) -> bytes:
    """A protocol-4 pickle that calls ``module.name(*args)`` when loaded."""
    body = _global(module, name) + pickle.dumps(tuple(args), protocol=4)[2:-1] + b"R"
    return b"\x80\x04" + body + b"."


GADGETS = [
    ("torch", "save"),
    ("torch", "load"),
    ("torch", "from_file"),
    ("torch", "set_default_dtype"),
    ("torch", "Tensor"),
    ("torch", "nn"),
    ("torch.serialization", "load"),
    ("torch.serialization", "_load"),
    ("torch.jit", "load"),
    ("torch._C", "_set_grad_enabled"),
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "Popen"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("builtins", "open"),
    ("pathlib", "Path.write_text"),
    ("pathlib", "Path.unlink"),
    ("pathlib", "PosixPath.write_bytes"),
    ("pathlib", "Path.__new__"),
    ("pathlib._local", "Path.write_text"),
    ("pathlib", "os"),
    ("shutil", "rmtree"),
    ("collections", "OrderedDict.fromkeys"),
    ("torch.distributed.checkpoint.metadata", "field"),
    ("torch.distributed.checkpoint.metadata", "torch"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__setattr__"),
]


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch.distributed.checkpoint")
    from emakit.distributed import save_sharded_ema

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    save_sharded_ema(EMA(nn.Linear(3, 4)), folder)
    return folder


@pytest.mark.parametrize(("module", "name"), GADGETS, ids=[f"{m}.{n}" for m, n in GADGETS])
def test_a_metadata_file_naming_a_gadget_is_refused_not_run(
    dcp_folder: Path, tmp_path: Path, module: str, name: str
):
    from emakit.distributed import load_sharded_ema

    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_folder, folder)
    canary = tmp_path / "canary"
    (metadata,) = folder.rglob(".metadata")
    metadata.write_bytes(_call(module, name, str(canary)))
    ema = EMA(nn.Linear(3, 4))
    with torch.no_grad():
        ema.ema_model.weight.fill_(7.0)
    with pytest.raises(EMAStateError, match=f"refers to {module}.{name}, which is not part of"):
        load_sharded_ema(ema, folder)
    assert not canary.exists()
    assert bool((ema.ema_model.weight == 7).all())  # nothing loaded
    assert torch.get_default_dtype() == torch.float32


def test_the_gadget_pickles_would_run_if_unpickled(tmp_path: Path):
    """The payloads above are live: plain pickle runs them (so refusing them means
    something)."""
    canary = tmp_path / "canary"
    pickle.loads(_call("torch", "save", {}, str(canary)))
    assert canary.exists()
    made = tmp_path / "made"
    pickle.loads(_call("pathlib", "Path.mkdir", pickle.loads(_call("pathlib", "Path", str(made)))))
    assert made.is_dir()


def test_a_genuine_metadata_file_still_loads(dcp_folder: Path, tmp_path: Path):
    from emakit.distributed import load_sharded_ema

    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_folder, folder)
    ema = EMA(nn.Linear(3, 4))
    with torch.no_grad():
        ema.ema_model.weight.fill_(7.0)
    load_sharded_ema(ema, folder)
    assert not bool((ema.ema_model.weight == 7).all())
