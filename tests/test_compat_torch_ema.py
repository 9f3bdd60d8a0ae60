"""`emakit.compat.torch_ema` against the real torch_ema 0.3: the same decay at every update
(also across a state round trip, both ways), weights within float32 rounding, torch_ema's
methods, and `load_foreign_state` continuing torch_ema's schedule without the off-by-one."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from emakit import EMA, load_foreign_state, schedules
from emakit.compat.torch_ema import ExponentialMovingAverage
from emakit.errors import EMAStateError, EMAValueError

torch_ema = pytest.importorskip("torch_ema")


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def train_step(nets: list[nn.Module], opts: list[torch.optim.Optimizer], seed: int) -> None:
    for net, opt in zip(nets, opts, strict=True):
        torch.manual_seed(seed)
        net(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def decay_probe(ema_cls, use_num_updates=True, n=70, reload_at=None):
    """The decay of every update, read exactly: a float64 parameter at 1 and a shadow at 0
    become ``1 - d`` after one update in both libraries (``0 + w * 1`` and
    ``0 - (1 - d) * (0 - 1)`` are exact)."""
    p = torch.zeros(1, dtype=torch.float64)
    ema = ema_cls([p], decay=0.99, use_num_updates=use_num_updates)
    seen = []
    for i in range(1, n + 1):
        ema.shadow_params[0].zero_()
        p.fill_(1.0)
        ema.update()
        seen.append(1.0 - ema.shadow_params[0].item())
        if i == reload_at:  # through the other library's state and back
            other = (
                ExponentialMovingAverage
                if ema_cls is not ExponentialMovingAverage
                else torch_ema.ExponentialMovingAverage
            )([p], decay=0.5)
            other.load_state_dict(ema.state_dict())
            ema = ema_cls([p], decay=0.5)
            ema.load_state_dict(other.state_dict())
    return seen


@pytest.mark.parametrize("use_num_updates", [True, False])
@pytest.mark.parametrize("reload_at", [None, 30])
def test_the_same_decay_at_every_update(use_num_updates, reload_at):
    theirs = decay_probe(torch_ema.ExponentialMovingAverage, use_num_updates, reload_at=reload_at)
    ours = decay_probe(ExponentialMovingAverage, use_num_updates, reload_at=reload_at)
    assert ours == theirs
    if use_num_updates:
        assert round(theirs[60], 6) == 0.873239  # update 61: (1 + 61) / (10 + 61), the issue's


def test_weights_within_float32_rounding_over_a_training_run():
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs = torch_ema.ExponentialMovingAverage(nets[0].parameters(), decay=0.99)
    ours = ExponentialMovingAverage(nets[1].parameters(), decay=0.99)
    for step in range(200):
        train_step(nets, opts, step)
        theirs.update()
        ours.update()
        for a, b in zip(theirs.shadow_params, ours.shadow_params, strict=True):
            scale = a.abs().max().item()
            assert (a - b).abs().max().item() <= 4 * torch.finfo(a.dtype).eps * scale
    assert ours.num_updates == theirs.num_updates == 200
    moved = (ours.shadow_params[0] - make_net()[0].weight).abs().max().item()
    assert moved > 1e-3  # the comparison compared weights that moved


def test_state_dicts_load_both_ways():
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs = torch_ema.ExponentialMovingAverage(nets[0].parameters(), decay=0.9)
    ours = ExponentialMovingAverage(nets[1].parameters(), decay=0.9)
    for step in range(5):
        train_step(nets, opts, step)
        theirs.update()
    theirs.store()
    ours.load_state_dict(theirs.state_dict())
    state = ours.state_dict()
    assert set(state) == {"decay", "num_updates", "shadow_params", "collected_params"}
    assert state["num_updates"] == 5 and state["decay"] == 0.9
    for a, b in zip(theirs.shadow_params, ours.shadow_params, strict=True):
        assert torch.equal(a, b)
    back = torch_ema.ExponentialMovingAverage(make_net().parameters(), decay=0.5)
    back.load_state_dict(ours.state_dict())  # torch_ema reads ours (asserts included)
    assert back.num_updates == 5 and back.decay == 0.9
    for a, b in zip(back.collected_params, theirs.collected_params, strict=True):
        assert torch.equal(a, b)


def test_methods_behave_as_torch_emas():
    nets = [make_net(), make_net()]
    emas = [
        torch_ema.ExponentialMovingAverage(nets[0].parameters(), decay=0.5),
        ExponentialMovingAverage(nets[1].parameters(), decay=0.5),
    ]
    for net in nets:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    outs = []
    for net, ema in zip(nets, emas, strict=True):
        ema.update()
        raw = [p.clone() for p in net.parameters()]
        x = torch.ones(4, 6)
        with ema.average_parameters():
            inside = net.eval()(x)
        assert all(torch.equal(a, b) for a, b in zip(raw, net.parameters(), strict=True))
        ema.copy_to()
        outs.append((inside, [p.clone() for p in net.parameters()]))
        ema.restore()  # average_parameters stored the raw weights
        assert all(torch.equal(a, b) for a, b in zip(raw, net.parameters(), strict=True))
        ema.to(dtype=torch.float64)
        assert ema.shadow_params[0].dtype == torch.float64
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6)
    for a, b in zip(outs[0][1], outs[1][1], strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(EMAStateError, match="store"):
        ExponentialMovingAverage(make_net().parameters(), decay=0.5).restore()
    with pytest.raises(EMAValueError, match="parameters has 1 tensors"):
        emas[1].update([torch.zeros(1)])


def test_parameters_only_as_torch_ema():
    net = make_net()
    ours = ExponentialMovingAverage(net.parameters(), decay=0.5)
    running = net[1].running_mean.clone()
    net.train()(torch.randn(16, 6) + 3)  # moves the BatchNorm statistics
    ours.update()
    with ours.average_parameters():
        assert not torch.equal(net[1].running_mean, running)  # the model's own, as torch_ema
    assert len(ours.shadow_params) == len(list(net.parameters()))


def test_bad_state_raises_and_changes_nothing():
    ours = ExponentialMovingAverage(make_net().parameters(), decay=0.9)
    before = [s.clone() for s in ours.shadow_params]
    for bad, match in [
        ({"decay": 0.9, "num_updates": 1}, "lacks"),
        ({"decay": 2.0, "num_updates": 1, "shadow_params": []}, "decay"),
        ({"decay": 0.9, "num_updates": 1, "shadow_params": [torch.zeros(1)]}, "holds 1"),
    ]:
        with pytest.raises(EMAStateError, match=match):
            ours.load_state_dict(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, ours.shadow_params, strict=True))
    assert ours.num_updates == 0


def test_load_foreign_state_continues_torch_emas_decays():
    """The issue's off-by-one: after loading torch_ema's state at update 60 into
    ``EMA(schedule=torch_ema_warmup)``, update 61 must use (1 + 61) / (10 + 61)."""
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    theirs = torch_ema.ExponentialMovingAverage(nets[0].parameters(), decay=0.999)
    for step in range(60):
        train_step(nets, opts, step)
        theirs.update()
    ours = EMA(
        nets[1],
        schedule=schedules.torch_ema_warmup(0.999),
        update_after_step=0,
        update_every=1,
        param_or_buffer_names_no_ema={"1.running_mean", "1.running_var"},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # buffers copied: no warning about them
        load_foreign_state(ours, theirs.state_dict())
    assert int(ours.step) == 61
    for step in range(60, 66):
        train_step(nets, opts, step)
        theirs.update()
        ours.update()
        assert ours.get_current_decay() == min(
            0.999, (1 + theirs.num_updates) / (10 + theirs.num_updates)
        )
    for p, s in zip(ours.ema_model.parameters(), theirs.shadow_params, strict=True):
        assert (p - s).abs().max().item() <= 4 * torch.finfo(s.dtype).eps * s.abs().max().item()


def test_plain_ema_loading_torch_ema_state_says_it_averages_buffers():
    net = make_net()
    theirs = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.9)
    theirs.update()
    with pytest.warns(UserWarning, match=r"parameters only.*'1.running_mean'.*compat.torch_ema"):
        load_foreign_state(EMA(copy.deepcopy(net), update_after_step=0), theirs.state_dict())


def test_a_plain_ema_written_in_torch_emas_form_continues_in_torch_ema():
    """The migration page's recipe: an `EMA` with torch_ema's schedule, written as torch_ema's
    state (``num_updates = step - 1``), loads into torch_ema, which continues with the decays
    the EMA would have used."""
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    ours = EMA(
        nets[0], schedule=schedules.torch_ema_warmup(0.99), update_after_step=0, update_every=1
    )
    ours.update()  # copies the starting weights, as torch_ema's constructor does
    for step in range(20):
        train_step(nets, opts, step)
        ours.update()
    state = {
        "decay": 0.99,
        "num_updates": int(ours.step) - 1,
        "shadow_params": list(ours.ema_model.parameters()),
        "collected_params": None,
    }
    theirs = torch_ema.ExponentialMovingAverage(nets[1].parameters(), decay=0.5)
    theirs.load_state_dict(state)
    assert theirs.num_updates == 20
    for step in range(20, 25):
        train_step(nets, opts, step)
        ours.update()
        theirs.update()
        n = theirs.num_updates
        assert ours.get_current_decay() == min(0.99, (1 + n) / (10 + n))
    for p, s in zip(ours.ema_model.parameters(), theirs.shadow_params, strict=True):
        assert (p - s).abs().max().item() <= 4 * torch.finfo(s.dtype).eps * s.abs().max().item()


MOVES = {
    "dtype": {"dtype": torch.float64},
    "device": {"device": "cpu"},
    "device_and_dtype": {"device": torch.device("cpu"), "dtype": torch.float32},
    "nothing": {},
}


@pytest.mark.parametrize("use_num_updates", [True, False])
@pytest.mark.parametrize("move", list(MOVES))
def test_to_keeps_the_count_and_the_next_decays_are_torch_emas(move, use_num_updates):
    """``.to()`` moves the shadow; the warm-up goes on where it was (``num_updates`` kept),
    so the decays after it are torch_ema's, read exactly as in `decay_probe`."""
    seen = {}
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p = torch.zeros(1, dtype=torch.float64)
        ema = cls([p], decay=0.99, use_num_updates=use_num_updates)
        for i in range(5):
            p.fill_(float(i))
            ema.update()
        ema.to(**MOVES[move])
        assert ema.num_updates == (5 if use_num_updates else None)
        decays = []
        for _ in range(3):
            ema.shadow_params[0].zero_()
            p.fill_(1.0)
            ema.update()
            decays.append(1.0 - ema.shadow_params[0].item())
        assert ema.num_updates == (8 if use_num_updates else None)
        assert ema.shadow_params[0].dtype == MOVES[move].get("dtype", torch.float64)
        seen[cls] = decays
    theirs, ours = seen.values()
    assert ours == theirs
    if use_num_updates:
        assert round(theirs[0], 6) == round(7 / 16, 6)  # update 6: (1 + 6) / (10 + 6)


