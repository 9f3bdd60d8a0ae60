"""Layered EMA (decay_groups) and the non-finite guard (skip_nonfinite)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import emakit
from _models import ema_weights, step_weights, two_linear
from emakit import EMA
from emakit.schedules import inverse_gamma_float32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def drift(net: nn.Module, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("use_foreach", [False, True, None])
@pytest.mark.parametrize("flatten", [False, True])
def test_each_group_follows_its_own_decay(use_foreach, flatten):
    net = Net()
    if flatten:
        emakit.flatten_parameters(net)
    ema = EMA(
        net,
        beta=0.9999,
        update_after_step=0,
        update_every=1,
        use_foreach=use_foreach,
        decay_groups={"backbone.*": 0.9, "head.*": lambda t: 0.5},
    )
    ref = {n: p.detach().clone().double() for n, p in net.named_parameters()}
    ema.update()
    for k in range(6):
        drift(net, k)
        ema.update()
        step = int(ema.step)
        t = step - 1
        for n, p in net.named_parameters():
            if n.startswith("backbone"):
                d = inverse_gamma_float32(t, beta=0.9, inv_gamma=1.0, power=2 / 3, min_value=0.0)
            elif n.startswith("head"):
                d = 0.5
            else:  # pragma: no cover - every name is matched here
                raise AssertionError(n)
            ref[n].lerp_(p.detach().double(), 1 - d)
    shadow = dict(ema.ema_model.named_parameters())
    for n, r in ref.items():
        torch.testing.assert_close(shadow[n].double(), r, rtol=1e-6, atol=1e-7)
    decays = ema.current_decays()
    assert set(decays) == {"default", "backbone.*", "head.*"}
    assert decays["head.*"] == 0.5


def test_unmatched_names_use_default_and_first_pattern_wins():
    net = Net()
    ema = EMA(
        net,
        beta=0.9,
        update_after_step=0,
        update_every=1,
        decay_groups={"head.weight": 1.0, "head.*": 0.5},
    )
    ema.update()
    head_w = ema.ema_model.head.weight.detach().clone()
    drift(net, 1)
    ema.update()
    assert torch.equal(ema.ema_model.head.weight, head_w)  # beta 1: frozen group
    assert not torch.equal(ema.ema_model.head.bias, net.head.bias)
    assert not torch.equal(ema.ema_model.backbone[0].weight, head_w.new_zeros(1))


def test_flattened_groups_update_in_few_kernels():
    net = Net()
    emakit.flatten_parameters(net)
    ema = EMA(net, update_after_step=0, update_every=1, decay_groups={"head.*": 0.99})
    ema.update()
    ema.update()
    # float params+buffers split into two decay groups (each one span) + the int copy
    assert ema.tracker.plan().num_kernels <= 4


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ({"nothing.*": 0.9}, "matches no tensor"),
        ({"head.*": 1.5}, "decay_groups"),
        ({"head.*": "0.9"}, "decay_groups"),
        ([("head.*", 0.9)], "decay_groups"),
    ],
)
def test_bad_decay_groups(groups, match):
    with pytest.raises(emakit.EMAError, match=match):
        EMA(Net(), decay_groups=groups)


@pytest.mark.parametrize("use_foreach", [False, True, None])
def test_skip_nonfinite_keeps_ema_clean(use_foreach):
    net = Net()
    ema = EMA(
        net,
        beta=0.9,
        update_after_step=0,
        update_every=1,
        skip_nonfinite=True,
        use_foreach=use_foreach,
    )
    ema.update()
    drift(net, 0)
    ema.update()
    good = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    with torch.no_grad():
        net.head.weight[0, 0] = float("nan")
    ema.update()  # no host read in update(): the skip is counted on the device
    with pytest.warns(RuntimeWarning, match="NaN or Inf"):
        assert ema.num_skipped_nonfinite == 1  # read back, and warned, here
    with torch.no_grad():
        net.head.weight[0, 0] = float("inf")
    ema.update()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned only once
        assert ema.num_skipped_nonfinite == 2
    for k, v in ema.ema_model.state_dict().items():
        assert torch.equal(v, good[k]), k
    with torch.no_grad():
        net.head.weight[0, 0] = 0.0
    ema.update()
    assert torch.isfinite(ema.ema_model.head.weight).all()
    assert not torch.equal(ema.ema_model.head.weight, good["head.weight"])
    assert ema.state_dict()._metadata[""]["num_skipped_nonfinite"] == 2


def test_without_guard_nan_reaches_ema():
    net = Net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    ema.update()
    with torch.no_grad():
        net.head.weight[0, 0] = float("nan")
    ema.update()
    assert torch.isnan(ema.ema_model.head.weight[0, 0])


def test_schedule_outside_unit_interval_raises():
    ema = EMA(Net(), schedule=lambda t: float("nan"), update_after_step=0, update_every=1)
    ema.update()
    with pytest.raises(emakit.EMAValueError, match=r"\[0, 1\]"):
        ema.update()


def test_schedule_overrides_beta_and_pickles():
    import pickle

    from emakit import schedules

    net = Net()
    ema = EMA(
        net,
        beta=1.0,
        schedule=schedules.inverse_gamma(beta=0.9),
        update_after_step=0,
        update_every=1,
    )
    assert not ema.is_frozen
    ema.update()
    drift(net, 0)
    ema.update()
    assert not torch.equal(
        ema.ema_model.head.weight, pickle.loads(pickle.dumps(ema)).model.head.weight
    )
    assert repr(schedules.inverse_gamma(beta=0.9)).startswith("inverse_gamma(beta=0.9")


def test_a_decay_groups_floor_is_capped_at_the_groups_beta():
    """Planted bug: a decay group's warm-up floored at ``min_value`` itself rather than at
    ``min(min_value, group beta)``, so a group whose beta is below ``min_value`` averaged
    with decay ``min_value`` (or the EMA refused to build). The group's decay is its beta
    from the first averaging call on, and the weights follow it."""
    net = two_linear()
    ema = EMA(
        net, beta=0.99, min_value=0.6, update_after_step=0, update_every=1,
        decay_groups={"1.*": 0.3},
    )  # fmt: skip
    ema.update()  # the initializing copy
    for k in range(4):
        before = ema_weights(ema)
        step_weights(net, k)
        ema.update()
        decays = ema.current_decays()
        assert decays["1.*"] == pytest.approx(0.3)
        assert decays["default"] >= 0.6  # the default group keeps its floor
        online = dict(net.state_dict())
        for name in ("1.weight", "1.bias"):
            want = before[name].lerp(online[name], 1 - 0.3)
            torch.testing.assert_close(ema_weights(ema)[name], want, rtol=0, atol=1e-6)
        want = before["0.weight"].lerp(online["0.weight"], 1 - decays["default"])
        torch.testing.assert_close(ema_weights(ema)["0.weight"], want, rtol=0, atol=1e-6)
