"""How `emakit.compat.ultralytics.ModelEMA` runs on emakit's engine, in-process and
without Ultralytics: the EMA copy paired with the model once and again when either changes,
the tensors grouped and chunked for the ``mul_add`` formula, compile and parallel wrappers
unwrapped, ``update_attr`` copying public attributes only, pickles that hold no model being
trained, and the messages of bad arguments in full.

The numbers are checked against `Reference` (Ultralytics' walk over both state dicts) of
``test_compat_ultralytics``, whose helpers this file reuses.
"""

from __future__ import annotations

import copy
import itertools
import pickle
import struct

import pytest
import torch
from torch import nn

from emakit.compat import ultralytics as compat
from emakit.errors import EMATypeError, EMAValueError
from test_compat_ultralytics import (
    FORMULAS,
    Reference,
    assert_same,
    make_net,
)


class Wrapper(nn.Module):
    """A parallel wrapper as DDP is one (but not DDP): the model under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class Compiled(nn.Module):
    """A compile wrapper as ``torch.compile``'s is one: the model under ``._orig_mod``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def spy_on_mul_add(monkeypatch: pytest.MonkeyPatch) -> list[list]:
    """The ``groups`` argument of every `_mul_add_` call, recorded (and then computed)."""
    calls: list[list] = []
    real = compat._mul_add_

    def spy(groups, d):
        calls.append(groups)
        return real(groups, d)

    monkeypatch.setattr(compat, "_mul_add_", spy)
    return calls


def nudge(net: nn.Module, seed: int) -> None:
    """A training step's worth of change to every floating state-dict entry, without the
    cost of a backward pass: seeded noise added in place."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in net.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t).mul_(0.1))


def step_both(nets, ref, ours, n: int, where: str) -> None:
    for net in nets:
        nudge(net, n)
    ref.update(nets[0])
    ours.update(nets[1])
    assert_same(ref.ema.state_dict(), ours.ema.state_dict(), where)


# -- pairing the copy with the model -----------------------------------------------------------


@pytest.mark.parametrize("formula", FORMULAS)
def test_the_pairing_is_built_once_and_again_for_another_model_or_copy(formula, monkeypatch):
    """The engine pairs ``ema`` with the model at the first ``update()`` and keeps that
    pairing while both stay the same objects; another model or another ``ema`` is paired
    anew."""
    built: list[nn.Module] = []

    class CountingEMA(compat.EMA):
        def __init__(self, model, **kwargs) -> None:
            built.append(model)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(compat, "EMA", CountingEMA)
    net = make_net()
    ours = compat.ModelEMA(net, decay=0.9, tau=3, formula=formula)
    assert built == []  # nothing paired before the first update
    for n in range(1, 5):
        nudge(net, n)
        ours.update(net)
        ours.update(Wrapper(net))  # the same model once unwrapped
    assert built == [net] and ours.updates == 8
    ours.ema = copy.deepcopy(ours.ema)
    ours.update(net)
    ours.update(net)
    assert built == [net, net]
    other = make_net()
    ours.update(other)
    ours.update(other)
    assert len(built) == 3 and built[2] is other


@pytest.mark.parametrize("formula", FORMULAS)
def test_updates_alternating_between_two_models_average_each(formula):
    """Each ``update(model)`` averages the model it is given, also when the previous update
    was given another one (the pairing follows the model)."""
    first, second = make_net(), make_net()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(-3.0)  # values of its own
    ref = Reference(make_net(), 0.9, 2, formula)
    ours = compat.ModelEMA(make_net(), decay=0.9, tau=2, formula=formula)
    for n, net in enumerate([first, second, second, first, second], start=1):
        nudge(net, n)
        ref.update(net)
        ours.update(net)
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {n}")


# -- the mul_add formula's groups and chunks ---------------------------------------------------


def test_mul_add_groups_are_kept_until_the_pairs_change(monkeypatch):
    """The lists handed to the multi-tensor calls are built once per pairing: the same
    lists at every update, new ones after ``ema.half()``/``.float()`` or another ``ema``."""
    calls = spy_on_mul_add(monkeypatch)
    nets = [make_net(), make_net()]
    ref = Reference(nets[0], 0.9, 3, "mul_add")
    ours = compat.ModelEMA(nets[1], decay=0.9, tau=3, formula="mul_add")
    for n in range(1, 4):
        step_both(nets, ref, ours, n, f"update {n}")
    assert len(calls) == 3 and calls[1] is calls[0] and calls[2] is calls[0]
    for model in (ref.ema, ours.ema):
        model.half()
    step_both(nets, ref, ours, 4, "copy in float16")
    step_both(nets, ref, ours, 5, "copy in float16, again")
    assert calls[3] is not calls[0] and calls[4] is calls[3]
    assert {s.dtype for shadows, _ in calls[3] for s in shadows} == {torch.float16}
    ref.ema = copy.deepcopy(nets[0]).eval()
    ours.ema = copy.deepcopy(nets[1]).eval()
    step_both(nets, ref, ours, 6, "another copy")
    assert calls[5] is not calls[3]
    assert {s.dtype for shadows, _ in calls[5] for s in shadows} == {torch.float32}


class Sizes(nn.Module):
    """Tensors of known sizes: six float32 ones of 32 bytes, one of 200 bytes, two float64
    ones of 32 bytes and a float32 buffer of 32 bytes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.small = nn.ParameterList(nn.Parameter(torch.randn(8)) for _ in range(6))
        self.big = nn.Parameter(torch.randn(50))
        self.wide = nn.ParameterList(
            nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(2)
        )
        self.register_buffer("stat", torch.randn(8))


