"""emakit.schedules: closed forms, argument checks, bounds, and how each schedule
composes with the EMA's step counting (update_after_step, update_every, min_value)."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from emakit import EMA, EMATypeError, EMAValueError
from emakit import schedules as S


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _inv_gamma(t: int, beta: float, inv_gamma: float, power: float, min_value: float) -> float:
    if t <= 0:
        return 0.0
    return _clamp(1 - (1 + t / inv_gamma) ** -power, min_value, beta)


# (schedule, closed form written from the formula, absolute tolerance)
CLOSED_FORMS = [
    (S.constant(0.999), lambda t: 0.999, 0.0),
    (S.constant(0.0), lambda t: 0.0, 0.0),
    (S.constant(1.0), lambda t: 1.0, 0.0),
    (S.linear_warmup(0.999, 1000), lambda t: min(0.999, (1 + t) / (1000 + 1)), 1e-15),
    (S.linear_warmup(0.5, 0), lambda t: min(0.5, (1 + t) / 1), 1e-15),
    (S.torch_ema_warmup(0.9999), lambda t: min(0.9999, (1 + t) / (10 + t)), 1e-15),
    (S.torch_ema_warmup(0.99), lambda t: min(0.99, (1 + t) / (10 + t)), 1e-15),
    (S.half_life(100), lambda t: 0.5 ** (1 / 100), 1e-15),
    (S.half_life(0.5), lambda t: 0.25, 1e-15),
    (S.linear_ramp(0.9, 0.999, 1000), lambda t: 0.9 + (0.999 - 0.9) * min(t / 1000, 1), 1e-15),
    (S.linear_ramp(0.999, 0.5, 10), lambda t: 0.999 + (0.5 - 0.999) * min(t / 10, 1), 1e-15),
    (
        S.cosine_momentum(0.996, 1000),
        lambda t: 1 - (1 - 0.996) * (math.cos(math.pi * min(t, 1000) / 1000) + 1) / 2,
        1e-15,
    ),
    (
        S.cosine_momentum(0.9, 500, beta1=0.99),
        lambda t: 0.99 - (0.99 - 0.9) * (math.cos(math.pi * min(t, 500) / 500) + 1) / 2,
        1e-15,
    ),
    # Karras et al.: beta(T) = (1 - 1/T)^(gamma+1), T = number of models averaged = t + 1.
    (S.power_function(6.94), lambda t: (1 - 1 / (t + 1)) ** (6.94 + 1), 1e-14),
    (S.power_function(0.0), lambda t: 1 - 1 / (t + 1), 1e-15),
    (S.power_function(16.97, update_every=10), lambda t: (1 - 1 / (t / 10 + 1)) ** 17.97, 1e-14),
    (S.cumulative_average(), lambda t: t / (t + 1), 1e-15),
    (S.cumulative_average(update_every=4), lambda t: (t / 4) / (t / 4 + 1), 1e-15),
    # float32 arithmetic (bit-compatible with ema-pytorch), hence the looser tolerance.
    (S.inverse_gamma(), lambda t: _inv_gamma(t, 0.9999, 1.0, 2 / 3, 0.0), 1e-6),
    (
        S.inverse_gamma(beta=0.999, inv_gamma=10.0, power=0.75, min_value=0.1),
        lambda t: _inv_gamma(t, 0.999, 10.0, 0.75, 0.1),
        1e-6,
    ),
]
TS = [0, 1, 2, 3, 5, 9, 10, 11, 99, 100, 101, 499, 500, 501, 998, 999, 1000, 1001]
TS += [5_000, 31_622, 10**5, 215_443, 10**6, 10**9]

# every public factory, with typical arguments
EVERY = [
    S.constant(0.999),
    S.inverse_gamma(),
    S.linear_warmup(0.999, 100),
    S.torch_ema_warmup(0.9999),
    S.half_life(50),
    S.linear_ramp(0.9, 0.999, 100),
    S.cosine_momentum(0.996, 100),
    S.power_function(6.94),
    S.cumulative_average(),
]


def _id(s: object) -> str:
    # inverse_gamma returns a plain function whose __doc__ spells its arguments
    return repr(s) if hasattr(s, "_factory") else str(s.__doc__)


@pytest.mark.parametrize(
    ("schedule", "closed", "tol"), CLOSED_FORMS, ids=[_id(c[0]) for c in CLOSED_FORMS]
)
def test_closed_form(schedule, closed, tol):
    for t in TS:
        assert schedule(t) == pytest.approx(closed(t), rel=0, abs=tol), t
        assert isinstance(schedule(t), float)


def test_endpoints():
    assert S.linear_ramp(0.9, 0.999, 1000)(0) == 0.9
    assert S.linear_ramp(0.9, 0.999, 1000)(1000) == 0.999
    assert S.cosine_momentum(0.996, 1000)(0) == pytest.approx(0.996, abs=1e-16)
    assert S.cosine_momentum(0.996, 1000)(1000) == 1.0
    assert S.cosine_momentum(0.996, 1000)(500) == pytest.approx(0.998, abs=1e-16)
    assert S.linear_warmup(0.999, 1000)(999) == 0.999
    assert S.linear_warmup(0.999, 1000)(998) < 0.999
    # the guide's numbers
    assert min(t for t in range(20_000) if S.torch_ema_warmup(1.0)(t) >= 0.999) == 8990
    assert S.power_function(0)(1) == 0.5
    assert S.half_life(693)(0) == pytest.approx(0.999, abs=1e-6)


@pytest.mark.parametrize(
    ("thresholds", "power"),
    [({0.999: 31_622, 0.9999: 999_999}, 2 / 3), ({0.999: 9_999, 0.9999: 215_443}, 3 / 4)],
)
def test_inverse_gamma_horizons(thresholds, power):
    """seed 004: power 2/3 reaches 0.999 at ~31.6k and 0.9999 at ~1M steps; 3/4 at ~10k, ~215k."""
    s = S.inverse_gamma(beta=1.0, power=power)
    for target, t in thresholds.items():
        lo, hi = 1, 10**7
        while lo < hi:  # first t with s(t) >= target (s is non-decreasing)
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if s(mid) < target else (lo, mid)
        assert abs(lo - t) <= 0.002 * t, (target, lo)


BAD = [
    (S.constant, {"beta": 1.5}, EMAValueError, "beta=1.5"),
    (S.constant, {"beta": -0.1}, EMAValueError, "beta=-0.1"),
    (S.constant, {"beta": math.nan}, EMAValueError, "beta=nan"),
    (S.constant, {"beta": "0.9"}, EMATypeError, "beta='0.9'"),
    (S.constant, {"beta": True}, EMATypeError, "beta=True"),
    (S.linear_warmup, {"beta": 0.99, "warmup": -1}, EMAValueError, "warmup=-1"),
    (S.linear_warmup, {"beta": 0.99, "warmup": 10.5}, EMATypeError, "warmup=10.5"),
    (S.linear_warmup, {"beta": 2, "warmup": 10}, EMAValueError, "beta=2"),
    (S.torch_ema_warmup, {"beta": 1.0001}, EMAValueError, "beta=1.0001"),
    (S.half_life, {"steps": 0}, EMAValueError, "steps=0"),
    (S.half_life, {"steps": -5}, EMAValueError, "steps=-5"),
    (S.half_life, {"steps": math.inf}, EMAValueError, "steps=inf"),
    (S.half_life, {"steps": None}, EMATypeError, "steps=None"),
    (S.linear_ramp, {"beta0": 0.9, "beta1": 1.1, "steps": 10}, EMAValueError, "beta1=1.1"),
    (S.linear_ramp, {"beta0": -1, "beta1": 0.9, "steps": 10}, EMAValueError, "beta0=-1"),
    (S.linear_ramp, {"beta0": 0.9, "beta1": 0.99, "steps": 0}, EMAValueError, "steps=0"),
    (S.linear_ramp, {"beta0": 0.9, "beta1": 0.99, "steps": 1e3}, EMATypeError, "steps=1000.0"),
    (S.cosine_momentum, {"beta0": 0.996, "total_steps": 0}, EMAValueError, "total_steps=0"),
    (S.cosine_momentum, {"beta0": 1.2, "total_steps": 10}, EMAValueError, "beta0=1.2"),
    (
        S.cosine_momentum,
        {"beta0": 0.99, "total_steps": 10, "beta1": -0.5},
        EMAValueError,
        "beta1=-0.5",
    ),
    (S.power_function, {"gamma": -1}, EMAValueError, "gamma=-1"),
    (S.power_function, {"gamma": math.inf}, EMAValueError, "gamma=inf"),
    (S.power_function, {"gamma": "7"}, EMATypeError, "gamma='7'"),
    (S.power_function, {"gamma": 7, "update_every": 0}, EMAValueError, "update_every=0"),
    (S.cumulative_average, {"update_every": 0}, EMAValueError, "update_every=0"),
    (S.cumulative_average, {"update_every": 2.0}, EMATypeError, "update_every=2.0"),
]


@pytest.mark.parametrize(("factory", "kwargs", "error", "echo"), BAD, ids=[b[3] for b in BAD])
def test_bad_arguments(factory, kwargs, error, echo):
    with pytest.raises(error) as info:
        factory(**kwargs)
    assert echo in str(info.value)


@pytest.mark.parametrize("schedule", EVERY[:1] + EVERY[2:], ids=repr)
def test_repr_pickle_equality(schedule):
    assert repr(schedule).startswith(type(schedule)._factory + "(")
    assert eval(repr(schedule), vars(S)) == schedule
    back = pickle.loads(pickle.dumps(schedule))
    assert back == schedule
    assert [back(t) for t in TS] == [schedule(t) for t in TS]
    assert isinstance(schedule, S.Schedule)
    assert schedule.per_optimizer_step == (type(schedule) is type(S.half_life(1)))


def test_ema_with_schedule_pickles_and_copies():
    ema = EMA(nn.Linear(2, 2), schedule=S.cosine_momentum(0.99, 100), update_after_step=0)
    for _ in range(3):
        ema.update()
    for other in (pickle.loads(pickle.dumps(ema)), copy.deepcopy(ema)):
        assert other.schedule == ema.schedule
        assert other.get_current_decay() == ema.get_current_decay()


# -- composition with the EMA ----------------------------------------------------------------


def _expected_decay(schedule, step: int, update_after_step: int, update_every: int, min_value):
    t = max(step - update_after_step - 1, 0)
    if t == 0:
        return 0.0
    d = schedule(t)
    if getattr(schedule, "per_optimizer_step", False):
        d **= update_every
    return _clamp(d, min_value, 1.0)


@pytest.mark.parametrize("schedule", EVERY, ids=_id)
@pytest.mark.parametrize(
    ("update_after_step", "update_every", "min_value"), [(3, 1, 0.0), (5, 1, 0.3), (10, 3, 0.9)]
)
def test_composes_with_ema(schedule, update_after_step, update_every, min_value):
    """Drive a float64 scalar through update(): the decay each update applies is
    ``clamp(schedule(t), min_value, 1)`` with the EMA's t, and get_current_decay() says so."""
    torch.manual_seed(0)
    net = nn.Linear(1, 1, bias=False).double()
    ema = EMA(
        net,
        schedule=schedule,
        update_after_step=update_after_step,
        update_every=update_every,
        min_value=min_value,
        beta=0.9999,
    )
    shadow = None
    for call in range(60):
        with torch.no_grad():
            net.weight.fill_(float(torch.randn(())))
        online = net.weight.item()
        ema.update()
        step = call + 1
        expected = _expected_decay(schedule, step, update_after_step, update_every, min_value)
        assert ema.get_current_decay() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        if call == 0:
            shadow = online
        elif call % update_every == 0:
            shadow = (
                online if call <= update_after_step else expected * shadow + (1 - expected) * online
            )
        assert ema.ema_model.weight.item() == pytest.approx(shadow, rel=1e-12, abs=1e-12), call


