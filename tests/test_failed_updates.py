"""A failed ``update()`` counts nothing (issue 30, item 7): whatever raises inside it (a
schedule or a decay group's callable raising or returning NaN or a value outside [0, 1], a
model change that no longer pairs), the step, the last averaging call and the weights stay as
they were, for an EMA and for every member of a MultiEMA, and the retry is the same call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _models import ema_weights, same_tensors, step_weights, two_linear
from emakit import EMA, EMAStateError, EMAValueError, MultiEMA


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
        net = two_linear()
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
            before = (int(ema.step), ema.tracker.last, ema.tracker.gap, ema_weights(ema))
            with pytest.raises(error):
                ema.update()
            after = (int(ema.step), ema.tracker.last, ema.tracker.gap, ema_weights(ema))
            assert after[:3] == before[:3]
            assert same_tensors(after[3], before[3])
            asked = len(flaky.asked)
            flaky.broken = False
            ema.update()  # the retry
            assert flaky.asked[asked] == 4  # the same t as the failed call
        else:
            ema.update()
        ref.update()
    assert int(ema.step) == int(ref.step) == 8
    assert same_tensors(ema_weights(ema), ema_weights(ref))


def test_an_update_refused_by_a_model_change_counts_nothing():
    """A model change that no longer pairs (a parameter of another shape) makes
    ``update()`` raise from the plan, after the rule was asked: the counters are put
    back, and once the model is restored the next call is the same call."""
    net = two_linear()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1)
    ref = EMA(two_linear(), beta=0.9, update_after_step=0, update_every=1)
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
    assert int(ema.step) == 4 and same_tensors(ema_weights(ema), ema_weights(ref))


def test_a_failed_multi_ema_update_counts_nothing_for_any_member():
    """MultiEMA advances every member before the fused pass: a failure after that (the
    model no longer pairs) puts every member's counters back."""
    net = two_linear()
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
