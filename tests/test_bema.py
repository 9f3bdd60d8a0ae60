"""BEMA (bias-corrected EMA, arXiv:2508.00180): the rule against TRL's formulas, the
update against a per-tensor reference loop, resume, swap/forward, offload, bad input."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from emakit import BEMA, EMAStateError, EMATypeError, EMAValueError
from emakit.decay import bema_rule

SETTINGS = {"update_freq": 3, "update_after": 2, "lag": 4, "ema_power": 0.5, "bias_power": 0.2}


def net(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(16, 4, generator=g, dtype=next(model.parameters()).dtype)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class Reference:
    """TRL's BEMACallback algorithm, one tensor at a time, with ``lerp_`` for the EMA; the
    evaluated weights are built when read, from the model's weights then, with the
    ``alpha_t`` of the most recent averaging update (0 before the first)."""

    def __init__(self, model: nn.Module, **settings: float) -> None:
        self.rule = bema_rule(**settings)
        self.params = dict(model.named_parameters())
        self.theta0 = {k: p.detach().clone() for k, p in self.params.items()}
        self.ema = {k: p.detach().clone() for k, p in self.params.items()}
        self.alpha = 0.0

    @torch.no_grad()
    def step(self, t: int) -> None:
        r = self.rule
        if t < r.update_after:
            return
        if t == r.update_after:
            for k, p in self.params.items():
                self.theta0[k].copy_(p)
                self.ema[k].copy_(p)
        elif (t - r.update_after) % r.update_freq == 0:
            beta, self.alpha = r.beta(t), r.alpha(t)
            for k, p in self.params.items():
                self.ema[k].lerp_(p, beta)

    @property
    def out(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {
                k: self.ema[k] + self.alpha * (p - self.theta0[k]) for k, p in self.params.items()
            }


def test_rule_timing():
    rule = bema_rule(**SETTINGS)
    kinds = [rule.action(t - 1, 0).kind for t in range(1, 12)]
    # t=1 skip (t < update_after), t=2 snapshot, then every 3rd call from t=5
    expected = ["skip", "copy", "skip", "skip", "lerp", "skip", "skip", "lerp"]
    assert kinds == [*expected, "skip", "skip", "lerp"]
    a = rule.action(4, 0)
    assert a.call == 5
    assert a.weights == (rule.beta(5),)
    assert a.bias == (4 + 5) ** -0.2


@pytest.mark.parametrize(
    ("kw", "model_dtype"),
    [
        ({}, torch.float64),
        ({"device": "cpu"}, torch.float64),  # offloaded: the background thread
        ({"device": "cpu", "async_update": False}, torch.float64),
        ({"ema_dtype": torch.float64}, torch.float32),  # staged through a wider buffer
    ],
    ids=["inline", "offload-thread", "offload-sync", "ema_dtype"],
)
def test_matches_the_reference_loop(kw: dict, model_dtype: torch.dtype):
    model = net(model_dtype)
    ref_model = copy.deepcopy(model).double()
    bema = BEMA(model, **SETTINGS, **kw)
    ref = Reference(ref_model, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    for t in range(1, 15):
        train_step(model, opt, t)
        bema.update()
        if model_dtype == torch.float64:
            train_step(ref_model, ref_opt, t)
        else:  # follow the float32 model's trajectory exactly
            with torch.no_grad():
                for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
                    p.copy_(q)
        ref.step(t)
        state, out = bema.state_dict(), ref.out
        for name in out:
            assert torch.equal(state[f"ema_model.{name}"], out[name]), (t, name)
            assert torch.equal(state[f"bema_ema.{name}"], ref.ema[name]), (t, name)
            assert torch.equal(state[f"bema_theta0.{name}"], ref.theta0[name]), (t, name)
    assert bema.get_current_decay() == pytest.approx(1 - bema.rule.beta(14))
    assert bema.bias_weight == bema.rule.alpha(14)


def test_resume_is_bit_exact():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bema = BEMA(model, **SETTINGS)
    for t in range(1, 8):
        train_step(model, opt, t)
        bema.update()
    buffer = io.BytesIO()
    torch.save({"bema": bema.state_dict(), "model": model.state_dict()}, buffer)
    for t in range(8, 20):
        train_step(model, opt, t)
        bema.update()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    model2 = net()
    model2.load_state_dict(saved["model"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    bema2 = BEMA(model2, **SETTINGS)
    bema2.load_state_dict(saved["bema"])
    assert int(bema2.step) == 7
    for t in range(8, 20):
        train_step(model2, opt2, t)
        bema2.update()
    a, b = bema.state_dict(), bema2.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_swap_and_forward_use_the_bema_weights():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    bema = BEMA(model, update_freq=1, lag=10)
    for t in range(1, 5):
        train_step(model, opt, t)
        bema.update()
    x = torch.randn(3, 4, dtype=torch.float64)
    evaluated = copy.deepcopy(model)
    evaluated.load_state_dict(
        {
            k.removeprefix("ema_model."): v
            for k, v in bema.state_dict().items()
            if k.startswith("ema_model.")
        }
    )
    expected = evaluated(x)
    assert not torch.equal(expected, model(x))  # BEMA differs from the raw weights
    assert torch.equal(bema(x), expected)
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with bema.swap():
        assert torch.equal(model(x), expected)
    for k, v in model.state_dict().items():
        assert torch.equal(v, raw[k])


def test_copy_params_from_model_to_ema_restarts_all_three():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    bema = BEMA(model, update_freq=1)
    for t in range(1, 4):
        train_step(model, opt, t)
        bema.update()
    bema.copy_params_from_model_to_ema()
    state = bema.state_dict()
    for name, p in model.named_parameters():
        for key in ("ema_model.", "bema_ema.", "bema_theta0."):
            assert torch.equal(state[key + name], p), key + name


def test_state_of_other_settings_is_refused():
    model = net()
    state = BEMA(model, update_freq=5).state_dict()
    other = BEMA(model, update_freq=6)
    with pytest.raises(EMAStateError, match="update_freq=5"):
        other.load_state_dict(state)


def test_state_missing_bema_tensors_is_refused():
    model = net()
    bema = BEMA(model)
    state = {k: v for k, v in bema.state_dict().items() if not k.startswith("bema_theta0.")}
    with pytest.raises(EMAStateError, match="bema_theta0"):
        bema.load_state_dict(state)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"update_freq": 0}, EMAValueError, "update_freq"),
        ({"update_freq": 2.5}, EMATypeError, "update_freq"),
        ({"ema_power": -1.0}, EMAValueError, "ema_power"),
        ({"multiplier": 0.0}, EMAValueError, "multiplier"),
        ({"min_ema_multiplier": 1.5}, EMAValueError, "min_ema_multiplier"),
        ({"update_after": -1}, EMAValueError, "update_after"),
        ({"lag": 0, "multiplier": 0.1, "update_freq": 1}, EMAValueError, "raise lag"),
    ],
)
def test_bad_settings(kw: dict, error: type, match: str):
    with pytest.raises(error, match=match):
        BEMA(net(), **kw)


def test_picklable_and_deepcopyable():
    model = net()
    bema = BEMA(model, update_freq=1, device="cpu")
    bema.update()
    clone = copy.deepcopy(bema)
    clone.update()
    assert int(clone.step) == 2
    assert int(bema.step) == 1


def test_frozen_weights_are_shared_or_held_and_thaw():
    model = net()
    model[0].requires_grad_(False)
    shared = BEMA(model, update_freq=1)
    assert shared.ema_model[0].weight.data_ptr() == model[0].weight.data_ptr()
    held = BEMA(model, update_freq=1, ema_dtype=torch.float64)  # a wider copy: not shareable
    for bema in (shared, held):
        assert not any(k.startswith(("bema_ema.0.", "bema_theta0.0.")) for k in bema.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(1, 4):
        if t == 3:
            model[0].requires_grad_(True)  # trained again from here on
        train_step(model, opt, t)
        shared.update()
        held.update()
    for bema in (shared, held):
        state = bema.state_dict()
        assert "bema_ema.0.weight" in state and "bema_theta0.0.weight" in state
        # theta0 of the thawed weight is its frozen value, the output moved with training
        assert not torch.equal(state["ema_model.0.weight"], state["bema_theta0.0.weight"])


def test_a_model_with_nothing_averaged_copies_its_buffers():
    """Frozen weights (shared) and an integer buffer: no span to average (foreach kernels
    refuse empty lists), the buffer copied into the EMA model."""
    net = nn.Linear(2, 2).requires_grad_(False)
    net.register_buffer("calls", torch.zeros((), dtype=torch.long))
    bema = BEMA(net, update_freq=1)
    for _ in range(3):
        net.calls += 1
        bema.update()
    assert int(bema.ema_model.calls) == 3
