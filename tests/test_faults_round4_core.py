"""Faults and hostile input, round 4 (issue 30), the core: failed updates, tensor layouts,
``half()``, writes inside ``swap()``, and the tests the suite lacked (each states the
planted bug it catches; every one was checked to fail with its plant in place)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from emakit import EMA, EMAPytree, EMAStateError, EMATypeError, EMAValueError, MultiEMA


def net3() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def step_weights(net: nn.Module, k: int) -> None:
    """Move every weight by a deterministic amount (an optimizer step)."""
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.add_(0.1 * (k + 1) * (i + 1))


def weights(ema: EMA) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ema.ema_model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- item 7: a failed update() counts nothing --------------------------------------------


class Flaky:
    """A schedule that misbehaves at one ``t`` until it is fixed; records every ``t``."""

    def __init__(self, bad_t: int, bad: object) -> None:
        self.bad_t, self.bad, self.broken, self.asked = bad_t, bad, True, []

    def __call__(self, t: int) -> float:
        self.asked.append(t)
        if self.broken and t == self.bad_t:
            if isinstance(self.bad, BaseException):
                raise self.bad
            return self.bad  # type: ignore[return-value]
        return 1.0 - 1.0 / (t + 2)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (float("nan"), EMAValueError),
        (1.5, EMAValueError),
        (-0.2, EMAValueError),
        (ZeroDivisionError("in the schedule"), ZeroDivisionError),
    ],
    ids=["nan", "1.5", "-0.2", "raises"],
)
@pytest.mark.parametrize("where", ["schedule", "decay_group"])
def test_a_failed_update_counts_nothing_and_a_retry_is_the_same_call(bad, error, where):
    """A schedule (or a decay group's callable) that raises or returns NaN/1.5/-0.2 at
    one call: ``update()`` raises, and step, the last averaging call and the weights stay
    as they were; once fixed, the retry asks the schedule for the same ``t`` and the EMA
    ends bit for bit where an EMA that never failed ends. Before the fix ``step`` moved on
    and the retry skipped a step of the schedule."""
    flaky, good = Flaky(4, bad), Flaky(4, 0.5)
    good.broken = False

    def build(schedule: Flaky) -> tuple[nn.Module, EMA]:
        net = net3()
        kw: dict = {"update_after_step": 0, "update_every": 1}
        if where == "schedule":
            return net, EMA(net, schedule=schedule, **kw)
        return net, EMA(net, beta=0.9, decay_groups={"1.*": schedule}, **kw)

    net, ema = build(flaky)
    ref_net, ref = build(good)
    for k in range(8):
        step_weights(net, k)
        step_weights(ref_net, k)
        if k == 4:  # call 5, t = 4, fails
            before = (int(ema.step), ema.tracker.last, ema.tracker.gap, weights(ema))
            with pytest.raises(error):
                ema.update()
            after = (int(ema.step), ema.tracker.last, ema.tracker.gap, weights(ema))
            assert after[:3] == before[:3]
            assert same(after[3], before[3])
            asked = len(flaky.asked)
            flaky.broken = False
            ema.update()  # the retry
            assert flaky.asked[asked] == 4  # the same t as the failed call
        else:
            ema.update()
        ref.update()
    assert int(ema.step) == int(ref.step) == 8
    assert same(weights(ema), weights(ref))


def test_an_update_refused_by_a_model_change_counts_nothing():
    """A model change that no longer pairs (a parameter of another shape) makes
    ``update()`` raise from the plan, after the rule was asked: the counters are put
    back, and once the model is restored the next call is the same call."""
    net = net3()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    ref = EMA(net3(), beta=0.9, update_after_step=0, update_every=1)
    for _ in range(3):
        ema.update()
        ref.update()
    original = net[0].weight
    net[0].weight = nn.Parameter(torch.zeros(5, 5))
    before = (int(ema.step), ema.tracker.last, ema.tracker.gap)
    with pytest.raises(EMAStateError, match=r"'0\.weight'"):
        ema.update()
    assert (int(ema.step), ema.tracker.last, ema.tracker.gap) == before
    net[0].weight = original
    ema.update()
    ref.update()
    assert int(ema.step) == 4 and same(weights(ema), weights(ref))


def test_a_failed_multi_ema_update_counts_nothing_for_any_member():
    """MultiEMA advances every member before the fused pass: a failure after that (the
    model no longer pairs) puts every member's counters back."""
    net = net3()
    multi = MultiEMA(net, betas=(0.5, 0.9), update_after_step=0, update_every=1)
    for _ in range(2):
        multi.update()
    original = net[1].bias
    net[1].bias = nn.Parameter(torch.zeros(7))
    with pytest.raises(EMAStateError):
        multi.update()
    assert [(e.tracker.step, e.tracker.last) for e in multi] == [(2, 2), (2, 2)]
    net[1].bias = original
    multi.update()
    assert [(e.tracker.step, e.tracker.last, e.tracker.gap) for e in multi] == [(3, 3, 1)] * 2


# -- item 9: layouts an EMA cannot average -------------------------------------------------


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_sparse_tensor_is_refused_naming_it_and_the_keyword(layout, kind):
    """A sparse buffer or parameter raised a raw NotImplementedError from the shadow's
    layout (a sparse parameter: a raw error from torch's deepcopy). Now: an EMATypeError
    naming the tensor, its layout and ``ignore_names``, which then works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: sparse CSR is in beta
        sparse = (
            torch.eye(3).to_sparse() if layout == "sparse_coo" else torch.eye(3).to_sparse_csr()
        )
    net = nn.Linear(3, 3)
    if kind == "buffer":
        net.register_buffer("sp", sparse)
    else:
        net.sp = nn.Parameter(sparse, requires_grad=False)
    with pytest.raises(
        EMATypeError, match=rf"'sp' has layout torch.{layout}.*ignore_names=\{{'sp'\}}"
    ):
        EMA(net)
    ema = EMA(net, ignore_names={"sp"}, beta=0.5, update_after_step=0, update_every=1)
    with torch.no_grad():
        net.weight.add_(1.0)
    ema.update()
    ema.update()
    assert ema.ema_model.sp.layout == sparse.layout
    assert torch.equal(ema.ema_model.sp.to_dense(), torch.eye(3))
    with ema.swap():
        assert torch.equal(net.weight, ema.ema_model.weight)


def test_a_sparse_leaf_of_a_pytree_is_refused():
    with pytest.raises(EMATypeError, match=r"leaf 'a' has layout torch.sparse_coo.*pytree"):
        EMAPytree({"a": torch.eye(3).to_sparse(), "b": torch.ones(2)})


def test_a_sparse_tensor_given_in_ema_model_is_refused():
    net = nn.Linear(3, 3)
    other = nn.Linear(3, 3)
    other.register_buffer("sp", torch.eye(3).to_sparse())
    net.register_buffer("sp", torch.eye(3))
    with pytest.raises(EMATypeError, match=r"'sp' has layout torch\.sparse_coo"):
        EMA(net, ema_model=other)


# -- item 18: half() and the online model ------------------------------------------------


def frozen_base() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    net[0].requires_grad_(False)  # a frozen base, shared with the EMA
    return net


def test_half_converts_the_online_model_with_include_online_model_as_ema_pytorch():
    """docs/finetuning.md said ``ema.half()`` never converts the model. With the default
    ``include_online_model=True`` the model is a child of the EMA and is converted, as
    ema-pytorch's is; with ``include_online_model=False`` the model (and the frozen weight
    it shares with the EMA) is left as it was."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    peer_net = frozen_base()
    ema_pytorch.EMA(peer_net).half()
    assert peer_net[1].weight.dtype == torch.float16  # the peer converts the model

    net = frozen_base()
    EMA(net).half()
    assert {p.dtype for p in net.parameters()} == {torch.float16}

    net = frozen_base()
    base = net[0].weight.detach().clone()
    ema = EMA(net, include_online_model=False, update_after_step=0, update_every=1)
    ema.update()
    ema.half()
    assert {p.dtype for p in net.parameters()} == {torch.float32}
    assert torch.equal(net[0].weight, base)
    assert {p.dtype for p in ema.ema_model.parameters()} == {torch.float16}


