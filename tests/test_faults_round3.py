"""Faults and bad input, round 3: each a small reproducer of a case that lost data
silently, raised a raw error or hung."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from emakit import EMA, EMAStateError, EMAValueError, PostHocEMA
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
