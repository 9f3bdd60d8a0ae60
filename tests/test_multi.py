"""MultiEMA: several EMAs of one model updated in one pass, each equal to a lone EMA."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import _models
import emakit
from _models import bn_mlp
from emakit import EMA, MultiEMA

make_net = partial(bn_mlp, 4, 8, 3, relu=True)


#: ``train(net, updaters, steps=25)``: SGD steps, each followed by every updater's ``update()``.
train = partial(_models.train, steps=25, batch=(16, 4), seed=1)


@pytest.mark.parametrize("gather_below", [0, 1 << 30])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("ema_dtype", [None, torch.float64])
def test_each_member_equals_a_lone_ema(flatten, ema_dtype, gather_below, monkeypatch):
    # gather_below 0 forces the direct per-tensor form, a huge one the gathered form
    monkeypatch.setattr(emakit._engine.fused, "GATHER_BELOW", gather_below)
    kw = dict(update_after_step=3, update_every=2, ema_dtype=ema_dtype)
    net = make_net()
    if flatten:
        emakit.flatten_parameters(net)
    multi = MultiEMA(net, betas=(0.9, 0.99, 1.0), **kw)
    lone = [EMA(net, beta=b, **kw) for b in (0.9, 0.99, 1.0)]
    train(net, [multi, *lone])
    assert multi.step == 25
    for m, e in zip(multi, lone, strict=True):
        assert int(m.step) == int(e.step)
        for (k, a), (_, b) in zip(
            m.ema_model.state_dict().items(), e.ema_model.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), k
    assert multi._fused is not None  # the fused path really ran


def test_schedules_and_swap_and_state():
    net = make_net()
    multi = MultiEMA(
        net, schedules=[lambda t: 0.5, lambda t: 0.0], update_after_step=0, update_every=1
    )
    train(net, [multi], steps=5)
    # decay 0 tracks the model exactly
    for k, v in multi[1].ema_model.state_dict().items():
        assert torch.equal(v, net.state_dict()[k]), k
    with multi[0].swap():
        assert torch.equal(net[0].weight, multi[0].ema_model[0].weight)
    sd = multi.state_dict()
    assert "emas.0.step" in sd and "emas.1.ema_model.0.weight" in sd
    assert sd._metadata["emas.0"]["version"] == emakit.STATE_VERSION
    other = MultiEMA(make_net(), schedules=[lambda t: 0.5, lambda t: 0.0])
    other.load_state_dict(sd)
    assert torch.equal(other[0].ema_model[0].weight, multi[0].ema_model[0].weight)
    outs = multi(torch.randn(2, 4))
    assert len(outs) == 2


def test_copy_is_independent():
    net = make_net()
    multi = MultiEMA(net, betas=(0.9,), update_after_step=0, update_every=1)
    train(net, [multi], steps=3)
    clone = copy.deepcopy(multi)
    train(clone[0].model, [clone], steps=2)
    assert clone.step == 5 and multi.step == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"betas": ()}, "at least one"),
        ({"betas": 0.9}, "betas"),
        ({"betas": (0.9, 1.5)}, "beta"),
        ({"schedules": [0.9]}, "schedules"),
        ({"update_model_with_ema_every": 2}, "update_model_with_ema_every"),
        ({"beta": 0.9}, "beta"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(emakit.EMAError, match=match):
        MultiEMA(make_net(), **kwargs)


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_a_model_with_nothing_averaged_copies_its_buffers(skip_nonfinite):
    """Frozen weights (shared) and an integer buffer: the fused pass has no span to average
    (foreach kernels refuse empty lists) and copies the buffer into every member."""
    net = nn.Linear(2, 2).requires_grad_(False)
    net.register_buffer("calls", torch.zeros((), dtype=torch.long))
    multi = MultiEMA(
        net, betas=(0.9, 0.99), update_after_step=0, update_every=1, skip_nonfinite=skip_nonfinite
    )
    for _ in range(3):
        net.calls += 1
        multi.update()
    assert multi._fused is not None
    for member in multi:
        assert int(member.ema_model.calls) == 3
