"""Properties of the EMA that hold for any configuration (hypothesis).

* the EMA of a constant is that constant;
* the EMA stays inside the elementwise range of the values it has seen;
* every engine path (``use_foreach`` False/True/None, flattened model or not) equals a
  plain reference loop written here, bit for bit;
* ``state_dict`` -> fresh EMA -> ``load_state_dict`` is the identity, and both continue
  identically;
* every schedule in ``emakit.schedules.__all__`` stays within ``[min_value, beta]`` and
  ``[0, 1]``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from _models import reference_ema_step
from emakit import EMA, EMAError, EMAPytree, flatten_parameters, schedules
from emakit.schedules import inverse_gamma_float32

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A bf16/fp16 model gets an fp32 shadow (ema_dtype), as mixed-precision users run it.
DTYPES = {
    "float32": (torch.float32, None),
    "float64": (torch.float64, None),
    "bfloat16": (torch.bfloat16, torch.float32),
    "float16": (torch.float16, torch.float32),
}


class Bag(nn.Module):
    """Parameters of drawn shapes, a float64 buffer and an integer buffer."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList(
            nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes
        )
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("stat", torch.randn(3, generator=gen, dtype=torch.float64))


@dataclass
class Config:
    shapes: list[tuple[int, ...]]
    dtype: str
    beta: float
    update_after_step: int
    update_every: int
    calls: int
    seed: int
    flatten: bool

    def kwargs(self) -> dict:
        return dict(
            beta=self.beta,
            update_after_step=self.update_after_step,
            update_every=self.update_every,
            ema_dtype=DTYPES[self.dtype][1],
        )

    def model(self) -> Bag:
        net = Bag(self.shapes, DTYPES[self.dtype][0], self.seed)
        if self.flatten:
            flatten_parameters(net)
        return net


shapes = st.lists(
    st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5
)
configs = st.builds(
    Config,
    shapes=shapes,
    dtype=st.sampled_from(sorted(DTYPES)),
    beta=st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.5, 0.9, 0.999, 0.9999, 1.0])),
    update_after_step=st.integers(0, 4),
    update_every=st.integers(1, 4),
    calls=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    flatten=st.booleans(),
)


def perturb(net: Bag, gen: torch.Generator, scale: float = 1.0) -> None:
    """What a training step does to the online model: new weights and statistics."""
    with torch.no_grad():
        for p in net.ps:
            p.copy_(torch.randn(p.shape, generator=gen) * scale + scale)
        net.count.add_(1)
        net.stat.copy_(torch.randn(3, generator=gen, dtype=torch.float64) * scale)


