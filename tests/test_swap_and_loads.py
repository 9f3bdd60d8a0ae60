"""Issue 14, items 6 and 10: a failed load changes nothing; writes inside ``swap()`` mean the
same in every mode (they write the EMA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import emakit
from _models import bn_mlp, ema_weights, same_tensors, two_linear
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


def test_a_strict_load_refuses_an_extra_online_model_key():
    """Planted bug: every ``online_model.*`` key counted as one the EMA owns, so the check
    that runs before anything is loaded let an extra ``online_model.<name>`` (a state of
    another model) through: torch's own strict check then raised only after it had copied
    every tensor, and the EMA and the model were left holding the refused state. With
    ``include_online_model=True`` the online model's keys are the EMA's own, paired
    strictly: an extra one is refused by name and nothing is loaded; ``strict=False``
    loads the rest. (With ``include_online_model=False``, ema-pytorch's
    ``online_model.*`` are accepted and ignored, as documented.)"""
    net = two_linear()
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()
    state = {k: v + 1 if v.is_floating_point() else v for k, v in ema.state_dict().items()}
    state["online_model.2.weight"] = torch.zeros(2, 2)
    before, online = ema_weights(ema), {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(EMAStateError, match=r"nothing was loaded.*online_model\.2\.weight"):
        ema.load_state_dict(state)
    assert same_tensors(ema_weights(ema), before) and same_tensors(dict(net.state_dict()), online)
    ema.load_state_dict(state, strict=False)
    assert torch.equal(ema.ema_model[0].weight, before["0.weight"] + 1)
    lean = EMA(two_linear(), include_online_model=False)
    lean.load_state_dict(state)  # ignored, as for ema-pytorch's states


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


def test_an_optimizer_step_inside_swap_trains_the_ema_and_updates_go_on():
    """Documented semantics: the step inside the block writes the EMA weights; the next
    update() after it raises nothing and averages the model into them."""
    net, ema, opt = trained()
    online = {k: v.detach().clone() for k, v in net.named_parameters()}
    with ema.swap():
        net(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        written = {k: v.detach().clone() for k, v in net.named_parameters()}
    for k, v in net.named_parameters():
        assert torch.equal(v, online[k]), k  # the model's own weights came back untrained
    ema.update()
    w = 1.0 - ema.get_current_decay()
    for k, v in ema.ema_model.named_parameters():
        torch.testing.assert_close(v, written[k].lerp(online[k], w), rtol=0, atol=1e-6)


@pytest.mark.parametrize("ema_dtype", [None, torch.float64], ids=["by reference", "by cast"])
def test_a_hooked_update_after_an_optimizer_step_inside_swap_says_what_happened(ema_dtype):
    """An optimizer hooked with add_to_optimizer_post_step_hook calls update() from the
    step inside the block: refused, naming the step and that it trained the EMA weights
    (and the fix); the step counts nothing, and training goes on after the block."""
    net, ema, opt = trained(ema_dtype=ema_dtype)
    ema.add_to_optimizer_post_step_hook(opt)
    step = ema.tracker.step
    with ema.swap():
        net(torch.randn(8, 4)).pow(2).mean().backward()
        with pytest.raises(emakit.EMARuntimeError) as err:
            opt.step()
    message = str(err.value)
    for part in (
        "update() was called inside swap()",
        "an optimizer.step() in the block",
        "add_to_optimizer_post_step_hook",
        "trained the EMA weights",
        "Call optimizer.step() outside the block",
    ):
        assert part in message, message
    assert ema.tracker.step == step and not ema.tracker.swapped
    opt.zero_grad()
    net(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()  # outside the block: the hook's update() runs
    assert ema.tracker.step == step + 1


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


@pytest.mark.parametrize("in_place", [False, True])
def test_writes_into_the_model_inside_swap_land_in_the_ema(in_place):
    """A train-mode forward inside ``swap()`` updates BatchNorm's running statistics of the
    EMA (by reference directly, with ``in_place=True`` through the write-back), and the
    model's own statistics come back on exit; swap()'s docstring says so."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    own = net[1].running_mean.clone()
    shadow = ema.ema_model[1].running_mean.clone()
    with ema.swap(in_place=in_place):
        net.train()
        net(torch.randn(8, 3) + 3.0)
    assert not torch.equal(ema.ema_model[1].running_mean, shadow)
    assert torch.equal(net[1].running_mean, own)
    doc = " ".join((EMA.swap.__doc__ or "").split())
    assert "land in the EMA weights" in doc


