"""BEMA (bias-corrected EMA, arXiv:2508.00180): the rule against TRL's formulas, the
update against a per-tensor reference loop, resume, swap/forward, offload, bad input."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from emakit import BEMA, EMAError, EMAStateError, EMATypeError, EMAValueError
from emakit._engine.bema import BEMAWork
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
    x = torch.randn(3, 4, dtype=torch.float64)
    y = bema(x)  # built: the copy takes the plain EMA and builds again when read
    clone = copy.deepcopy(bema)
    assert torch.equal(clone(x), y)
    _assert_same_state(bema, clone)
    clone.update()
    assert int(clone.step) == 2
    assert int(bema.step) == 1


def test_frozen_weights_are_shared_or_held_and_thaw():
    model = net()
    model[0].requires_grad_(False)
    shared = BEMA(model, update_freq=1, share_frozen=True)
    assert shared.ema_model[0].weight.data_ptr() == model[0].weight.data_ptr()
    held = BEMA(model, update_freq=1, ema_dtype=torch.float64)  # a wider copy: not shareable
    for bema in (shared, held):
        assert not any(k.startswith(("bema_ema.0.", "bema_theta0.0.")) for k in bema.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(1, 4):
        if t == 3:
            model[0].requires_grad_(True)  # trained again from here on
            shared.ema_model  # noqa: B018 - a read before the next step sees the thaw
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


# -- issue 30 item 1: a background BEMA never reads the model after update() returns ------


def _pair_of_runs(**bg: object) -> tuple[nn.Module, BEMA, nn.Module, BEMA]:
    fg_model, bg_model = net(), net()
    return fg_model, BEMA(fg_model, update_freq=1), bg_model, BEMA(bg_model, update_freq=1, **bg)


def _assert_same_state(a: BEMA, b: BEMA) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_background_bema_equals_the_foreground_bit_for_bit():
    fg_model, fg, bg_model, bg = _pair_of_runs(device="cpu")  # background by default
    assert type(bg.tracker.runner).__name__ == "ThreadRunner"
    fg_opt = torch.optim.SGD(fg_model.parameters(), lr=0.2)
    bg_opt = torch.optim.SGD(bg_model.parameters(), lr=0.2)
    x = torch.randn(3, 4, dtype=torch.float64)
    for t in range(1, 13):
        train_step(fg_model, fg_opt, t)
        train_step(bg_model, bg_opt, t)
        fg.update()
        bg.update()  # the next step's optimizer write races the worker unless it snapshots
        if t % 4 == 0:
            assert torch.equal(fg(x), bg(x)), t
    _assert_same_state(fg, bg)


def test_a_write_after_update_never_reaches_the_background_bema(monkeypatch):
    """The worker is held until the model was written: what it averages must be the
    snapshot taken in update(), as the foreground BEMA's is."""
    gate = threading.Event()
    finish = BEMAWork.finish

    def held_finish(self: BEMAWork, action: object) -> None:
        if threading.current_thread() is not threading.main_thread():  # the worker only
            assert gate.wait(10)
        finish(self, action)

    fg_model, fg, bg_model, bg = _pair_of_runs(device="cpu")
    monkeypatch.setattr(BEMAWork, "finish", held_finish)
    for bema, model in ((fg, fg_model), (bg, bg_model)):
        for _ in range(3):
            gate.clear()
            bema.update()  # the background worker now waits at the gate
            with torch.no_grad():
                model[0].weight.add_(100.0)
            gate.set()
            bema.tracker.runner.wait()  # before the gate closes again
    _assert_same_state(fg, bg)
    ema = bg.state_dict()["bema_ema.0.weight"]
    assert (ema - fg_model[0].weight).abs().min() > 50  # the writes stayed out of the EMA


# -- issue 30 item 2: a given ema_model gets the model's frozen weights --------------------


@pytest.mark.parametrize("kw", [{}, {"device": "cpu", "async_update": False}])
def test_given_ema_model_is_filled_like_a_copy(kw: dict):
    model = net()
    model[0].requires_grad_(False)  # frozen: shared, or held where it cannot be
    torch.manual_seed(1)
    given = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).double()
    assert not torch.equal(given[0].weight, model[0].weight)
    bema, plain = BEMA(model, ema_model=given, **kw), BEMA(model, **kw)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    x = torch.randn(3, 4, dtype=torch.float64)
    for t in range(1, 5):
        train_step(model, opt, t)
        bema.update()
        plain.update()
    assert torch.equal(given[0].weight, model[0].weight)
    assert torch.equal(bema(x), plain(x))


