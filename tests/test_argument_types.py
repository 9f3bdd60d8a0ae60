"""Decay and count arguments take what the peers take (issue 39, item 2): any
``numbers.Real``/``numbers.Integral`` (numpy scalars) and 0-dim tensors, as Python numbers;
bools (Python's, numpy's, a bool tensor) and tensors of more than one element are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ema_pytorch import EMA as PeerEMA  # noqa: N811 - the peer's class, by its role
from torch import nn

from emakit import EMA, schedules
from emakit.compat.diffusers import EMAModel
from emakit.compat.swa_utils import get_ema_multi_avg_fn
from emakit.compat.timm import ModelEmaV3
from emakit.compat.torch_ema import ExponentialMovingAverage
from emakit.errors import EMATypeError, EMAValueError

REALS = [np.float32(0.75), np.float64(0.75), torch.tensor(0.75), torch.tensor(0.75).double()]
INTEGERS = [np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3)]


@pytest.mark.parametrize("beta", REALS, ids=repr)
def test_a_numpy_or_tensor_beta_gives_the_python_floats_numbers(beta) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    ours = EMA(net, beta=beta, update_after_step=2, update_every=1, power=np.float32(0.5))
    ref = EMA(net, beta=0.75, update_after_step=2, update_every=1, power=0.5)
    peer = PeerEMA(net, beta=0.75, update_after_step=2, update_every=1, power=0.5)
    assert ours.beta == 0.75 and type(ours.beta) is float
    for _ in range(12):
        with torch.no_grad():
            net.weight.add_(torch.randn(3, 4))
        ours.update()
        ref.update()
        peer.update()
        assert torch.equal(ours.ema_model.weight, ref.ema_model.weight)
        assert torch.equal(ours.ema_model.weight, peer.ema_model.weight)


@pytest.mark.parametrize("n", INTEGERS, ids=repr)
def test_numpy_and_tensor_counts(n) -> None:
    net = torch.nn.Linear(2, 2)
    ema = EMA(net, update_after_step=n, update_every=n)
    assert ema.update_after_step == 3 and ema.update_every == 3
    assert type(ema.update_every) is int


def test_the_drop_ins_take_numpy_decays() -> None:
    net = torch.nn.Linear(2, 2)
    assert ModelEmaV3(net, decay=np.float32(0.5)).decay == 0.5
    assert ExponentialMovingAverage(net.parameters(), decay=np.float64(0.5)).decay == 0.5
    assert EMAModel(net.parameters(), decay=np.float32(0.5)).decay == 0.5
    assert get_ema_multi_avg_fn(np.float32(0.5)).decay == 0.5  # type: ignore[attr-defined]
    assert schedules.constant(np.float32(0.5))(10) == 0.5


@pytest.mark.parametrize(
    "bad",
    [True, np.bool_(True), torch.tensor(True), torch.tensor([0.5]), torch.tensor(0.5j), "0.5"],
    ids=repr,
)
def test_bools_vectors_and_text_are_refused(bad) -> None:
    net = torch.nn.Linear(2, 2)
    with pytest.raises(EMATypeError, match="beta must be a real number"):
        EMA(net, beta=bad)
    with pytest.raises(EMATypeError, match="update_every must be an int"):
        EMA(net, update_every=bad)
    with pytest.raises(EMATypeError, match="update_every must be an int"):
        EMA(net, update_every=torch.tensor(3.0))


@pytest.mark.parametrize(
    "key", ["update_every", "update_after_step", "update_model_with_ema_every"]
)
def test_counts_beyond_the_int64_counters_are_refused(key):
    with pytest.raises(EMAValueError, match=rf"{key} must be <= {2**63 - 1}.*int64"):
        EMA(nn.Linear(2, 2), **{key: 2**70})
    EMA(nn.Linear(2, 2), **{key: 2**63 - 1})