def _schedules_strategy():
    beta = st.floats(0.0, 1.0)
    steps = st.integers(1, 10**6)
    return st.one_of(
        st.builds(S.constant, beta),
        st.builds(
            lambda b, g, p, m: S.inverse_gamma(beta=b, inv_gamma=g, power=p, min_value=m * b),
            beta,
            st.floats(1e-3, 1e3),
            st.floats(1e-3, 10.0),
            st.floats(0.0, 1.0),
        ),
        st.builds(S.linear_warmup, beta, st.integers(0, 10**6)),
        st.builds(S.torch_ema_warmup, beta),
        st.builds(S.half_life, st.floats(1e-3, 1e9)),
        st.builds(S.linear_ramp, beta, beta, steps),
        st.builds(S.cosine_momentum, beta, steps, beta),
        st.builds(S.power_function, st.floats(-0.999, 100.0), st.integers(1, 100)),
        st.builds(S.cumulative_average, st.integers(1, 100)),
    )


@settings(max_examples=300, deadline=None)
@given(schedule=_schedules_strategy(), t=st.integers(0, 10**12))
def test_every_schedule_in_unit_interval(schedule, t):
    d = schedule(t)
    assert isinstance(d, float)
    assert 0.0 <= d <= 1.0


@settings(max_examples=100, deadline=None)
@given(
    schedule=_schedules_strategy(),
    step=st.integers(0, 10**9),
    update_after_step=st.integers(0, 1000),
    update_every=st.integers(1, 20),
    min_value=st.floats(0.0, 0.9999),
)
def test_ema_decay_is_the_clamped_schedule(
    schedule, step, update_after_step, update_every, min_value
):
    ema = EMA(
        nn.Linear(2, 2),
        schedule=schedule,
        update_after_step=update_after_step,
        update_every=update_every,
        min_value=min_value,
    )
    ema.load_state_dict({**ema.state_dict(), "step": torch.tensor(step)})
    d = ema.get_current_decay()
    assert d == _expected_decay(schedule, step, update_after_step, update_every, min_value)
    assert d == 0.0 or min_value <= d <= 1.0


