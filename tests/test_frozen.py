"""Frozen weights: copied and averaged by default (ema-pytorch's way); with
``share_frozen=True`` they cost nothing: shared with the online model, not copied or
averaged, bit-identical to the real ema-pytorch through frozen/unfreeze sequences (an
unfreezing seen before the next write), copy-on-write for every write into the EMA, and a
write into a shared weight that the EMA cannot follow refused by name. Nothing is attached
to the model either way."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from _models import ema_weights, frozen_base, same_tensors, step_weights
from emakit import EMA, EMAStateError, KarrasEMA, MultiEMA, load_ema_weights, save_ema_weights

ema_pytorch = pytest.importorskip("ema_pytorch")

KW = {"beta": 0.9, "update_after_step": 2, "update_every": 1, "include_online_model": False}
#: Frozen weights shared with the model (the default copies them).
SHARE = {"share_frozen": True}


def make_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    net[0].requires_grad_(False)
    net[2].weight.requires_grad_(False)
    return net


def shared(ema: EMA, net: nn.Module) -> list[str]:
    online = dict(net.named_parameters())
    return [n for n, p in ema.ema_model.named_parameters() if p.data_ptr() == online[n].data_ptr()]


def batch(i: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


def step(net: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    net(batch(i)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def assert_same_as_reference(ema: EMA, ref: object, where: object) -> None:
    a, b = ema.state_dict(), ref.state_dict()  # type: ignore[attr-defined]
    for k in b:
        if k.startswith("ema_model."):
            assert torch.equal(a[k], b[k]), (where, k)


def test_frozen_parameters_are_shared_not_copied():
    net = make_net()
    ema = EMA(net, **SHARE, **KW)
    assert shared(ema, net) == ["0.weight", "0.bias", "2.weight"]
    plan_names = {p.name for p in ema.tracker.plan().pairs}
    assert plan_names == {"2.bias", "4.weight", "4.bias"}  # nothing else is updated
    copied = EMA(net, share_frozen=False, **KW)
    assert shared(copied, net) == []
    assert set(ema.state_dict()) == set(copied.state_dict())  # ema-pytorch's keys, frozen too


def test_frozen_parameters_are_copied_by_default():
    net = make_net()
    ema = EMA(net, **KW)
    assert shared(ema, net) == []
    assert len(ema.tracker.plan().pairs) == 6  # averaged as ema-pytorch averages them


def _unfreeze_in_optimizer(net: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    net[0].requires_grad_(True)
    return opt


def _unfreeze_new_group(net: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    net[2].weight.requires_grad_(True)
    opt.add_param_group({"params": [net[2].weight], "lr": 0.05})
    return opt


def _unfreeze_new_optimizer(net: nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    net.requires_grad_(True)
    return torch.optim.Adam(net.parameters(), lr=0.01)


UNFREEZE: dict[str, Callable] = {
    "in-optimizer": _unfreeze_in_optimizer,
    "new-param-group": _unfreeze_new_group,
    "new-optimizer": _unfreeze_new_optimizer,
}


@pytest.mark.parametrize("share_frozen", [True, False])
@pytest.mark.parametrize("how", list(UNFREEZE))
def test_unfreezing_matches_ema_pytorch_bit_for_bit(how: str, share_frozen: bool):
    """Copied frozen weights follow any unfreezing. Shared ones follow it when the EMA is
    read (here ``ema(x)``, an evaluation) between the unfreezing and the next step: the
    read gives them their own storage first (nothing on the model watches the forward)."""
    net = make_net()
    ref_net = copy.deepcopy(net)
    ema = EMA(net, share_frozen=share_frozen, **KW)
    ref = ema_pytorch.EMA(ref_net, **KW)

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        trainable = [p for p in model.parameters() if p.requires_grad]
        everything = list(model.parameters())
        return torch.optim.SGD(everything if how == "in-optimizer" else trainable, lr=0.1)

    opt, ref_opt = optimizer(net), optimizer(ref_net)
    for i in range(10):
        if i == 5:
            opt = UNFREEZE[how](net, opt)
            ref_opt = UNFREEZE[how](ref_net, ref_opt)
            ema(batch(99))  # a read: a shared weight now unfrozen gets its own copy
        step(net, opt, i)
        step(ref_net, ref_opt, i)
        ema.update()
        ref.update()
        assert_same_as_reference(ema, ref, i)
    assert len(shared(ema, net)) < 3  # the unfrozen weights got their own storage


@pytest.mark.parametrize("how", list(UNFREEZE))
def test_a_shared_weight_unfrozen_and_trained_unseen_is_refused_naming_the_fix(how: str):
    """Trained before the EMA was read again, a shared weight's EMA value (the model's
    storage) is gone: update(), ema(x), swap() and state_dict() refuse, naming the weight,
    the cause and ``share_frozen=False``; nothing was averaged."""
    net = make_net()
    ema = EMA(net, **SHARE, **KW)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    for i in range(3):
        step(net, opt, i)
        ema.update()
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    opt = UNFREEZE[how](net, opt)
    if how == "in-optimizer":  # this optimizer holds the trainable weights only
        opt.add_param_group({"params": list(net[0].parameters())})
    step(net, opt, 3)
    name = "2.weight" if how == "new-param-group" else "0.weight"
    for read in (ema.update, lambda: ema(batch(0)), lambda: ema.swap().enter(), ema.state_dict):
        with pytest.raises(EMAStateError, match=rf"{name}.*unfrozen.*share_frozen=False"):
            read()
    assert ema.tracker.step == 3  # the refused update counted nothing
    own = ema._modules["ema_model"].state_dict()  # past the check: nothing was averaged
    for k in ("2.bias", "4.weight", "4.bias"):
        assert torch.equal(own[k], before["ema_model." + k]), k


@pytest.mark.parametrize("share_frozen", [None, False, True], ids=["default", "False", "True"])
def test_a_frozen_weight_in_a_parameter_list_unfrozen_and_trained(share_frozen: bool | None):
    """A frozen weight that no module's forward registers (an ``nn.ParameterList`` used by
    its parent) and is unfrozen later: copied, the EMA equals ema-pytorch's; shared, the
    next update is refused by name (before, it averaged the trained weight silently)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scales = nn.ParameterList([nn.Parameter(torch.ones(4)) for _ in range(2)])
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x * self.scales[0] + self.scales[1])

    torch.manual_seed(0)
    net = Net()
    net.scales.requires_grad_(False)
    ref_net = copy.deepcopy(net)
    ema = EMA(net, **({} if share_frozen is None else {"share_frozen": share_frozen}), **KW)
    ref = ema_pytorch.EMA(ref_net, **KW)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref_net)]
    for i in range(8):
        if i == 3:
            net.scales.requires_grad_(True)
            ref_net.scales.requires_grad_(True)
        for model, opt in zip((net, ref_net), opts, strict=True):
            step(model, opt, i)
        if share_frozen and i == 3:
            with pytest.raises(EMAStateError, match=r"scales\.0.*share_frozen=False"):
                ema.update()
            return
        ema.update()
        ref.update()
        assert_same_as_reference(ema, ref, i)