# -- issue 32 item 2: two copies, the evaluated weights built when read ---------------------


def _held_bytes(bema: BEMA) -> int:
    """Bytes of every distinct storage the BEMA holds apart from the model's."""
    model = {t.untyped_storage().data_ptr() for t in bema.model.state_dict().values()}
    tensors = [*bema._modules["ema_model"].state_dict().values(), *bema._theta0.values()]
    if bema._built is not None:
        tensors += bema._built[1]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for p, n in storages.items() if p not in model)


def test_two_copies_between_updates_and_evaluated_weights_only_when_read():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    bema = BEMA(model, update_freq=2)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for t in range(1, 6):
        step(t)
        bema.update()
        assert bema._built is None  # nothing read: nothing built
        assert _held_bytes(bema) / trainable == pytest.approx(2.0, abs=0.02), t  # theta0, EMA
    x = torch.randn(3, 64)
    y = bema(x)  # a read builds them (a third copy until the next update)
    assert bema._built is not None and torch.equal(bema(x), y)
    assert _held_bytes(bema) / trainable == pytest.approx(3.0, abs=0.03)
    step(6)
    assert not torch.equal(bema(x), y)  # built again from the model's weights now
    bema.update()
    assert bema._built is None
    assert _held_bytes(bema) / trainable == pytest.approx(2.0, abs=0.02)


def test_reads_between_updates_build_from_the_model_now():
    """``ema_model``, ``bema(x)``, ``swap()`` and the state dict all read ``ema +
    alpha_t * (theta - theta0)`` for the model's weights at the read, ``alpha_t`` of the
    most recent update; the update itself averages the plain EMA, unchanged by reads."""
    model, twin = net(), net()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, twin))
    bema, unread = BEMA(model, update_freq=3), BEMA(twin, update_freq=3)
    x = torch.randn(3, 4, dtype=torch.float64)
    for t in range(1, 11):
        train_step(model, opt, t)
        train_step(twin, twin_opt, t)
        bema.update()
        unread.update()
        state = bema.state_dict()
        alpha = bema.rule.alpha(3 * (t // 3)) if t >= 3 else 0.0
        assert bema.bias_weight == alpha
        for name, p in model.named_parameters():
            ema, theta0 = state[f"bema_ema.{name}"], state[f"bema_theta0.{name}"]
            expected = ((p.detach() - theta0) * alpha) + ema
            assert torch.equal(state[f"ema_model.{name}"], expected), (t, name)
            assert torch.equal(bema.ema_model.get_parameter(name), expected), (t, name)
        evaluated = copy.deepcopy(model)
        evaluated.load_state_dict({k[10:]: v for k, v in state.items() if k[:10] == "ema_model."})
        assert torch.equal(bema(x), evaluated(x))
        with bema.swap():
            assert torch.equal(model(x), evaluated(x))
    _assert_same_state(bema, unread)  # reading changed nothing


def test_resume_after_a_read_between_updates_is_exact():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bema = BEMA(model, **SETTINGS)
    for t in range(1, 7):
        train_step(model, opt, t)
        bema.update()
    saved = copy.deepcopy({"bema": bema.state_dict(), "model": model.state_dict()})
    twin = net()
    twin.load_state_dict(saved["model"])
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    twin_opt.load_state_dict(opt.state_dict())
    resumed = BEMA(twin, **SETTINGS)
    resumed.load_state_dict(saved["bema"])
    for t in range(7, 15):
        for m, o, b in ((model, opt, bema), (twin, twin_opt, resumed)):
            train_step(m, o, t)
            b.update()
    _assert_same_state(bema, resumed)


# -- issue 30 item 5: every accepted setting gives finite weights in [0, 1] ------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"ema_power": 0.0, "lag": 0, "multiplier": 1e-300, "bias_power": 1.0},
        {"ema_power": 0.0, "lag": 0.5, "multiplier": 1e-3, "bias_power": 0.2},
        {"ema_power": 0.5, "bias_power": 0.0, "lag": 0, "multiplier": 0.5, "update_freq": 1},
        {"lag": 0, "multiplier": 1e-9, "update_after": 10**6},
    ],
)
def test_settings_with_weights_above_one_are_refused(kw: dict):
    with pytest.raises(EMAValueError, match=r"lag \+ multiplier \* t must be >= 1.*raise lag"):
        BEMA(net(), **kw)