def test_the_finetuning_doc_says_half_converts_the_online_model():
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "finetuning.md").read_text().split())
    assert "never the model" not in text
    assert "include_online_model=False" in text


# -- item 19: writes inside swap() land in the EMA ------------------------------------------


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


# -- tests the suite lacked (planted bugs that survived) -------------------------------------


def test_a_decay_groups_floor_is_capped_at_the_groups_beta():
    """Planted bug: a decay group's warm-up floored at ``min_value`` itself rather than at
    ``min(min_value, group beta)``, so a group whose beta is below ``min_value`` averaged
    with decay ``min_value`` (or the EMA refused to build). The group's decay is its beta
    from the first averaging call on, and the weights follow it."""
    net = net3()
    ema = EMA(
        net, beta=0.99, min_value=0.6, update_after_step=0, update_every=1,
        decay_groups={"1.*": 0.3},
    )  # fmt: skip
    ema.update()  # the initializing copy
    for k in range(4):
        before = weights(ema)
        step_weights(net, k)
        ema.update()
        decays = ema.current_decays()
        assert decays["1.*"] == pytest.approx(0.3)
        assert decays["default"] >= 0.6  # the default group keeps its floor
        online = dict(net.state_dict())
        for name in ("1.weight", "1.bias"):
            want = before[name].lerp(online[name], 1 - 0.3)
            torch.testing.assert_close(weights(ema)[name], want, rtol=0, atol=1e-6)
        want = before["0.weight"].lerp(online["0.weight"], 1 - decays["default"])
        torch.testing.assert_close(weights(ema)["0.weight"], want, rtol=0, atol=1e-6)


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


def test_a_strict_load_refuses_an_extra_online_model_key():
    """Planted bug: every ``online_model.*`` key counted as one the EMA owns, so the check
    that runs before anything is loaded let an extra ``online_model.<name>`` (a state of
    another model) through: torch's own strict check then raised only after it had copied
    every tensor, and the EMA and the model were left holding the refused state. With
    ``include_online_model=True`` the online model's keys are the EMA's own, paired
    strictly: an extra one is refused by name and nothing is loaded; ``strict=False``
    loads the rest. (With ``include_online_model=False``, ema-pytorch's
    ``online_model.*`` are accepted and ignored, as documented.)"""
    net = net3()
    ema = EMA(net, update_after_step=0, update_every=1)
    ema.update()
    state = {k: v + 1 if v.is_floating_point() else v for k, v in ema.state_dict().items()}
    state["online_model.2.weight"] = torch.zeros(2, 2)
    before, online = weights(ema), {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(EMAStateError, match=r"nothing was loaded.*online_model\.2\.weight"):
        ema.load_state_dict(state)
    assert same(weights(ema), before) and same(dict(net.state_dict()), online)
    ema.load_state_dict(state, strict=False)
    assert torch.equal(ema.ema_model[0].weight, before["0.weight"] + 1)
    lean = EMA(net3(), include_online_model=False)
    lean.load_state_dict(state)  # ignored, as for ema-pytorch's states


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
        return weights(ema)

    shared, copied = run(True), run(False)
    assert not torch.equal(copied["0.weight"], frozen_base()[0].weight)  # it moved
    assert same(shared, copied)