def test_a_frozen_value_changed_in_place_lags_as_ema_pytorch_or_is_refused_when_shared():
    """New values written into a frozen weight: copied (the default), the EMA lags as
    ema-pytorch's does; shared, the EMA's value was that storage, so it refuses (before,
    it took the new value at once), until a load sets the EMA's own value."""
    net = make_net()
    ema, copied = EMA(net, **SHARE, **KW), EMA(net, share_frozen=False, **KW)
    ref = ema_pytorch.EMA(net, **KW)
    for e in (ema, copied, ref):
        for _ in range(4):
            e.update()
    state = copy.deepcopy(ema.state_dict())  # (its frozen tensors are the model's storage)
    with torch.no_grad():
        net[0].weight.add_(1.0)  # new base weights loaded into the frozen layer
    for e in (copied, ref):
        e.update()
    assert torch.equal(copied.ema_model[0].weight, ref.ema_model[0].weight)  # lags alike
    assert not torch.equal(copied.ema_model[0].weight, net[0].weight)
    with pytest.raises(EMAStateError, match=r"0\.weight.*written in place.*share_frozen=False"):
        ema.update()
    ema.load_state_dict(state)  # the EMA's own value again: owned, averaged from here
    ema.update()
    assert "0.weight" not in shared(ema, net) and "0.bias" in shared(ema, net)
    assert torch.equal(
        ema.ema_model[0].weight,
        state["ema_model.0.weight"].lerp(net[0].weight, 1 - ema.get_current_decay()),
    )


