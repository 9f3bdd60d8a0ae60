"""emakit.averaging: interpolate (weighted averages of models / state dicts) and update_bn
(BatchNorm statistics recomputed for averaged weights)."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import OrderedDict
from functools import partial

import pytest
import torch
from torch import nn

from _models import conv_bn_classifier
from emakit import EMA, EMAStateError, EMATypeError, EMAValueError
from emakit import schedules as S
from emakit.averaging import interpolate, update_bn

_net = partial(conv_bn_classifier, image_size=6, out_features=2, seed=None)  # callers seed


def _randomized(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = _net()
    with torch.no_grad():
        for b in net.buffers():
            if b.is_floating_point():
                b.copy_(torch.rand_like(b) + 0.5)
            else:
                b.fill_(seed + 10)
    return net


# -- interpolate --------------------------------------------------------------------------


def test_interpolate_hand_formula_modules():
    a, b, c = _randomized(0), _randomized(1), _randomized(2)
    out = interpolate([a, b, c], [0.5, 0.3, 0.2])
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert list(out) == list(sa)
    for k, v in out.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.5 * sa[k] + 0.3 * sb[k] + 0.2 * sc[k])
        else:  # num_batches_tracked: from the first model
            assert torch.equal(v, sa[k])
            assert v.dtype == sa[k].dtype
    # the result loads straight into the architecture
    _net().load_state_dict(out)


def test_interpolate_state_dicts_normalize_and_default_weights():
    a = {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([2.0, 0.0]), "n": torch.tensor(9)}
    torch.testing.assert_close(interpolate([a, b], [7, 3])["w"], torch.tensor([0.6, 2.8]))
    torch.testing.assert_close(interpolate([a, b])["w"], torch.tensor([1.0, 2.0]))
    # normalize=False: the weights as given (here summing to 2)
    torch.testing.assert_close(
        interpolate([a, b], [1.0, 1.0], normalize=False)["w"], torch.tensor([2.0, 4.0])
    )
    assert interpolate([a, b], [0.0, 1.0])["n"].item() == 3  # ints: always the first
    assert interpolate([a, b], torch.tensor([0.25, 0.75]))["w"].tolist() == [1.5, 1.0]
    out = interpolate([a], [5])
    assert out["w"] is not a["w"] and torch.equal(out["w"], a["w"])


def test_interpolate_mixed_module_state_dict_and_ema():
    """0.7 x EMA + 0.3 x SWA, the seed's recipe, with an EMA object and a state dict."""
    torch.manual_seed(0)
    net = nn.Linear(3, 3).double()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    swa = EMA(net, schedule=S.cumulative_average(), update_after_step=0, update_every=1)
    for _ in range(20):
        with torch.no_grad():
            net.weight.add_(torch.randn_like(net.weight))
        ema.update()
        swa.update()
    out = interpolate([ema, swa.ema_model.state_dict()], [0.7, 0.3])
    torch.testing.assert_close(
        out["weight"], 0.7 * ema.ema_model.weight + 0.3 * swa.ema_model.weight, rtol=0, atol=1e-15
    )
    assert set(out) == {"weight", "bias"}
    averaged = torch.optim.swa_utils.AveragedModel(net)
    out = interpolate([averaged, net], [1, 1])
    assert set(out) == {"weight", "bias"}


def test_interpolate_dtypes():
    a = {
        "h": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "d": torch.tensor([1.0], dtype=torch.float64),
    }
    b = {
        "h": torch.tensor([2.0, 3.0], dtype=torch.bfloat16),
        "d": torch.tensor([1e-17], dtype=torch.float64),
    }
    out = interpolate([a, b], [0.5, 0.5])
    assert out["h"].dtype == torch.bfloat16 and out["d"].dtype == torch.float64
    assert out["h"].tolist() == [1.5, 2.5]
    assert out["d"].item() == (1.0 + 1e-17) / 2  # float64 is not narrowed to float32
    # bf16 terms are summed in float32: 1/3 of three values is not rounded three times
    x = [{"h": torch.tensor([v], dtype=torch.bfloat16)} for v in (1.0, 1.0078125, 1.015625)]
    got = interpolate(x)["h"]
    want = (sum(t["h"].float() for t in x) / 3).to(torch.bfloat16)
    assert torch.equal(got, want)
    # the first input's dtype wins when inputs differ (fp32 EMA + bf16 model)
    mixed = interpolate([{"w": torch.ones(2)}, {"w": torch.zeros(2, dtype=torch.bfloat16)}], [1, 1])
    assert mixed["w"].dtype == torch.float32 and mixed["w"].tolist() == [0.5, 0.5]


