"""The drop-ins' argument checks, to the word: the name in the message, both bounds of a
decay, and the defaults a call without the argument gets (timm's ``ModelEmaV2`` and
``ModelEma``, torch's ``get_ema_avg_fn``, torch_ema's parameter lists)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from emakit.compat import swa_utils, timm
from emakit.compat.torch_ema import ExponentialMovingAverage
from emakit.errors import EMATypeError, EMAValueError

DECAYS = {
    "timm.ModelEmaV2": lambda decay: timm.ModelEmaV2(nn.Linear(2, 2), decay=decay),
    "swa_utils.get_ema_avg_fn": lambda decay: swa_utils.get_ema_avg_fn(decay),
}


@pytest.mark.parametrize("make", list(DECAYS))
@pytest.mark.parametrize("decay", [-0.5, 1.5])
def test_a_decay_outside_0_1_is_refused_naming_it(make, decay):
    with pytest.raises(EMAValueError) as caught:
        DECAYS[make](decay)
    assert str(caught.value) == f"decay must be a finite number in [0, 1], got decay={decay}"


@pytest.mark.parametrize("make", list(DECAYS))
def test_both_ends_of_the_decay_are_taken(make):
    for decay in (0.0, 1.0):
        assert DECAYS[make](decay).decay == decay


def test_timm_default_decays_are_timms():
    """The defaults apply when the argument is left out (timm's 0.9999 for both)."""
    net = nn.Linear(2, 2)
    assert timm.ModelEmaV2(net).decay == 0.9999
    assert timm.ModelEma(net).decay == 0.9999
    assert swa_utils.get_ema_avg_fn().decay == 0.999


def test_torch_ema_other_parameters_are_checked_naming_them():
    """``copy_to``/``store``/``update`` with parameters given check them as the constructor
    does: an iterable of tensors, named ``parameters`` in the message."""
    params = [torch.zeros(2, requires_grad=True)]
    ema = ExponentialMovingAverage(params, decay=0.9)
    for method in ("copy_to", "store", "update"):
        with pytest.raises(EMATypeError) as caught:
            getattr(ema, method)([1, 2])
        assert str(caught.value) == (
            "parameters must be an iterable of tensors (e.g. model.parameters()), got "
            "['int', 'int']"
        ), method