def test_to_moves_the_stored_tensors_and_keeps_integer_dtypes_as_torch_ema():
    dtypes = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        params = [torch.zeros(3), torch.arange(3)]  # torch_ema takes any tensors
        ema = cls(params, decay=0.9)
        ema.store()
        ema.to(dtype=torch.float64)
        dtypes.append(
            ([s.dtype for s in ema.shadow_params], [c.dtype for c in ema.collected_params])
        )
        ema.restore()  # the stored values go back into the parameters, cast to theirs
        assert [p.dtype for p in params] == [torch.float32, torch.int64]
    assert dtypes[0] == dtypes[1] == ([torch.float64, torch.int64], [torch.float64, torch.int64])


def test_update_with_other_parameters_keeps_the_count():
    """``update(parameters)`` with other tensors (documented: paired with from then on)
    continues the warm-up: the decay is torch_ema's for the same call."""
    seen = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p, q = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        ema = cls([p], decay=0.99)
        for _ in range(4):
            ema.update()
        ema.shadow_params[0].zero_()
        q.fill_(1.0)
        ema.update([q])
        seen.append((ema.num_updates, 1.0 - ema.shadow_params[0].item()))
    assert seen[0] == seen[1]
    assert seen[1][0] == 5 and round(seen[1][1], 12) == round(6 / 15, 12)  # update 5