def test_interpolate_int_and_bool_buffers_not_averaged():
    a = {"i": torch.tensor([1, 2], dtype=torch.int64), "m": torch.tensor([True, False])}
    b = {"i": torch.tensor([100, 200], dtype=torch.int64), "m": torch.tensor([False, False])}
    out = interpolate([a, b], [0.1, 0.9])
    assert out["i"].tolist() == [1, 2] and out["i"].dtype == torch.int64
    assert out["m"].tolist() == [True, False]


def test_interpolate_key_mismatch_names_missing_and_extra():
    a = {"x": torch.zeros(1), "y": torch.zeros(1)}
    b = {"x": torch.zeros(1), "z": torch.zeros(1)}
    with pytest.raises(EMAStateError) as info:
        interpolate([a, b], [0.5, 0.5])
    msg = str(info.value)
    assert "missing ['y']" in msg and "extra ['z']" in msg and "[1]" in msg
    with pytest.raises(EMAStateError, match="shape"):
        interpolate([{"x": torch.zeros(2)}, {"x": torch.zeros(3)}])
    with pytest.raises(EMAStateError, match="missing"):
        interpolate([nn.Linear(2, 2), nn.Linear(2, 2, bias=False)])


@pytest.mark.parametrize(
    ("weights", "error", "echo"),
    [
        ([0.5, -0.5], EMAValueError, "-0.5"),
        ([0.5, math.nan], EMAValueError, "nan"),
        ([0.5, math.inf], EMAValueError, "inf"),
        ([0.0, 0.0], EMAValueError, "weights=[0.0, 0.0]"),
        ([1.0], EMAValueError, "2 models but 1 weights"),
        (["a", 1.0], EMATypeError, "'a'"),
        ("ab", EMATypeError, "weights='ab'"),
        (0.5, EMATypeError, "weights=0.5"),
    ],
)
def test_interpolate_bad_weights(weights, error, echo):
    sd = {"x": torch.zeros(1)}
    with pytest.raises(error) as info:
        interpolate([sd, sd], weights)
    assert echo in str(info.value)


def test_interpolate_bad_inputs():
    with pytest.raises(EMAValueError, match="empty"):
        interpolate([], [])
    with pytest.raises(EMATypeError, match="wrap it"):
        interpolate(nn.Linear(2, 2), [1.0])
    with pytest.raises(EMATypeError, match=r"models_or_state_dicts\[1\]"):
        interpolate([{"x": torch.zeros(1)}, 3], [1, 1])
    with pytest.raises(EMATypeError, match="normalize"):
        interpolate([{"x": torch.zeros(1)}], normalize=1)


# -- update_bn ----------------------------------------------------------------------------


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Dropout(0.0),
        nn.Flatten(),
        nn.Linear(3 * 5 * 5, 4),
        nn.BatchNorm1d(4),
    ).double()


def _batches(sizes: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, 2, 5, 5, generator=g, dtype=torch.float64) * 2 + 3 for n in sizes]