def _replace_data(net: nn.Module) -> None:
    net[0].weight.data = net[0].weight.detach() + 1.0  # new storage, same Parameter


def _assign_load(net: nn.Module) -> None:
    state = {k: v.clone() + 1.0 for k, v in net[0].state_dict().items()}
    net[0].load_state_dict(state, assign=True)  # new Parameter objects


@pytest.mark.parametrize("replace", [_replace_data, _assign_load], ids=["data", "assign"])
def test_a_frozen_weight_whose_storage_is_replaced_is_averaged_from_then_on(replace):
    net = make_net()
    ref_net = copy.deepcopy(net)
    ema = EMA(net, **SHARE, **KW)
    ref = ema_pytorch.EMA(ref_net, **KW)
    for i in range(8):
        if i == 4:
            replace(net)
            replace(ref_net)
        ema.update()
        ref.update()
        assert_same_as_reference(ema, ref, i)
    assert "0.weight" not in shared(ema, net)  # the old storage is the EMA's alone now
    assert not torch.equal(ema.ema_model[0].weight, net[0].weight)  # it lags, averaged
    assert "0.weight" in {p.name for p in ema.tracker.plan().pairs}


def test_ema_kinds_sharing_a_replaced_storage_each_average_their_own_copy():
    net = make_net()
    ref_net = copy.deepcopy(net)
    betas = (0.5, 0.9)
    emas = [EMA(net, **SHARE, **{**KW, "beta": b}) for b in betas]
    multi = MultiEMA(net, betas=betas, update_after_step=2, update_every=1, **SHARE)
    refs = [ema_pytorch.EMA(ref_net, **{**KW, "beta": b}) for b in betas]
    for i in range(8):
        if i == 4:
            _replace_data(net)
            _replace_data(ref_net)
        for e in (*emas, multi, *refs):
            e.update()
        for e, r in zip(emas, refs, strict=True):
            assert_same_as_reference(e, r, i)
    for e, r in zip(multi, refs, strict=True):
        assert torch.equal(e.ema_model[0].weight, r.ema_model[0].weight)
    assert emas[0].ema_model[0].weight.data_ptr() != emas[1].ema_model[0].weight.data_ptr()


def _state_with_other_frozen_values(ema: EMA) -> dict:
    state = {k: v.clone() for k, v in ema.state_dict().items()}
    state["ema_model.0.weight"] += 0.5
    return state


def test_load_state_dict_copies_on_write():
    net = make_net()
    before = net[0].weight.detach().clone()
    ema = EMA(net, **SHARE, **KW)
    ref = ema_pytorch.EMA(copy.deepcopy(net), **KW)
    state = _state_with_other_frozen_values(ema)
    ema.load_state_dict(state)
    ref.load_state_dict(state)
    assert torch.equal(net[0].weight, before)  # the online model is untouched
    assert torch.equal(ema.ema_model[0].weight, before + 0.5)
    assert "0.weight" not in shared(ema, net) and "0.bias" in shared(ema, net)
    for _ in range(3):  # from now on it is averaged back toward the model, as ema-pytorch does
        ema.update()
        ref.update()
        assert_same_as_reference(ema, ref, "after load")


