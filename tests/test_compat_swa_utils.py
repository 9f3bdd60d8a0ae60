"""`emakit.compat.swa_utils` against torch's ``torch.optim.swa_utils``: the same numbers
(bit for bit with `get_ema_multi_avg_fn`, float32 rounding for SWA), state dicts both ways,
user functions called as torch calls them, and no host read of ``n_averaged`` per update."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.optim.swa_utils as theirs
from torch import nn

import emakit.compat.swa_utils as ours
from emakit.errors import EMAStateError, EMAValueError


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def run(module, fn_kwargs, use_buffers=False, steps=12):
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    averaged = module.AveragedModel(net, use_buffers=use_buffers, **fn_kwargs(module))
    states = []
    torch.manual_seed(1)
    for _ in range(steps):
        net.train()(torch.randn(16, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(net)
        states.append({k: v.clone() for k, v in averaged.state_dict().items()})
    return averaged, states


FNS = {
    "ema_multi": lambda m: {"multi_avg_fn": m.get_ema_multi_avg_fn(0.9)},
    "ema_single": lambda m: {"avg_fn": m.get_ema_avg_fn(0.9)},
    "torchs_own_fn": lambda m: {"multi_avg_fn": theirs.get_ema_multi_avg_fn(0.9)},
    "user_lambda": lambda m: {"avg_fn": lambda a, c, n: a + (c - a) / (n + 2)},
    "swa": lambda m: {},
}


@pytest.mark.parametrize("use_buffers", [False, True])
@pytest.mark.parametrize("fn", list(FNS))
def test_same_numbers_as_torch_after_every_update(fn, use_buffers):
    _, expected = run(theirs, FNS[fn], use_buffers)
    _, got = run(ours, FNS[fn], use_buffers)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert list(a) == list(b)
        for k in a:
            if k.endswith("num_batches_tracked") and use_buffers and fn in ("ema_multi", "swa"):
                assert int(b[k]) == step + 1  # copied (a documented difference)
            elif fn == "swa" and a[k].is_floating_point():  # torch divides on the CPU
                assert torch.allclose(a[k], b[k], rtol=0, atol=4e-7), (step, k)
            else:
                assert torch.equal(a[k], b[k]), (fn, step, k)
    assert not torch.equal(got[-1]["module.0.weight"], got[0]["module.0.weight"])


def test_signatures_match_torch():
    for name in ("AveragedModel", "get_ema_multi_avg_fn", "get_ema_avg_fn"):
        a = inspect.signature(getattr(theirs, name))
        b = inspect.signature(getattr(ours, name))
        assert [(p.name, p.default) for p in a.parameters.values()] == [
            (p.name, p.default) for p in b.parameters.values()
        ], name


def test_state_dicts_load_both_ways():
    fn = FNS["ema_multi"]
    torch_avg, _ = run(theirs, fn, steps=4)
    our_avg = ours.AveragedModel(make_net(), **fn(ours))
    our_avg.load_state_dict(torch_avg.state_dict())  # strict
    assert int(our_avg.n_averaged) == 4
    back = theirs.AveragedModel(make_net(), **fn(theirs))
    back.load_state_dict(our_avg.state_dict())  # strict
    for k, v in back.state_dict().items():
        assert torch.equal(v, torch_avg.state_dict()[k]), k
    net = make_net()  # both continue alike (the loaded count decides copy vs average)
    with torch.no_grad():
        net[0].weight.add_(1.0)
    back.update_parameters(net)
    our_avg.update_parameters(net)
    for k, v in back.state_dict().items():
        assert torch.equal(v, our_avg.state_dict()[k]), k


def test_no_host_read_of_n_averaged_per_update(monkeypatch):
    """torch's ``bool(self.n_averaged == 0)`` reads the device tensor back every call; a
    tensor's ``__bool__``/``item`` never runs in ours."""
    averaged = ours.AveragedModel(make_net(), multi_avg_fn=ours.get_ema_multi_avg_fn(0.9))
    net = make_net()
    averaged.update_parameters(net)  # the first call builds the plan

    def refuse(self, *args):
        raise AssertionError("a host read of a tensor")

    for name in ("__bool__", "item", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for _ in range(3):
        averaged.update_parameters(net)
    monkeypatch.undo()
    assert int(averaged.n_averaged) == 4


def test_bad_arguments_and_other_models():
    with pytest.raises(EMAValueError, match="not both"):
        ours.AveragedModel(
            make_net(), avg_fn=ours.get_ema_avg_fn(), multi_avg_fn=ours.get_ema_multi_avg_fn()
        )
    with pytest.raises(EMAValueError, match="decay"):
        ours.get_ema_multi_avg_fn(1.5)
    averaged = ours.AveragedModel(make_net(), multi_avg_fn=ours.get_ema_multi_avg_fn(0.9))
    with pytest.raises(EMAStateError):
        averaged.update_parameters(nn.Sequential(nn.Linear(6, 8)))