# -- swaps of two EMAs, a swap failing halfway, a load failing inside torch ----------------


def test_swaps_of_two_emas_exited_out_of_order_are_refused_and_recoverable():
    net, ema1, _ = trained()
    ema2 = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    ema2.update()
    own = {n: (p.data_ptr(), p.detach().clone()) for n, p in net.named_parameters()}
    shadows = {t.data_ptr() for e in (ema1, ema2) for t in e.ema_model.parameters()}
    s1, s2 = ema1.swap(), ema2.swap()
    s1.enter()
    s2.enter()
    with pytest.raises(emakit.EMAError, match="reverse order"):
        s1.exit()
    s2.exit()  # in order: both come back
    s1.exit()
    for n, p in net.named_parameters():
        assert p.data_ptr() == own[n][0] and p.data_ptr() not in shadows, n
        assert torch.equal(p, own[n][1]), n
    with ema1.swap(), ema2.swap():  # nested blocks still work
        pass
    assert all(p.data_ptr() == own[n][0] for n, p in net.named_parameters())
    ema1.update()
    ema2.update()


@pytest.mark.parametrize("in_place", [False, True], ids=["by-reference", "by-copy"])
def test_a_swap_failing_halfway_restores_every_tensor(monkeypatch, in_place):
    import emakit._core.swap as swap_module

    net, ema, _ = trained()
    own = {n: (p.data_ptr(), p.detach().clone()) for n, p in net.named_parameters()}
    # by reference: is_dtensor(online) once per tensor; by copy: local_tensor thrice
    name, nth = ("local_tensor", 7) if in_place else ("is_dtensor", 3)
    real, calls = getattr(swap_module, name), []

    def third_raises(t):
        calls.append(t)
        if len(calls) == nth:
            raise RuntimeError("planted failure at the third tensor")
        return real(t)

    monkeypatch.setattr(swap_module, name, third_raises)
    with pytest.raises(RuntimeError, match="planted"):
        ema.swap(in_place=in_place).enter()
    monkeypatch.undo()
    assert len(calls) == nth
    for n, p in net.named_parameters():
        assert p.data_ptr() == own[n][0], n  # its own storage, not the EMA's
        assert torch.equal(p, own[n][1]), n
    assert not ema.tracker.swapped
    ema.update()  # not stuck "inside swap()"


def counters(ema: EMA) -> tuple:
    t = ema.tracker
    return t.step, t.initted, t.num_skipped_nonfinite


class _Boom(torch.nn.Module):
    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError("planted failure inside torch's copy")


def test_a_load_failing_inside_torch_restores_the_counters():
    _, ema, _ = trained(skip_nonfinite=True)
    ema.tracker.num_skipped_nonfinite = 2
    _, other, _ = trained(skip_nonfinite=True)
    for _ in range(3):
        other.update()
    state = other.state_dict()
    ema.ema_model.add_module("boom", _Boom())  # fails after the counters were decoded
    before = counters(ema)
    with pytest.raises(EMAStateError, match="counters were restored"):
        ema.load_state_dict(state, strict=False)
    assert counters(ema) == before == (4, True, 2)  # the other EMA's are 7, True, 0


def test_a_multi_ema_load_failing_inside_torch_restores_every_members_counters():
    net = bn_mlp(4, 8, 3, seed=0)
    multi = MultiEMA(net, betas=(0.5, 0.9), update_after_step=0, update_every=1)
    for _ in range(3):
        multi.update()
    state = multi.state_dict()
    fresh = MultiEMA(net, betas=(0.5, 0.9), update_after_step=0, update_every=1)
    fresh.update()
    fresh[1].ema_model.add_module("boom", _Boom())
    before = [counters(e) for e in fresh]
    with pytest.raises(EMAStateError, match="counters were restored"):
        fresh.load_state_dict(state, strict=False)
    assert [counters(e) for e in fresh] == before == [(1, True, 0)] * 2