def tracked(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert set(a) == set(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype, (what, k, a[k].dtype, b[k].dtype)
        assert torch.equal(a[k], b[k]), (what, k, (a[k].double() - b[k].double()).abs().max())


# -- the reference --------------------------------------------------------------------------


def reference_run(cfg: Config, use_gen_seed: int) -> dict[str, torch.Tensor]:
    """The EMA semantics written out per tensor, independent of the engine.

    Call counter ``step`` (after increment); the first call copies; calls with
    ``(step - 1) % update_every`` do nothing; ``step - 1 <= update_after_step`` copies;
    otherwise ``shadow.lerp_(online, 1 - decay)`` for floating tensors (copy for integer
    ones) with ``decay`` the inverse-gamma warm-up at ``t = step - update_after_step - 1``.
    """
    net = cfg.model()
    gen = torch.Generator().manual_seed(use_gen_seed)
    shadow_dtype = DTYPES[cfg.dtype][1]
    shadow: dict[str, torch.Tensor] | None = None
    for step in range(1, cfg.calls + 1):
        perturb(net, gen)
        online = net.state_dict()
        if shadow is None:
            shadow = {
                # ema_dtype only widens: a float64 buffer keeps float64
                k: v.detach().clone().to(torch.promote_types(v.dtype, shadow_dtype))
                if shadow_dtype and v.is_floating_point()
                else v.detach().clone()
                for k, v in online.items()
            }
            continue
        if (step - 1) % cfg.update_every:
            continue
        if step - 1 <= cfg.update_after_step:
            for k, v in online.items():
                shadow[k].copy_(v)
            continue
        if cfg.beta == 1.0:
            continue
        t = max(step - cfg.update_after_step - 1, 0)
        decay = inverse_gamma_float32(t, beta=cfg.beta, inv_gamma=1.0, power=2 / 3, min_value=0.0)
        reference_ema_step(shadow, online, decay)
    assert shadow is not None
    return shadow


def emakit_run(cfg: Config, gen_seed: int, use_foreach: bool | None) -> dict[str, torch.Tensor]:
    net = cfg.model()
    ema = EMA(net, use_foreach=use_foreach, **cfg.kwargs())
    gen = torch.Generator().manual_seed(gen_seed)
    for _ in range(cfg.calls):
        perturb(net, gen)
        ema.update()
    return tracked(ema.ema_model)


@SETTINGS
@given(cfg=configs, gen_seed=st.integers(0, 2**16))
def test_every_engine_path_equals_the_reference_loop(cfg, gen_seed):
    expected = reference_run(cfg, gen_seed)
    for use_foreach in (False, True, None):
        assert_equal(emakit_run(cfg, gen_seed, use_foreach), expected, f"{use_foreach=}")


# -- constant and range ---------------------------------------------------------------------


@SETTINGS
@given(cfg=configs, use_foreach=st.sampled_from([False, True, None]))
def test_ema_of_a_constant_is_that_constant(cfg, use_foreach):
    net = cfg.model()
    ema = EMA(net, use_foreach=use_foreach, **cfg.kwargs())
    for _ in range(cfg.calls):
        ema.update()  # the online weights never change
    for k, v in net.state_dict().items():
        s = ema.ema_model.state_dict()[k]
        assert torch.equal(s, v.to(s.dtype)), k


@SETTINGS
@given(
    cfg=configs,
    use_foreach=st.sampled_from([False, True, None]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_ema_stays_within_the_range_it_has_seen(cfg, use_foreach, scale):
    net = cfg.model()
    ema = EMA(net, use_foreach=use_foreach, **cfg.kwargs())
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    low = high = None
    for _ in range(cfg.calls):
        perturb(net, gen, scale)
        # as the shadow sees them: cast to its dtype (rounding is monotone, so the bounds hold)
        shadow = ema.ema_model.state_dict()
        seen = {
            k: v.detach().to(shadow[k].dtype).to(torch.float64, copy=True)
            for k, v in net.state_dict().items()
        }
        low = seen if low is None else {k: torch.minimum(low[k], v) for k, v in seen.items()}
        high = seen if high is None else {k: torch.maximum(high[k], v) for k, v in seen.items()}
        ema.update()
        for k, s in ema.ema_model.state_dict().items():
            s = s.double()
            assert bool(((s >= low[k]) & (s <= high[k])).all()), k


# -- state round trip -----------------------------------------------------------------------


@SETTINGS
@given(
    cfg=configs,
    use_foreach=st.sampled_from([False, True, None]),
    more=st.integers(0, 8),
    pytree=st.booleans(),
)
def test_state_dict_round_trip_is_the_identity(cfg, use_foreach, more, pytree):
    net = cfg.model()
    gen = torch.Generator().manual_seed(cfg.seed + 2)

    def make() -> EMA | EMAPytree:
        if pytree:
            return EMAPytree(dict(net.named_parameters()), use_foreach=use_foreach, **cfg.kwargs())
        return EMA(net, use_foreach=use_foreach, **cfg.kwargs())

    original = make()
    for _ in range(cfg.calls):
        perturb(net, gen)
        original.update()
    state = original.state_dict()
    copy = make()  # a fresh EMA of the same online model
    copy.load_state_dict(state)
    assert_equal(copy.state_dict(), state, "after load")
    assert int(copy.step) == int(original.step) == cfg.calls
    for _ in range(more):
        perturb(net, gen)
        original.update()
        copy.update()
    assert_equal(copy.state_dict(), original.state_dict(), "after continuing")


# -- schedules ------------------------------------------------------------------------------

# Valid values for the argument names schedules use. A schedule with a required argument
# missing here fails the test with a message saying so: add a strategy for it.
ARG_STRATEGIES: dict[str, st.SearchStrategy] = {
    "inv_gamma": st.floats(0.05, 20.0),
    "power": st.floats(0.05, 3.0),
    "warmup": st.integers(0, 10_000),
    "warmup_steps": st.integers(0, 10_000),
    "half_life": st.floats(0.5, 1e6),
    "half_life_steps": st.floats(0.5, 1e6),
    "update_every": st.integers(1, 16),
    "total_steps": st.integers(1, 10**6),
    "max_steps": st.integers(1, 10**6),
    "num_steps": st.integers(1, 10**6),
    "steps": st.integers(1, 10**6),
    "ramp_steps": st.integers(1, 10**6),
    "gamma": st.floats(0.05, 50.0),
    "sigma_rel": st.floats(0.01, 0.25),
    "start": st.floats(0.0, 1.0),
    "end": st.floats(0.0, 1.0),
    "final": st.floats(0.0, 1.0),
    "base": st.floats(0.0, 1.0),
    "base_momentum": st.floats(0.0, 1.0),
    "final_momentum": st.floats(0.0, 1.0),
    "beta0": st.floats(0.0, 1.0),
    "beta1": st.floats(0.0, 1.0),
    "beta_start": st.floats(0.0, 1.0),
    "beta_end": st.floats(0.0, 1.0),
    "momentum": st.floats(0.0, 1.0),
    "decay": st.floats(0.0, 1.0),
}
STEP_ARGS = ("t", "step")
# float32 schedules (ema-pytorch's arithmetic) clamp to float32(beta), which can exceed
# the Python float beta by half a float32 ulp.
SLACK = 2.0**-24


def schedule_names() -> list[str]:
    names = []
    for name in schedules.__all__:
        obj = getattr(schedules, name)
        if callable(obj) and not inspect.isclass(obj) and name != "describe":
            names.append(name)
    return names


def draw_kwargs(fn, data, skip: int) -> dict:
    kwargs: dict = {}
    params = list(inspect.signature(fn).parameters.values())[skip:]
    names = {p.name for p in params}
    if "beta" in names:
        kwargs["beta"] = data.draw(
            st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 0.9, 0.9999, 1.0])), label="beta"
        )
    if "min_value" in names:
        kwargs["min_value"] = data.draw(st.floats(0.0, kwargs.get("beta", 1.0)), label="min_value")
    for p in params:
        if p.name in kwargs or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in ARG_STRATEGIES:
            kwargs[p.name] = data.draw(ARG_STRATEGIES[p.name], label=p.name)
        elif p.default is inspect.Parameter.empty:
            pytest.fail(
                f"schedules.{fn.__name__} needs {p.name!r}, which tests/test_properties.py "
                f"has no valid values for: add it to ARG_STRATEGIES"
            )
    return kwargs


@pytest.mark.parametrize("name", schedule_names())
@SETTINGS
@given(data=st.data())
def test_every_schedule_stays_in_bounds(name, data):
    fn = getattr(schedules, name)
    params = list(inspect.signature(fn).parameters.values())
    direct = bool(params) and params[0].name in STEP_ARGS  # fn(t, ...) is itself the decay
    kwargs = draw_kwargs(fn, data, skip=1 if direct else 0)
    if direct:
        schedule = lambda t: fn(t, **kwargs)  # noqa: E731
    else:
        try:
            schedule = fn(**kwargs)
        except EMAError:
            assume(False)  # an invalid combination of drawn arguments; the factory said so
        if not callable(schedule):
            pytest.skip(f"schedules.{name} is not a schedule factory (returned {schedule!r})")
    ts = [0, 1, 2, 3, 10, 100, 10_000, *data.draw(st.lists(st.integers(0, 10**8), max_size=8))]
    low = kwargs.get("min_value", 0.0)
    high = kwargs.get("beta", 1.0)
    if "beta0" in kwargs and "beta1" in kwargs:  # ramps: between their two ends
        low, high = sorted((kwargs["beta0"], kwargs.get("beta1", 1.0)))
    for t in ts:
        d = float(schedule(t))
        assert math.isfinite(d), (t, d)
        assert -SLACK <= d <= 1.0 + SLACK, (t, d)
        assert low - SLACK <= d or t == 0, (t, d, low)  # t == 0: no averaging yet (decay 0)
        assert d <= high + SLACK, (t, d, high)