def test_load_ema_weights_copies_on_write(tmp_path: Path):
    net = make_net()
    before = net[0].weight.detach().clone()
    other = make_net()
    with torch.no_grad():
        other[0].weight.mul_(2)
    path = save_ema_weights(EMA(other, **SHARE, **KW), tmp_path / "w.safetensors")
    ema = EMA(net, **SHARE, **KW)
    load_ema_weights(ema, path)
    assert torch.equal(net[0].weight, before)
    assert torch.equal(ema.ema_model[0].weight, 2 * before)


def test_loading_equal_values_keeps_sharing():
    net = make_net()
    ema = EMA(net, **SHARE, **KW)
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    ema.load_state_dict(torch.load(buffer, weights_only=True))
    assert len(shared(ema, net)) == 3


def test_swap_forward_and_copies_leave_the_model_alone():
    net = make_net()
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    ema = EMA(net, **SHARE, **KW)
    reference = EMA(net, share_frozen=False, **KW)
    for i in range(6):
        step(net, opt, i)
        ema.update()
        reference.update()
    raw = {k: v.clone() for k, v in net.state_dict().items()}
    x = batch(99)
    expected = reference(x)
    assert torch.equal(ema(x), expected)
    for in_place in (False, True):
        with ema.swap(in_place=in_place):
            assert torch.equal(net(x), expected)
        for k, v in net.state_dict().items():
            assert torch.equal(v, raw[k]), (in_place, k)
    ema.copy_params_from_ema_to_model()
    ema.copy_params_from_model_to_ema()
    assert len(shared(ema, net)) == 3


def test_moving_the_ema_never_moves_the_model():
    net = make_net()
    ema = EMA(net, coerce_dtype=True, **SHARE, **KW)
    ema.double()  # the EMA's own copy of its shared weights: copy-on-write
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert shared(ema, net) == []
    assert all(p.dtype == torch.float64 for p in ema.ema_model.parameters())
    ema.update()


def test_every_kind_shares():
    net = make_net()
    multi = MultiEMA(
        net,
        betas=(0.9, 0.99),
        update_after_step=0,
        update_every=1,
        include_online_model=False,
        **SHARE,
    )
    karras = KarrasEMA(net, sigma_rel=0.1, update_every=1, **SHARE)
    assert all(len(shared(e, net)) == 3 for e in multi)
    assert len(shared(karras, net)) == 3
    copied = [
        EMA(
            net,
            beta=b,
            share_frozen=False,
            update_after_step=0,
            update_every=1,
            include_online_model=False,
        )
        for b in (0.9, 0.99)
    ]
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5)
    for i in range(5):
        step(net, opt, i)
        multi.update()
        for e in copied:
            e.update()
    for e, c in zip(multi, copied, strict=True):
        a, b = e.state_dict(), c.state_dict()
        for k in b:
            assert torch.equal(a[k], b[k]), k


def test_a_frozen_weight_viewed_with_other_strides_is_not_shared():
    """Planted bug: ``shares()`` comparing only the data pointer, so a frozen weight
    re-pointed at a transposed view of its own storage (``p.data = p.data.t()``: the same
    address, other strides) still counted as shared when the EMA paired again (here
    because another parameter was replaced, as ``load_state_dict(assign=True)`` does): the
    EMA kept the old view and never averaged toward the new value. It must match
    ``share_frozen=False`` bit for bit."""

    def run(share: bool) -> dict[str, torch.Tensor]:
        net = frozen_base()
        ema = EMA(net, beta=0.5, update_after_step=0, update_every=1, share_frozen=share)
        for k in range(2):
            step_weights(net[1], k)
            ema.update()
        w = net[0].weight
        w.data = w.data.t()  # the same storage, seen transposed
        net[1].weight = nn.Parameter(net[1].weight.detach().clone())  # the EMA pairs again
        for k in range(3):
            step_weights(net[1], k)
            ema.update()
        return ema_weights(ema)

    shared, copied = run(True), run(False)
    assert not torch.equal(copied["0.weight"], frozen_base()[0].weight)  # it moved
    assert same_tensors(shared, copied)