def test_both_powers_zero_accept_any_lag():
    rule = bema_rule(ema_power=0.0, bias_power=0.0, lag=0, multiplier=1e-300, update_freq=1)
    assert rule.beta(1) == rule.alpha(1) == 1.0


_POWERS = st.one_of(st.just(0.0), st.floats(1e-6, 1e3), st.floats(1e3, 1e300))
_SCALES = st.one_of(st.just(0.0), st.floats(1e-300, 1e300))


@given(
    update_freq=st.integers(1, 10**6),
    update_after=st.integers(0, 10**9),
    ema_power=_POWERS,
    bias_power=_POWERS,
    lag=_SCALES,
    multiplier=st.floats(1e-300, 1e300),
    min_ema_multiplier=st.floats(0.0, 1.0),
)
@settings(max_examples=300, deadline=None)
def test_any_accepted_setting_gives_weights_in_the_unit_interval(**kw: object):
    try:
        rule = bema_rule(**kw)  # type: ignore[arg-type]
    except EMAError:
        return
    first = rule.update_after + rule.update_freq
    calls = [first + k * rule.update_freq for k in (0, 1, 2, 10, 10**3, 10**6)]
    for t in [*calls, 2**62]:
        beta, alpha = rule.beta(t), rule.alpha(t)
        assert 0.0 <= beta <= 1.0 and 0.0 <= alpha <= 1.0, (t, beta, alpha)
    assert [rule.last_update(t) for t in calls] == calls
    assert rule.last_update(first - 1) == 0


def test_a_state_written_before_the_two_copy_layout_resumes_exactly():
    """``fixtures/bema_state_v1.pt`` was written by the BEMA that stored its evaluated
    weights (main at 49697b9): this test's ``net()`` trained by ``train_step`` with
    ``SETTINGS`` to step 7, the model and BEMA state there (between updates), the model's
    weights after each of steps 8-14 (what that BEMA averaged) and its state at step 14
    (an update step). Loaded here, fed the same weights, it ends with the same state, bit
    for bit. The weights are read from the file, not trained again: a CPU of another kind
    (AVX-512 against AVX2, Intel against AMD) rounds the training's matmuls differently."""
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "fixtures" / "bema_state_v1.pt")
    model = net()
    model.load_state_dict(saved["model"])
    bema = BEMA(model, **SETTINGS)
    bema.load_state_dict(saved["bema"])
    for weights in saved["steps"]:  # steps 8 to 14
        with torch.no_grad():
            for k, p in model.state_dict().items():
                p.copy_(weights[k])  # in place, as an optimizer step writes them
        bema.update()
    state, final = bema.state_dict(), saved["final"]
    assert state.keys() == final.keys() and int(state["step"]) == 14
    for k in final:
        assert torch.equal(state[k], final[k]), k


def test_a_weights_only_load_is_read_until_the_next_update():
    """Loading only ``ema_model.*`` (a weights file) puts those weights in the EMA model
    for reading, as the evaluated weights; the next update goes on from BEMA's own state."""
    model, twin = net(), net()
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, twin))
    bema, untouched = BEMA(model, update_freq=1), BEMA(twin, update_freq=1)
    for t in range(1, 4):
        train_step(model, opt, t)
        train_step(twin, twin_opt, t)
        bema.update()
        untouched.update()
    weights = {k: torch.full_like(v, 0.5) for k, v in bema.ema_model.state_dict().items()}
    result = bema.load_state_dict({f"ema_model.{k}": v for k, v in weights.items()}, strict=False)
    assert any(k.startswith("bema_ema.") for k in result.missing_keys)
    for k, v in bema.ema_model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    train_step(model, opt, 4)
    train_step(twin, twin_opt, 4)
    bema.update()
    untouched.update()
    _assert_same_state(bema, untouched)