def test_mul_add_chunks_fill_up_to_the_byte_limit(monkeypatch):
    """Each group holds one kind (devices and dtypes) of tensors; cut in order, a chunk
    takes tensors while their bytes stay within ``_CHUNK_BYTES`` (exactly the limit fits),
    a tensor larger than the limit goes alone, and no chunk could take the next tensor."""
    limit = 64
    monkeypatch.setattr(compat, "_CHUNK_BYTES", limit)
    calls = spy_on_mul_add(monkeypatch)
    nets = [Sizes(), Sizes()]
    ref = Reference(nets[0], 0.9, 2, "mul_add")
    ours = compat.ModelEMA(nets[1], decay=0.9, tau=2, formula="mul_add")
    for n in range(1, 3):
        for net in nets:
            nudge(net, n)
        ref.update(nets[0])
        ours.update(nets[1])
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {n}")
    groups = calls[-1]

    def kind(s, o):
        return (s.device, s.dtype, o.device, o.dtype)

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    assert sum(len(onlines) for _, onlines in groups) == 10  # every tensor, once
    assert sorted(nbytes([o]) for _, onlines in groups for o in onlines) == [32] * 9 + [200]
    for shadows, onlines in groups:
        assert shadows and len(shadows) == len(onlines)
        assert len({kind(s, o) for s, o in zip(shadows, onlines, strict=True)}) == 1
        assert nbytes(onlines) <= limit or len(onlines) == 1
    by_kind: dict[tuple, list[list]] = {}
    for shadows, onlines in groups:
        by_kind.setdefault(kind(shadows[0], onlines[0]), []).append(onlines)
    assert {k[1] for k in by_kind} == {torch.float32, torch.float64}
    for chunks in by_kind.values():
        for chunk, following in itertools.pairwise(chunks):
            assert nbytes(chunk) + nbytes(following[:1]) > limit  # it could take no more
    sizes = sorted(nbytes(onlines) for _, onlines in groups)
    assert sizes.count(limit) >= 4 and 200 in sizes  # full chunks (32 + 32) and the big one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mul_add_averages_a_model_of_one_tensor(dtype):
    """A group of a single tensor (here the whole model) is averaged like any other."""
    torch.manual_seed(0)
    nets = [nn.Linear(3, 2, bias=False).to(dtype) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    ref = Reference(nets[0], 0.9, 2, "mul_add")
    ours = compat.ModelEMA(nets[1], decay=0.9, tau=2, formula="mul_add")
    for n in range(1, 4):
        torch.manual_seed(n)
        delta = torch.randn(2, 3).to(dtype)
        for net in nets:
            with torch.no_grad():
                net.weight.add_(delta)
        ref.update(nets[0])
        ours.update(nets[1])
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {n}")
    assert not torch.equal(ours.ema.weight, nets[1].weight)


# -- wrappers, attributes, pickles ------------------------------------------------------------


@pytest.mark.parametrize("formula", FORMULAS)
def test_a_compiled_model_inside_a_parallel_wrapper_is_unwrapped(formula):
    """``.module`` then ``._orig_mod`` (a compiled model wrapped for data parallelism, as
    Ultralytics' trainer may hold it): the copy is of the model inside both, and updates
    given the wrapped model average the model's tensors."""
    nets = [make_net(), make_net()]
    wrapped = Wrapper(Compiled(nets[1]))
    ours = compat.ModelEMA(wrapped, decay=0.9, tau=3, formula=formula)
    assert type(ours.ema) is nn.Sequential
    assert list(ours.ema.state_dict()) == list(nets[1].state_dict())
    ref = Reference(nets[0], 0.9, 3, formula)
    for n in range(1, 4):
        for net in nets:
            nudge(net, n)
        ref.update(nets[0])
        ours.update(wrapped)
        assert_same(ref.ema.state_dict(), ours.ema.state_dict(), f"update {n}")
    nets[1].names = {0: "a"}
    ours.update_attr(Compiled(Wrapper(Compiled(nets[1]))), include=["names"])
    assert ours.ema.names == {0: "a"}


def test_update_attr_leaves_private_attributes_alone():
    """Without ``include``, every public attribute is copied and none starting with ``_``:
    not the model's own ones, nor ``nn.Module``'s registries of parameters and children."""
    net = make_net()
    ours = compat.ModelEMA(net)
    net.nc, net._secret = 3, "model only"
    ours.update_attr(net)
    assert ours.ema.nc == 3
    assert not hasattr(ours.ema, "_secret")
    assert ours.ema._parameters is not net._parameters
    assert ours.ema._modules is not net._modules
    assert ours.ema[0].weight is not net[0].weight


@pytest.mark.parametrize("formula", FORMULAS)
def test_a_pickle_holds_the_copy_but_not_the_model_being_trained(formula):
    """Pickling (and deep-copying) a used ``ModelEMA`` keeps ``ema`` and leaves out the
    model it was paired with: its values are not in the pickle, and the unpickled object
    has the attributes of a fresh one and pairs again at its next update."""
    net = make_net()
    ours = compat.ModelEMA(net, decay=0.9, tau=3, formula=formula)
    nudge(net, 1)
    ours.update(net)
    ours.update(net)
    marker = struct.pack("<f", 1234.5) * 8
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(1234.5)  # after the updates: in the model only
    assert marker in pickle.dumps(net)  # (the check sees a pickled model)
    data = pickle.dumps(ours)
    assert marker not in data
    fresh = set(vars(compat.ModelEMA(make_net())))
    for other in (pickle.loads(data), copy.deepcopy(ours)):
        assert set(vars(other)) == fresh
        assert_same(other.ema.state_dict(), ours.ema.state_dict())
        assert not any(t.eq(1234.5).any() for t in other.ema.state_dict().values())
        other.update(net)
        ours_next = copy.deepcopy(ours)
        ours_next.update(net)
        assert_same(other.ema.state_dict(), ours_next.ema.state_dict())


# -- messages ---------------------------------------------------------------------------------


def test_bad_arguments_raise_the_whole_message():
    net = make_net()
    cases = [
        (
            {"model": "yolo11n.pt"},
            EMATypeError,
            "model must be a torch.nn.Module, got model='yolo11n.pt' (str); "
            "pass the model being trained",
        ),
        (
            {"decay": 1.5},
            EMAValueError,
            "decay must be a finite number in [0, 1], got decay=1.5; typically 0.9999",
        ),
        (
            {"tau": 0},
            EMAValueError,
            "tau must be a finite number in (0, inf), got tau=0; a number of updates, e.g. 2000",
        ),
        (
            {"formula": "fma"},
            EMAValueError,
            "formula must be one of ('lerp', 'mul_add'), got formula='fma': 'lerp' for "
            "Ultralytics >= 8.4.103, 'mul_add' for earlier releases and YOLOv5",
        ),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error) as raised:
            compat.ModelEMA(**{"model": net, **kwargs})
        assert str(raised.value) == message