@pytest.mark.parametrize("value", ["0.9", b"x", True, object()])
def test_a_schedule_returning_a_non_number_raises_an_ema_error(value):
    from emakit import EMATypeError

    ema = EMA(nn.Linear(2, 2), schedule=lambda t: value, update_after_step=0, update_every=1)
    ema.update()  # the first call copies
    with pytest.raises(EMATypeError, match=r"schedule .* returned .* a float in \[0, 1\]"):
        ema.update()


# -- half-life: the same time constant in optimizer steps whatever update_every ------------


def _step_response(schedule, update_every: int, n_steps: int) -> list[float]:
    """Shadow after each optimizer step when the weight jumps 0 -> 1 right after the
    averaging starts (update_after_step=0: the first update copies the 0)."""
    net = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        net.weight.zero_()
    ema = EMA(net, schedule=schedule, update_after_step=0, update_every=update_every)
    ema.update()
    with torch.no_grad():
        net.weight.fill_(1.0)
    out = []
    for _ in range(n_steps):
        ema.update()
        out.append(ema.ema_model.weight.item())
    return out


@pytest.mark.parametrize("h", [25, 40.5, 100])
def test_half_life_independent_of_update_every(h):
    n = int(10 * h) + 20
    every1, every10 = _step_response(S.half_life(h), 1, n), _step_response(S.half_life(h), 10, n)
    # half way after h optimizer steps with update_every=1 ...
    cross1 = next(k for k, v in enumerate(every1, start=1) if v >= 0.5 - 1e-12)
    assert cross1 == math.ceil(h)
    assert every1[cross1 - 1] == pytest.approx(1 - 0.5 ** (cross1 / h), rel=1e-12)
    # ... and within one update interval of it with update_every=10
    cross10 = next(k for k, v in enumerate(every10, start=1) if v >= 0.5 - 1e-12)
    assert cross1 <= cross10 < cross1 + 10
    # after each update the two agree exactly (same weight per optimizer step)
    for k in range(10, n + 1, 10):
        assert every10[k - 1] == pytest.approx(every1[k - 1], rel=1e-12), k
    # a per-update constant decay would take update_every times as many optimizer steps
    beta = 0.5 ** (1 / h)
    slow = _step_response(S.constant(beta), 10, n)
    assert all(v < 0.5 for v in slow[: int(9 * h)])