def test_methods_take_other_parameters_as_torch_ema():
    outs = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p, other = torch.full((2,), 3.0), torch.full((2,), 7.0)
        ema = cls([p], decay=0.5)
        ema.copy_to([other])  # into the tensors given, not the tracked ones
        assert torch.equal(other, torch.full((2,), 3.0)) and torch.equal(p, other)
        other.fill_(9.0)
        ema.store([other])
        other.fill_(0.0)
        ema.restore([other])
        outs.append((p.clone(), other.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    assert torch.equal(outs[1][1], torch.full((2,), 9.0))


def test_average_parameters_restores_the_weights_when_the_block_raises():
    net = make_net()
    ours = ExponentialMovingAverage(net.parameters(), decay=0.5)
    raw = [p.clone() for p in net.parameters()]
    with torch.no_grad():
        for s in ours.shadow_params:
            s.add_(1.0)
    inside = []

    def evaluate() -> None:
        with ours.average_parameters():
            inside.append(net[0].weight.clone())
            raise RuntimeError("in the block")

    with pytest.raises(RuntimeError, match="in the block"):
        evaluate()
    assert torch.equal(inside[0], ours.shadow_params[0])  # the block saw the average
    assert all(torch.equal(a, b) for a, b in zip(raw, net.parameters(), strict=True))


def test_loading_a_state_without_stored_tensors_clears_them_as_torch_ema():
    restored = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p = torch.zeros(2)
        ema = cls([p], decay=0.9)
        ema.store()
        source = cls([torch.ones(2)], decay=0.8)
        ema.load_state_dict(source.state_dict())  # collected_params None
        assert ema.collected_params is None
        with pytest.raises((ValueError, RuntimeError), match="store"):
            ema.restore()
        restored.append(ema.decay)
    assert restored == [0.8, 0.8]


def test_loaded_stored_tensors_take_the_parameters_dtype_as_torch_ema():
    source = torch.zeros(2, dtype=torch.float64)  # torch_ema holds weak references
    state = torch_ema.ExponentialMovingAverage([source], 0.9)
    state.store()
    dtypes = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p = torch.zeros(2)
        ema = cls([p], decay=0.5)
        ema.load_state_dict(state.state_dict())
        dtypes.append(ema.collected_params[0].dtype)
        assert ema.collected_params[0] is not state.collected_params[0]
    assert dtypes == [torch.float32, torch.float32]


def test_signature_defaults_and_decay_bounds_are_torch_emas():
    import inspect

    for method in ("__init__", "update", "copy_to", "store", "restore", "to", "load_state_dict"):
        theirs = inspect.signature(getattr(torch_ema.ExponentialMovingAverage, method)).parameters
        ours = inspect.signature(getattr(ExponentialMovingAverage, method)).parameters
        assert [(n, p.default) for n, p in theirs.items()] == [
            (n, p.default) for n, p in ours.items() if p.kind is not p.KEYWORD_ONLY
        ], method
    assert inspect.signature(ExponentialMovingAverage).parameters["skip_nonfinite"].default is False
    for decay in (0.0, 1.0):  # both ends accepted, as torch_ema
        assert ExponentialMovingAverage([torch.zeros(1)], decay=decay).decay == decay
        torch_ema.ExponentialMovingAverage([torch.zeros(1)], decay=decay)
    for decay in (-0.01, 1.01):
        for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
            with pytest.raises(ValueError, match=r"(?i)decay"):
                cls([torch.zeros(1)], decay=decay)


def test_skip_nonfinite_skips_a_nonfinite_update_also_after_to():
    """emakit's ``skip_nonfinite=True``: an update on NaN weights leaves the shadow as it
    was, before and after ``.to()`` (which rebuilds the averaging)."""
    p = torch.zeros(2)
    ema = ExponentialMovingAverage([p], decay=0.9, skip_nonfinite=True)
    p.fill_(1.0)
    ema.update()
    kept = ema.shadow_params[0].clone()
    assert not torch.equal(kept, torch.zeros(2))  # the finite update went through
    p[0] = float("nan")
    ema.update()
    assert torch.equal(ema.shadow_params[0], kept)
    ema.to(dtype=torch.float64)
    ema.update()
    assert torch.equal(ema.shadow_params[0], kept.double())


def test_a_nonfinite_update_goes_through_by_default_as_in_torch_ema():
    shadows = []
    for cls in (torch_ema.ExponentialMovingAverage, ExponentialMovingAverage):
        p = torch.zeros(2)
        ema = cls([p], decay=0.9)
        p[0] = float("nan")
        ema.update()
        shadows.append(ema.shadow_params[0].clone())
    assert torch.equal(shadows[0].isnan(), shadows[1].isnan())
    assert shadows[1].isnan().tolist() == [True, False]
