"""The model changes under the EMA: replaced parameters, buffers and submodules are followed
by name on every path, or refused with an error naming the tensor. Never silently untracked.

Before the redesign, a Parameter replaced after the first update (``load_state_dict(...,
assign=True)`` followed by a new optimizer, or ``model.head = nn.Linear(...)``) was no
longer tracked: the EMA averaged the dead tensor and ``swap()`` evaluated online weights.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import emakit
from _models import bn_mlp
from emakit import EMA, EMAStateError, EMAValueError, schedules

PATHS = [False, True, None]
PATH_IDS = ["loop", "foreach", "flat"]


def step(net: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    net.train()
    net(torch.randn(8, 4, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


class Reference:
    """A per-tensor EMA by name, reading the model's *current* tensors on every call."""

    def __init__(self, net: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in net.state_dict().items()}

    def update(self, net: nn.Module, decay: float) -> None:
        for k, v in net.state_dict().items():
            if v.is_floating_point():
                self.shadow[k].lerp_(v.detach(), 1.0 - decay)
            else:
                self.shadow[k].copy_(v)

    def assert_matches(self, ema: EMA, what: str) -> None:
        got = ema.ema_model.state_dict()
        for k, v in self.shadow.items():
            assert torch.equal(got[k], v), f"{what}: {k}"


def build(use_foreach, flatten, runner):
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    if flatten:
        emakit.flatten_parameters(net)
    kw = {"async_update": True} if runner == "thread" else {}
    ema = EMA(net, beta=0.8, update_after_step=0, update_every=1, use_foreach=use_foreach, **kw)
    return net, ema