def _expected_stats(
    net: nn.Module, batches: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Mean and unbiased variance of every BN layer's input over all the batches
    (train mode: the layers before it normalize each batch by its own statistics)."""
    seen: dict[nn.Module, list[torch.Tensor]] = {}
    hooks = []
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            seen[m] = []
            hooks.append(m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0])))
    net.train()
    with torch.no_grad():
        for x in batches:
            net(x)
    for h in hooks:
        h.remove()
    stats = []
    for xs in seen.values():
        x = torch.cat(xs)
        dims = [0, *range(2, x.dim())]
        stats.append((x.mean(dims), x.var(dims, unbiased=True)))
    return stats


@pytest.mark.parametrize("sizes", [[64], [16, 16, 16, 16], [5, 30, 2, 27]])
@pytest.mark.parametrize("layout", ["tensor", "tuple", "list", "dict"])
def test_update_bn_exact_data_statistics(sizes, layout):
    net = _bn_net()
    xs = _batches(sizes)
    bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns]
    if layout == "tensor":
        loader = xs
    elif layout == "tuple":
        loader = [(x, torch.zeros(len(x))) for x in xs]
    elif layout == "list":
        loader = [[x, torch.zeros(len(x))] for x in xs]
    else:
        loader = [{"input": x, "label": torch.zeros(len(x))} for x in xs]
    expected = _expected_stats(_bn_net(), xs)
    # the first BN sees the raw data through a conv: its statistics are exactly those of
    # the whole data set, as if it were one batch
    h = _bn_net()[0](torch.cat(xs)).detach()
    torch.testing.assert_close(expected[0][0], h.mean((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(expected[0][1], h.var((0, 2, 3)), rtol=1e-12, atol=1e-12)
    net.eval()
    update_bn(loader, net)
    for bn, (mean, var), (m0, v0) in zip(bns, expected, before, strict=True):
        assert not torch.equal(bn.running_mean, m0) and not torch.equal(bn.running_var, v0)
        torch.testing.assert_close(bn.running_mean, mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(bn.running_var, var, rtol=1e-10, atol=1e-12)
        assert bn.num_batches_tracked.item() == len(sizes)
        assert bn.momentum == 0.1 and bn.track_running_stats
    assert not net.training and not any(m.training for m in net.modules())


def test_update_bn_equal_batches_agrees_with_torch_on_mean():
    """With equal batches torch's update_bn gets the same mean; its variance (a mean of
    per-batch variances) misses the spread between batches, ours does not."""
    xs = _batches([8, 8, 8, 8])
    ours, ref = _bn_net(), _bn_net()
    update_bn(xs, ours)
    torch.optim.swa_utils.update_bn(xs, ref)
    expected = _expected_stats(_bn_net(), xs)
    torch.testing.assert_close(ours[1].running_mean, ref[1].running_mean, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(ref[1].running_var, expected[0][1], rtol=1e-6)
    torch.testing.assert_close(ours[1].running_var, expected[0][1], rtol=1e-10, atol=1e-12)


def test_update_bn_float32_and_restores_modes():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(3, 8), nn.BatchNorm1d(8, momentum=0.3), nn.Dropout(0.5), nn.Linear(8, 1)
    )
    net.train()
    net[2].eval()  # per-module modes come back as they were, not just the root's
    data = [torch.randn(32, 3) * 5 + 1 for _ in range(5)]
    update_bn(data, net)
    assert net.training and net[1].training and not net[2].training
    assert net[1].momentum == 0.3
    x = torch.cat(data)
    h = net[0](x).detach()
    torch.testing.assert_close(net[1].running_mean, h.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net[1].running_var, h.var(0, unbiased=True), rtol=1e-5, atol=1e-5)


def test_update_bn_on_ema_and_device_and_input_fn():
    torch.manual_seed(0)
    net = _bn_net()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    ema.update()
    xs = _batches([10, 10])
    update_bn([{"x": x} for x in xs], ema, device="cpu", input_fn=lambda b: b["x"])
    expected = _expected_stats(_bn_net(), xs)
    torch.testing.assert_close(
        ema.ema_model[1].running_mean, expected[0][0], rtol=1e-10, atol=1e-12
    )
    # the online model is untouched
    assert torch.equal(net[1].running_mean, torch.zeros(3))


def test_update_bn_edge_cases():
    net = nn.Sequential(nn.Linear(2, 2))
    update_bn([torch.randn(4, 2)], net)  # no BatchNorm: nothing to do
    bn_net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(EMAValueError, match="no batches"):
        update_bn([], bn_net)
    assert torch.equal(bn_net[1].running_var, torch.ones(2))
    assert bn_net[1].track_running_stats
    # a failing pass leaves the statistics and settings as they were
    with pytest.raises(RuntimeError):
        update_bn([torch.randn(4, 2), torch.randn(4, 7)], bn_net)
    assert torch.equal(bn_net[1].running_mean, torch.zeros(2))
    assert bn_net[1].track_running_stats and bn_net[1].num_batches_tracked.item() == 0

    # a BatchNorm the pass never reaches keeps its statistics, with a warning
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.BatchNorm1d(2), nn.BatchNorm1d(2)

        def forward(self, x):
            return self.used(x)

    b = Branchy()
    with pytest.warns(RuntimeWarning, match="unused"):
        update_bn([torch.randn(4, 2)], b)
    assert b.used.num_batches_tracked.item() == 1 and b.unused.num_batches_tracked.item() == 0
    # BatchNorm without running statistics is skipped
    nostats = nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False))
    update_bn([torch.randn(4, 2)], nostats)
    with pytest.raises(EMATypeError, match="model"):
        update_bn([torch.randn(4, 2)], OrderedDict())
    lazy = nn.Sequential(nn.LazyBatchNorm1d())
    with pytest.raises(EMAStateError, match="lazy"):
        update_bn([torch.randn(4, 2)], lazy)


def test_import_does_not_pull_matplotlib():
    code = (
        "import sys, emakit, emakit.averaging, emakit.schedules; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
