"""Issue 14, items 6 and 10: a failed load changes nothing; writes inside ``swap()`` mean the
same in every mode (they write the EMA)."""

from __future__ import annotations

import copy

import pytest
import torch

import emakit
from _models import bn_mlp
from emakit import EMA, EMAStateError, KarrasEMA, MultiEMA


def trained(**kw):
    net = bn_mlp(4, 8, 3, seed=0)
    ema = EMA(net, beta=0.8, update_after_step=0, update_every=1, **kw)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(4):
        net(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    return net, ema, opt


def snapshot(ema: EMA) -> tuple:
    state = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    t = ema.tracker
    return state, t.step, t.initted, t.last, t.gap, t.num_skipped_nonfinite


def assert_unchanged(ema: EMA, before: tuple) -> None:
    state, *counters = before
    for k, v in ema.ema_model.state_dict().items():
        assert torch.equal(v, state[k]), k
    t = ema.tracker
    assert [t.step, t.initted, t.last, t.gap, t.num_skipped_nonfinite] == counters


# -- item 6: transactional loads -----------------------------------------------------------


def bad_states(good: dict) -> dict[str, dict]:
    missing = dict(good)
    del missing["ema_model.2.bias"]
    extra = dict(good, surprise=torch.zeros(1))
    shape = dict(good)
    shape["ema_model.2.weight"] = torch.zeros(5, 8)
    text = dict(good)
    text["ema_model.0.bias"] = "not a tensor"
    return {"missing": missing, "unexpected": extra, "shape": shape, "not a tensor": text}


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape", "not a tensor"])
def test_failed_strict_load_leaves_the_ema_as_it_was(kind):
    _, source, _ = trained()
    good = {
        k: v.clone() + 1 if v.is_floating_point() else v.clone()
        for k, v in source.state_dict().items()
    }
    good["step"] = torch.tensor(99)
    _, ema, _ = trained(skip_nonfinite=True)
    before = snapshot(ema)
    with pytest.raises(EMAStateError, match="nothing was loaded"):
        ema.load_state_dict(bad_states(good)[kind])
    assert_unchanged(ema, before)


def test_failed_load_of_weights_files_and_foreign_states_leave_the_ema_as_it_was(tmp_path):
    _, ema, _ = trained()
    path = emakit.save_ema_weights(ema, tmp_path / "ema.safetensors")
    other = bn_mlp(4, 9, 3, seed=1)  # another width: shapes differ
    victim = EMA(other, update_after_step=0, update_every=1)
    victim.update()
    before = snapshot(victim)
    with pytest.raises(emakit.EMAError):
        emakit.load_ema_weights(victim, path)
    assert_unchanged(victim, before)
    with pytest.raises(emakit.EMAError):
        emakit.load_foreign_state(victim, ema.state_dict())
    assert_unchanged(victim, before)


def test_failed_loads_of_karras_and_multi_ema_leave_them_as_they_were():
    net = bn_mlp(4, 8, 3, seed=0)
    karras = KarrasEMA(net, gamma=5.0, update_every=2)
    for _ in range(5):
        karras.update()
    state = karras.state_dict()
    state["ema_model.0.weight"] = torch.zeros(3, 3)
    before = snapshot(karras)
    with pytest.raises(EMAStateError):
        karras.load_state_dict(state)
    assert_unchanged(karras, before)
    multi = MultiEMA(net, betas=(0.9, 0.99), update_after_step=0, update_every=1)
    for _ in range(3):
        multi.update()
    state = copy.copy(multi.state_dict())
    state["emas.1.step"] = torch.tensor(50)
    del state["emas.1.ema_model.2.bias"]
    befores = [snapshot(e) for e in multi]
    with pytest.raises(EMAStateError):
        multi.load_state_dict(state)
    for e, b in zip(multi, befores, strict=True):
        assert_unchanged(e, b)


# -- item 10: writes inside swap() -----------------------------------------------------------


@pytest.mark.parametrize("ema_dtype", [None, torch.float64], ids=["by reference", "by cast"])
@pytest.mark.parametrize("in_place", [False, True], ids=["re-point", "in place"])
def test_writes_inside_swap_write_the_ema_in_every_mode(ema_dtype, in_place):
    net, ema, opt = trained(ema_dtype=ema_dtype)
    online = {k: v.clone() for k, v in net.state_dict().items()}
    with ema.swap(in_place=in_place):
        net.train()
        net(torch.randn(8, 4)).pow(2).mean().backward()  # BatchNorm statistics move too
        opt.step()
        opt.zero_grad()
        written = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for k, v in net.state_dict().items():
        assert torch.equal(v, online[k]), f"{k}: the online weights came back"
    for k, v in ema.ema_model.state_dict().items():
        assert torch.equal(v, written[k].to(v.dtype)), f"{k}: the write reached the EMA"


def test_an_untouched_cast_swap_leaves_the_shadow_bit_for_bit():
    net, ema, _ = trained(ema_dtype=torch.float64)
    before = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    with ema.swap(), torch.no_grad():
        net.eval()
        net(torch.randn(8, 4))
    for k, v in ema.ema_model.state_dict().items():
        assert torch.equal(v, before[k]), k  # no float32 round trip of the float64 shadow


def test_eval_inside_swap_never_writes():
    net, ema, _ = trained()
    before = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    with ema.swap(), torch.no_grad():
        net.eval()
        net(torch.randn(8, 4))
    for k, v in ema.ema_model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_failed_posthoc_load_leaves_every_profile_as_it_was(tmp_path):
    net = bn_mlp(4, 8, 3, seed=0)
    posthoc = emakit.PostHocEMA(
        net,
        sigma_rels=(0.05, 0.2),
        update_every=1,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=tmp_path,
    )
    for _ in range(3):
        posthoc.update()
    state = dict(posthoc.state_dict())
    state["ema_models.0.step"] = torch.tensor(40)
    state["ema_models.1.ema_model.0.weight"] = torch.zeros(2, 2)
    befores = [snapshot(p) for p in posthoc.profiles]
    with pytest.raises(EMAStateError, match="nothing was loaded"):
        posthoc.load_state_dict(state)
    for p, b in zip(posthoc.profiles, befores, strict=True):
        assert_unchanged(p, b)