@pytest.mark.parametrize("runner", ["sync", "thread"])
@pytest.mark.parametrize("flatten", [False, True], ids=["plain", "flattened"])
@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_load_state_dict_assign_then_new_optimizer_is_followed(use_foreach, flatten, runner):
    net, ema = build(use_foreach, flatten, runner)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema.update()  # the first update copies
    ref = Reference(net)
    for _ in range(3):
        step(net, opt, gen)
        ema.update()
        ref.update(net, ema.get_current_decay())
    ref.assert_matches(ema, "before the replacement")
    # Replace every parameter and buffer object, then train the new ones.
    new = {
        k: v.detach().clone() + (0.5 if v.is_floating_point() else 1)
        for k, v in net.state_dict().items()
    }
    net.load_state_dict(new, assign=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for call in range(4):
        step(net, opt, gen)
        ema.update()
        ref.update(net, ema.get_current_decay())
        ref.assert_matches(ema, f"call {call + 1} after load_state_dict(assign=True)")
    # swap() puts the EMA weights into the live parameters, and back.
    online = {k: v.detach().clone() for k, v in net.state_dict().items()}
    with ema.swap():
        for k, v in net.state_dict().items():
            assert torch.equal(v, ref.shadow[k]), f"swap: {k} holds the online value"
    for k, v in net.state_dict().items():
        assert torch.equal(v, online[k]), f"after swap: {k}"


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_replaced_head_of_the_same_shape_is_followed(use_foreach):
    net, ema = build(use_foreach, False, "sync")
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema.update()
    step(net, opt, gen)
    ema.update()
    ref = Reference(net)
    ref.shadow = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    net[3] = nn.Linear(8, 3)  # fine-tuning: a fresh head of the same shape
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        step(net, opt, gen)
        ema.update()
        ref.update(net, ema.get_current_decay())
    ref.assert_matches(ema, "after replacing the head")
    with ema.swap():
        assert torch.equal(net[3].weight, ema.ema_model[3].weight)


def test_replaced_head_of_another_shape_raises_naming_it():
    net, ema = build(None, False, "sync")
    ema.update()
    net[3] = nn.Linear(8, 5)
    with pytest.raises(EMAStateError, match=r"'3\.weight'.*shape"):
        ema.update()
    with pytest.raises(EMAStateError, match=r"'3\.weight'"), ema.swap():
        pass


def test_added_submodule_raises_naming_the_new_tensors():
    net, ema = build(None, False, "sync")
    ema.update()
    net.add_module("extra", nn.Linear(3, 3))
    with pytest.raises(EMAStateError, match=r"extra\.weight"):
        ema.update()


def test_replaced_buffer_is_followed():
    net, ema = build(None, True, "sync")
    ema.update()
    net[1].running_mean = torch.full((8,), 3.0)  # a new buffer object
    ema.copy_params_from_model_to_ema()
    assert torch.equal(ema.ema_model[1].running_mean, torch.full((8,), 3.0))


def test_model_to_another_dtype_raises_with_the_fix():
    net, ema = build(None, False, "sync")
    ema.update()
    net.double()
    with pytest.raises(EMAStateError, match="coerce_dtype"):
        ema.update()


def test_unchanged_model_keeps_its_plan_and_unrelated_registrations_do_not_rebuild():
    _, ema = build(None, True, "sync")
    ema.update()
    plan = ema.tracker.plan()
    nn.Linear(3, 3)  # registering parameters elsewhere moves the global epoch
    ema.update()
    assert ema.tracker.plan() is plan


def test_no_wait_hides_in_attribute_lookup():
    assert "__getattr__" not in vars(EMA)


@pytest.mark.parametrize("name", ["inv_gamma", "power"])
def test_one_validator_refuses_infinite_warm_up_settings(name):
    """inv_gamma=inf or power=inf would make the "EMA" the raw model (issue 14, item 12)."""
    net = bn_mlp(4, 8, 3, seed=0)
    with pytest.raises(EMAValueError) as ours:
        EMA(net, **{name: math.inf})
    with pytest.raises(EMAValueError) as theirs:
        schedules.inverse_gamma(**{name: math.inf})
    assert str(ours.value) == str(theirs.value)
    assert name in str(ours.value) and "inf" in str(ours.value)


def test_header_records_the_schedule_values(tmp_path):
    net = bn_mlp(4, 8, 3, seed=0)
    ema = EMA(net, schedule=schedules.linear_warmup(beta=0.999, warmup=100))
    path = emakit.save_ema_weights(ema, tmp_path / "ema.safetensors")
    import safetensors

    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["schedule"] == "linear_warmup(beta=0.999, warmup=100)"
    karras = emakit.KarrasEMA(copy.deepcopy(net), gamma=7.0)
    path = emakit.save_ema_weights(karras, tmp_path / "karras.safetensors")
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["schedule"] == "power_function(gamma=7.0)"


def test_registrations_elsewhere_do_not_walk_the_model(monkeypatch):
    """ema-pytorch does ``self.step += 1`` on a buffer every call, and other code builds
    modules while training: neither may cost every EMA a walk of its model."""
    from emakit._core.sources import ModuleSource

    _, ema = build(None, True, "sync")
    ema.update()
    walks = []
    original = ModuleSource.pairs

    def counted(self, *args):
        walks.append(1)
        return original(self, *args)

    monkeypatch.setattr(ModuleSource, "pairs", counted)
    other = nn.Module()
    other.register_buffer("step", torch.tensor(0))
    for _ in range(5):
        other.step += 1  # the same buffer object, re-registered
        other.step = other.step + 1  # a new buffer, on a module the EMA does not track
        nn.Linear(2, 2)  # a new module elsewhere
        ema.update()
    assert walks == []


# -- issue 14, item 8: every kind of model change, on every path --------------------------


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(
    ("change", "name"),
    [
        ("add a parameter", "extra"),
        ("delete a parameter", "0.bias"),
        (".data of another shape", "0.weight"),
        ("replace a submodule by another shape", "3.weight"),
    ],
)
def test_model_changes_that_no_longer_pair_raise_naming_the_tensor(use_foreach, change, name):
    net, ema = build(use_foreach, False, "sync")
    ema.update()
    if change == "add a parameter":
        net.extra = nn.Parameter(torch.zeros(2))
    elif change == "delete a parameter":
        del net[0].bias  # no torch hook reports a del
    elif change == ".data of another shape":
        net[0].weight.data = torch.zeros(5, 4)
    else:
        net[3] = nn.Linear(8, 7)
    with pytest.raises(EMAStateError, match=name.replace(".", r"\.")):
        ema.update()


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_replaced_parameter_object_is_followed(use_foreach):
    net, ema = build(use_foreach, True, "sync")
    ema.update()
    before = ema.ema_model[0].weight.detach().clone()
    net[0].weight = nn.Parameter(torch.full((8, 4), 2.0))  # a new object, same shape
    ema.update()
    decay = ema.get_current_decay()
    expected = before.lerp(torch.full((8, 4), 2.0), 1 - decay)
    assert torch.equal(ema.ema_model[0].weight, expected)
    with ema.swap():
        assert torch.equal(net[0].weight, expected)


def test_buffers_replaced_by_module_apply_are_tracked():
    """Planted bug: the registry watch counting only new keys (a registration), so a buffer
    that ``Module._apply`` replaces under its existing key (``.to()``, ``.float()`` on a
    buffer of another dtype, here a clone) left the EMA averaging the old, orphaned buffer.
    Parameters are untouched here (same objects, same storage), so only the buffer watch
    can notice."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    ema.update()
    ema.update()
    old = net[1].running_mean
    net._apply(lambda t: t if isinstance(t, nn.Parameter) else t.clone())
    assert net[1].running_mean is not old and net[0].weight.data_ptr() != 0
    net[1].running_mean.fill_(4.0)
    before = ema.ema_model[1].running_mean.clone()
    ema.update()
    decay = ema.get_current_decay()
    want = before * decay + 4.0 * (1 - decay)
    torch.testing.assert_close(ema.ema_model[1].running_mean, want, rtol=0, atol=1e-6)


# -- item 9: skip_nonfinite with empty tensors, and in MultiEMA ------------------------------


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_skip_nonfinite_with_an_empty_tensor(use_foreach):
    net = bn_mlp(4, 8, 3, seed=0)
    net.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    ema = EMA(
        net, update_after_step=0, update_every=1, use_foreach=use_foreach, skip_nonfinite=True
    )
    ema.update()
    ema.update()
    assert ema.num_skipped_nonfinite == 0
    with torch.no_grad():
        net[0].weight[0, 0] = float("inf")
    ema.update()
    with pytest.warns(RuntimeWarning):  # given when the count is read back
        assert ema.num_skipped_nonfinite == 1


def test_multi_ema_counts_skips_on_every_member():
    net = bn_mlp(4, 8, 3, seed=0)
    multi = emakit.MultiEMA(
        net, betas=(0.9, 0.99), update_after_step=0, update_every=1, skip_nonfinite=True
    )
    multi.update()
    with torch.no_grad():
        net[0].weight[0, 0] = float("nan")
    multi.update()
    with pytest.warns(RuntimeWarning):  # given when the count is read back
        assert [e.num_skipped_nonfinite for e in multi] == [1, 1]


def test_torch_2_4_ordered_dict_registries_are_watched_too():
    """torch 2.4 keeps ``_parameters``/``_buffers``/``_modules`` in OrderedDicts (2.5 on:
    dicts): a replaced head is followed there too (issue 31: on torch 2.4 it was not, and
    the EMA kept averaging the old head's tensors)."""
    from collections import OrderedDict

    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    for module in net.modules():  # as torch 2.4 builds them
        for registry in ("_parameters", "_buffers", "_modules"):
            module.__dict__[registry] = OrderedDict(module.__dict__[registry])
    ema = EMA(net, beta=0.8, update_after_step=0, update_every=1)
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ema.update()
    ref = Reference(net)
    net[3] = nn.Linear(8, 3)  # a fresh head of the same shape
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        step(net, opt, gen)
        ema.update()
        ref.update(net, ema.get_current_decay())
    ref.assert_matches(ema, "after replacing the head")
    net[3] = nn.Linear(8, 5)
    with pytest.raises(EMAStateError, match=r"'3\.weight'.*shape"):
        ema.update()


# -- issue 39: changes seen by reading the model, never by altering it ------------------------


def test_a_one_element_tensor_replaced_by_an_equal_one_is_followed():
    """A one-element tensor's ``==`` could call a replacement equal, so its dict is checked
    value by value: a 0-dim scale replaced by an equal new Parameter, then trained, is
    followed (the EMA averages the new object, not the dead one)."""
    net = bn_mlp(4, 8, 3, seed=0)
    net.register_parameter("scale", nn.Parameter(torch.ones(())))
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    ema.update()
    net.scale = nn.Parameter(torch.ones(()))  # equal value, another object
    with torch.no_grad():
        net.scale.add_(1.0)  # trained
    ema.update()
    assert any(p.online is net.scale for p in ema.tracker.plan().pairs)
    weight = 1.0 - ema.get_current_decay()
    assert torch.equal(ema.ema_model.scale, torch.ones(()).lerp(torch.full((), 2.0), weight))


def test_functional_call_leaves_nothing_to_pair_again(monkeypatch):
    """``torch.func.functional_call`` swaps tensors in and puts the model's own back: the
    next update finds the registries as they were (before: a full re-pairing, 13.6x)."""
    from emakit._core.sources import ModuleSource

    net = bn_mlp(4, 8, 3, seed=0)
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()
    plan = ema.tracker.plan()
    walks = []
    original = ModuleSource.pairs
    monkeypatch.setattr(
        ModuleSource, "pairs", lambda self, *a: walks.append(1) or original(self, *a)
    )
    params = {k: v.detach() * 2 for k, v in net.named_parameters()}
    torch.func.functional_call(net, params, (torch.randn(3, 4),))
    ema.update()
    assert walks == [] and ema.tracker.plan() is plan


@pytest.mark.parametrize(
    ("change", "name"),
    [("add a parameter", "extra"), ("delete a parameter", "0.bias"), ("replace", "3.weight")],
)
def test_watch_model_sees_the_same_changes(change, name):
    """The opt-in constant-time watch (``watch_model=True``, which alters the model)
    refuses and follows what the default comparison does."""
    net = bn_mlp(4, 8, 3, relu=True, seed=0)
    ema = EMA(net, beta=0.8, update_after_step=0, update_every=1, watch_model=True)
    ema.update()
    if change == "add a parameter":
        net.extra = nn.Parameter(torch.zeros(2))
    elif change == "delete a parameter":
        del net[0].bias
    else:
        net[3] = nn.Linear(8, 7)
    with pytest.raises(EMAStateError, match=name.replace(".", r"\.")):
        ema.update()


def test_a_tensor_of_the_ema_model_replaced_is_followed():
    """The EMA model's registries are compared too: a shadow replaced through
    ``ema.ema_model`` (a load with ``assign=True``) is the one averaged from then on."""
    net = bn_mlp(4, 8, 3, seed=0)
    ema = EMA(net, beta=0.5, update_after_step=0, update_every=1)
    ema.update()
    state = {k: torch.zeros_like(v) for k, v in ema.ema_model.state_dict().items()}
    ema.ema_model.load_state_dict(state, assign=True)
    ema.update()
    weight = 1.0 - ema.get_current_decay()
    expected = torch.zeros_like(net[0].weight).lerp(net[0].weight.detach(), weight)
    assert torch.equal(ema.ema_model[0].weight, expected)


@pytest.mark.parametrize("use_foreach", PATHS, ids=PATH_IDS)
def test_to_empty_then_new_values_is_followed(use_foreach):
    """``to_empty()`` gives the parameters new storage (the same objects) and replaces the
    buffers: the next update averages the new values, as ema-pytorch's would."""
    net, ema = build(use_foreach, False, "sync")
    ema.update()
    ref = Reference(net)
    ref.shadow = {k: v.clone() for k, v in ema.ema_model.state_dict().items()}
    net.to_empty(device="cpu")
    with torch.no_grad():
        for i, t in enumerate(net.state_dict().values()):
            t.fill_(i + 1)
    ema.update()
    ref.update(net, ema.get_current_decay())
    ref.assert_matches(ema, "after to_empty()")
