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