# -- cumulative average: exactly the running mean (SWA) ---------------------------------------


def test_cumulative_average_is_running_mean():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).double()
    ema = EMA(net, schedule=S.cumulative_average(), update_after_step=0, update_every=1)
    total = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    for k in range(1, 301):
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn_like(p) * 3 + k / 50)
        for n, p in net.named_parameters():
            total[n] += p.detach()
        ema.update()
        for n, p in ema.ema_model.named_parameters():
            torch.testing.assert_close(p, total[n] / k, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("update_after_step", "update_every"), [(0, 10), (100, 10), (6, 3)])
def test_cumulative_average_with_update_every(update_after_step, update_every):
    """cumulative_average(update_every=k) averages the models at the updating calls:
    the last warm-up copy and every update after it (update_after_step a multiple of k)."""
    torch.manual_seed(1)
    net = nn.Linear(4, 2).double()
    ema = EMA(
        net,
        schedule=S.cumulative_average(update_every=update_every),
        update_after_step=update_after_step,
        update_every=update_every,
    )
    seen = []
    for call in range(update_after_step + 20 * update_every):
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn_like(p))
        ema.update()
        if call % update_every == 0:
            if call <= update_after_step:
                seen = []  # warm-up: a copy restarts the average
            seen.append(net.weight.detach().clone())
        torch.testing.assert_close(
            ema.ema_model.weight, torch.stack(seen).mean(0), rtol=0, atol=1e-12
        )


