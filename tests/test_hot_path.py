"""The Python work of one update, counted (not timed): a plain averaging ``update()`` is at
most 15 Python-level calls whatever the model's size, and a skipped one a handful. Counted
with ``sys.setprofile`` (each Python function entered counts once; C functions are not
counted), so the numbers are exact on any machine."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from emakit import EMA


def python_calls(fn) -> list[str]:
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls.append(f"{'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _ema(n: int, **kw) -> EMA:
    torch.manual_seed(0)
    ema = EMA(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), beta=0.99, **kw)
    for _ in range(5):
        ema.update()
    return ema


@pytest.mark.parametrize("modules", [2, 200])
def test_a_plain_averaging_update_is_at_most_15_python_calls(modules):
    ema = _ema(modules, update_after_step=0, update_every=1)
    calls = python_calls(ema.update)
    assert len(calls) <= 15, calls


def test_a_skipped_call_is_a_few_python_calls():
    ema = _ema(2, update_after_step=0, update_every=10)
    while ema.tracker.step % 10 == 0:  # (ema.step hands out a tensor view to watch)
        ema.update()
    calls = python_calls(ema.update)
    assert len(calls) <= 4, calls
