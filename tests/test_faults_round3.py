"""Faults and bad input, round 3: each a small reproducer of a case that lost data
silently, raised a raw error or hung."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from emakit import EMA, EMAError, EMAStateError, EMAValueError, PostHocEMA
from emakit.checkpoint import save_ema_weights


def big_linear() -> nn.Linear:
    net = nn.Linear(4, 2)
    with torch.no_grad():
        net.weight[0, 1] = 1e5  # above float16's 65504
    return net


def test_a_lossy_float16_export_raises_naming_the_tensor_and_magnitude(tmp_path: Path):
    ema = EMA(big_linear())
    dest = tmp_path / "ema.safetensors"
    with pytest.raises(EMAValueError, match=r"'weight'.*100000.*65504"):
        save_ema_weights(ema, dest, dtype=torch.float16)
    assert not dest.exists()
    save_ema_weights(ema, dest, dtype=torch.bfloat16)  # float32's range: fine
    save_ema_weights(EMA(nn.Linear(4, 2)), tmp_path / "small.safetensors", dtype=torch.float16)


def test_synthesis_from_overflowed_float16_snapshots_raises_naming_them(tmp_path: Path):
    net = big_linear()
    ema = PostHocEMA(
        net, sigma_rels=(0.05, 0.28), checkpoint_every_num_steps=2, checkpoint_folder=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the snapshot-time warning about float16
        for _ in range(6):
            ema.update()
        with pytest.raises(EMAStateError, match=r"not finite.*'weight'.*step-"):
            ema.synthesize_ema_model(sigma_rel=0.1)


def test_a_second_run_in_the_same_folder_keeps_the_first_runs_snapshots(tmp_path: Path):
    from emakit.posthoc import list_snapshots

    def run(seed: int) -> PostHocEMA:
        net = nn.Linear(3, 2)
        torch.manual_seed(seed)
        ema = PostHocEMA(
            net, sigma_rels=(0.05, 0.28), checkpoint_every_num_steps=2, checkpoint_folder=tmp_path
        )
        for _ in range(8):
            with torch.no_grad():
                net.weight.add_(torch.randn(2, 3))
            ema.update()
        ema.release_folder()
        return ema

    first = run(0)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("step-*")}
    assert len(before) == 8  # 4 steps x 2 profiles
    with pytest.warns(Warning, match="theirs are kept"):
        second = run(1)
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data, name  # run 1's, untouched
    runs = {s.run for s in list_snapshots(tmp_path)}
    assert runs == {first.run_id, second.run_id}
    assert len(list(tmp_path.glob(f"*_run-{second.run_id}.safetensors"))) == 8
    synth = second.synthesize_ema_model(sigma_rel=0.1)  # its own run's snapshots
    assert torch.isfinite(synth.ema_model.weight).all()


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


def test_an_uninitialized_lazy_module_is_refused_with_the_fix():
    model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(EMAValueError, match=r"0\.weight.*forward.*lazy_init_ema=True"):
        EMA(model)
    ema = EMA(model, lazy_init_ema=True)  # the way out it names
    model(torch.zeros(1, 2))
    ema.update()
    assert ema.ema_model[0].weight.shape == (3, 2)


def test_a_checkpoint_folder_that_is_a_regular_file_is_refused(tmp_path: Path):
    from emakit.distributed import save_sharded_ema

    file = tmp_path / "taken"
    file.write_text("not a folder")
    with pytest.raises(EMAValueError, match=r"checkpoint_folder must be a folder.*regular file"):
        PostHocEMA(nn.Linear(2, 2), checkpoint_folder=file)
    with pytest.raises(EMAValueError, match="checkpoint_id must be a folder"):
        save_sharded_ema(EMA(nn.Linear(2, 2)), file)
    assert file.read_text() == "not a folder"


@pytest.mark.parametrize("value", ["0.9", b"x", True, object()])
def test_a_schedule_returning_a_non_number_raises_an_ema_error(value):
    from emakit import EMATypeError

    ema = EMA(nn.Linear(2, 2), schedule=lambda t: value, update_after_step=0, update_every=1)
    ema.update()  # the first call copies
    with pytest.raises(EMATypeError, match=r"schedule .* returned .* a float in \[0, 1\]"):
        ema.update()


@pytest.mark.parametrize(
    "key", ["update_every", "update_after_step", "update_model_with_ema_every"]
)
def test_counts_beyond_the_int64_counters_are_refused(key):
    with pytest.raises(EMAValueError, match=rf"{key} must be <= {2**63 - 1}.*int64"):
        EMA(nn.Linear(2, 2), **{key: 2**70})
    EMA(nn.Linear(2, 2), **{key: 2**63 - 1})


def test_load_ema_weights_strict_false_names_the_extra_and_missing_tensors(tmp_path: Path):
    import safetensors.torch

    from emakit.checkpoint import load_ema_weights

    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"weight": torch.ones(2, 3), "stray.bias": torch.ones(2)}, path)
    ema = EMA(nn.Linear(3, 2))
    with pytest.warns(UserWarning, match=r"1 name\(s\).*stray\.bias.*1 tensor\(s\).*bias"):
        load_ema_weights(ema, path, strict=False)
    assert torch.equal(ema.ema_model.weight, torch.ones(2, 3))


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


def test_a_garbled_distcp_file_is_named(tmp_path: Path):
    from emakit.distributed import load_sharded_ema, save_sharded_ema

    save_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)
    (data,) = tmp_path.rglob("*.distcp")
    data.write_bytes(data.read_bytes()[:10])  # truncated
    with pytest.raises(EMAStateError, match=rf"data file .*{data.name}.*truncated or damaged"):
        load_sharded_ema(EMA(nn.Linear(3, 2)), tmp_path)