def test_cumulative_average_matches_torch_swa():
    torch.manual_seed(2)
    net = nn.Linear(6, 3).double()
    swa = torch.optim.swa_utils.AveragedModel(net)
    ema = EMA(net, schedule=S.cumulative_average(), update_after_step=0, update_every=1)
    for _ in range(50):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        swa.update_parameters(net)
        ema.update()
    torch.testing.assert_close(ema.ema_model.weight, swa.module.weight, rtol=0, atol=1e-12)
    torch.testing.assert_close(ema.ema_model.bias, swa.module.bias, rtol=0, atol=1e-12)


def test_power_function_gamma0_is_cumulative_average():
    a, b = S.power_function(0.0), S.cumulative_average()
    assert all(a(t) == pytest.approx(b(t), rel=1e-15) for t in TS)
    a, b = S.power_function(0.0, update_every=7), S.cumulative_average(update_every=7)
    assert all(a(t) == pytest.approx(b(t), rel=1e-15) for t in TS)


def test_power_function_profile():
    """The averaged weights grow like k**gamma over the models seen (Karras et al. 2024)."""
    gamma, n = 2.0, 2000
    s = S.power_function(gamma)
    weights = [1.0]  # the model copied at t = 0
    for t in range(1, n):
        d = s(t)
        weights = [w * d for w in weights] + [1 - d]
    assert sum(weights) == pytest.approx(1.0, rel=1e-12)
    # relative to k**gamma / sum, far from the start
    k = torch.arange(1, n + 1, dtype=torch.float64)
    profile = k**gamma / (k**gamma).sum()
    got = torch.tensor(weights, dtype=torch.float64)
    torch.testing.assert_close(got[n // 10 :], profile[n // 10 :], rtol=5e-3, atol=0)


def test_torch_ema_warmup_matches_torch_ema():
    torch_ema = pytest.importorskip("torch_ema")
    torch.manual_seed(3)
    net = nn.Linear(5, 5).double()
    ref = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.99, use_num_updates=True)
    # torch_ema starts from the weights it was built with; emakit copies at the first update
    ema = EMA(net, schedule=S.torch_ema_warmup(0.99), update_after_step=0, update_every=1)
    ema.update()
    for _ in range(200):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ref.update()
        ema.update()
    for shadow, p in zip(ref.shadow_params, ema.ema_model.parameters(), strict=True):
        torch.testing.assert_close(p, shadow, rtol=0, atol=1e-12)


def _ema_pytorch_decay(t: int, beta: float, inv_gamma: float, power: float, min_value: float):
    """ema-pytorch 0.8.3's ``get_current_decay`` expression, op for op, at ``epoch = t``."""
    epoch = torch.tensor(t).clamp(min=0.0)  # an int64 step clamped with a float
    value = 1 - (1 + epoch / inv_gamma) ** -power
    return 0.0 if epoch.item() <= 0 else value.clamp(min=min_value, max=beta).item()


WARMUP_SETTINGS = [  # (power, inv_gamma, min_value, beta): every combination of the issue's
    (power, inv_gamma, min_value, beta)
    for power in (2 / 3, 0.5, 1.0, 2.0, 3 / 4)  # 0.5, 1, 2: torch's special-cased exponents
    for inv_gamma in (1.0, 0.5, 7.0)
    for min_value in (0.0, 0.3)
    for beta in (0.9999, 0.999)
]


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
def test_default_warmup_decay_is_ema_pytorchs_bit_for_bit(default_dtype):
    """The default decay against the real ema-pytorch package: ``get_current_decay()`` of
    both at the same step, over the warm-up and large steps up to 2**26, for every setting
    above, in float32 and (set as torch's default dtype) float64, as ema-pytorch computes."""
    import random

    ema_pytorch = pytest.importorskip("ema_pytorch")
    rng = random.Random(26)
    steps = [*range(0, 400), *(rng.randint(400, 1 << 26) for _ in range(300)), 1 << 26]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        for power, inv_gamma, min_value, beta in WARMUP_SETTINGS:
            kw = dict(beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value)
            net = nn.Linear(1, 1)
            theirs = ema_pytorch.EMA(net, update_after_step=3, include_online_model=False, **kw)
            ours = EMA(net, update_after_step=3, include_online_model=False, **kw)
            for step in steps:
                theirs.step.fill_(step)
                ours.step = step
                assert ours.get_current_decay() == theirs.get_current_decay(), (step, kw)
    finally:
        torch.set_default_dtype(previous)


def test_inverse_gamma_float32_is_ema_pytorchs_expression_for_odd_settings():
    """The schedule's value against ema-pytorch's own torch ops, over the warm-up and steps
    up to 2**31, for settings far from the defaults."""
    import random

    rng = random.Random(7)
    configs = [
        (0.9999, 1.0, 2 / 3, 0.0),
        (0.999, 1.0, 0.75, 0.0),
        (0.95, 0.5, 2 / 3, 0.6),
        (0.8, 0.01, 5.0, 0.0),
        (0.99999, 7.0, 0.01, 0.0),
        (0.9, 1e6, 3.0, 0.3),
        (0.9, 10.0, 0.5, 0.3),  # torch's pow by -0.5 is 1 / sqrt
        (0.99, 2.0, 1.0, 0.0),  # by -1 a reciprocal
        (0.99, 0.5, 2.0, 0.0),  # by -2 is 1 / (x * x)
    ]
    for beta, inv_gamma, power, min_value in configs:
        s = S.inverse_gamma(beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value)
        for t in [*range(0, 400), *(rng.randint(1, 1 << 31) for _ in range(400))]:
            expected = _ema_pytorch_decay(t, beta, inv_gamma, power, min_value)
            kw = dict(beta=beta, inv_gamma=inv_gamma, power=power, min_value=min_value)
            assert s(t) == S.inverse_gamma_float32(t, **kw) == expected, (t, kw)
