"""prepare_ema with the real Accelerate on CPU: one update per optimizer step under
gradient accumulation, and an exact save_state/load_state round trip."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate")

from emakit import EMA, EMAError  # noqa: E402
from emakit.integrations.accelerate import AcceleratedEMA, prepare_ema  # noqa: E402

ACCUM = 3
EMA_KW: dict[str, Any] = {"beta": 0.8, "update_after_step": 1, "update_every": 2}


@pytest.fixture(scope="module")
def accelerator() -> Iterator[Any]:
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    yield acc
    # Accelerate keeps process-wide singletons; leave none behind for other test files.
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(6, 4, generator=g)
        out.append((x, x.sum(1, keepdim=True)))
    return out


def train(acc: Any, model: nn.Module, opt: Any, ema: EMA, data: list) -> int:
    """The Accelerate idiom; returns how many optimizer steps ran."""
    steps = 0
    for x, y in data:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            ema.update()
            steps += acc.sync_gradients
    return steps


def setup(acc: Any) -> tuple[nn.Module, Any, AcceleratedEMA]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    return model, opt, prepare_ema(acc, model, **EMA_KW)


def test_updates_only_on_optimizer_steps(accelerator: Any):
    model, opt, ema = setup(accelerator)
    assert isinstance(ema, AcceleratedEMA) and isinstance(ema, EMA)
    assert ema.model is accelerator.unwrap_model(model)

    # Reference: a plain EMA of a twin model, updated by hand only after real steps.
    twin = make_model()
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    ref = EMA(twin, **EMA_KW, include_online_model=False)  # as prepare_ema's
    data = batches(4 * ACCUM)
    for i, (x, y) in enumerate(data):
        (F.mse_loss(twin(x), y) / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            twin_opt.step()
            twin_opt.zero_grad()
            ref.update()

    steps = train(accelerator, model, opt, ema, data)
    assert steps == 4
    assert int(ema.step) == 4
    for (k, a), (_, b) in zip(ema.state_dict().items(), ref.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=k)


def test_save_state_load_state_round_trip(accelerator: Any, tmp_path: Path):
    model, opt, ema = setup(accelerator)
    data = batches(8 * ACCUM)
    head, tail = data[: 3 * ACCUM], data[3 * ACCUM :]

    train(accelerator, model, opt, ema, head)
    accelerator.save_state(tmp_path / "state")
    saved = {k: v.clone() for k, v in ema.state_dict().items()}
    # save_state writes the model itself: the EMA's file holds only the EMA.
    index = accelerator._custom_objects.index(ema)
    written = tmp_path / "state" / f"custom_checkpoint_{index}.pkl"
    keys = set(torch.load(written, weights_only=True))
    assert keys == set(saved) and not any(k.startswith("online_model.") for k in keys)
    train(accelerator, model, opt, ema, tail)
    finished = {k: v.clone() for k, v in ema.state_dict().items()}
    assert int(finished["step"]) == 8

    accelerator.load_state(tmp_path / "state")
    for k, v in ema.state_dict().items():
        assert torch.equal(v, saved[k]), k
    train(accelerator, model, opt, ema, tail)  # the same steps again: the same EMA
    for k, v in ema.state_dict().items():
        assert torch.equal(v, finished[k]), k


def test_pickle_keeps_the_gating(accelerator: Any):
    _, _, ema = setup(accelerator)
    clone = pickle.loads(pickle.dumps(ema))
    accelerator.gradient_state._set_sync_gradients(False)
    try:
        clone.update()
        assert int(clone.step) == 0
    finally:
        accelerator.gradient_state._set_sync_gradients(True)
    clone.update()
    assert int(clone.step) == 1


def test_bad_arguments_are_refused(accelerator: Any):
    with pytest.raises(EMAError, match="Accelerator"):
        prepare_ema(object(), nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(EMAError, match="betta"):
        prepare_ema(accelerator, nn.Linear(2, 2), betta=0.9)
