"""Every tensor of an EMA's flat storage starts on a 64-byte boundary, so CPU kernels take
the paths they take on freshly allocated tensors: the same weights give the same outputs,
bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from emakit import EMA, MultiEMA, flatten_parameters


class Dots(nn.Module):
    """Small tensors between long vectors, and a forward of 1-D dot products: MKL's dot
    takes another vectorized path (another summation order) on a vector that does not
    start on a 64-byte boundary."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.small = nn.ParameterList(nn.Parameter(torch.randn(k, generator=g)) for k in (3, 5, 7))
        self.long = nn.ParameterList(nn.Parameter(torch.randn(4099, generator=g)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dots = [v @ x for v in self.long]
        return torch.stack(dots + [s.sum() for s in self.small])


def cloned(module: nn.Module) -> nn.Module:
    """``module`` with every tensor in a fresh allocation of its own."""
    fresh = copy.deepcopy(module)
    with torch.no_grad():
        for t in (*fresh.parameters(), *fresh.buffers()):
            t.data = t.data.clone()
    return fresh


def all_aligned(module: nn.Module) -> bool:
    return all(t.data_ptr() % 64 == 0 for t in (*module.parameters(), *module.buffers()))


@pytest.mark.parametrize(
    "kw",
    [{}, {"use_foreach": False}, {"skip_nonfinite": True}, {"async_update": True}],
    ids=["flat", "loop", "guarded", "thread"],
)
def test_the_ema_model_gives_the_outputs_of_freshly_allocated_weights(kw):
    net = Dots()
    ema = EMA(net, beta=0.9, update_after_step=0, update_every=1, **kw)
    for i in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(0.9).add_(0.01 * i)
        ema.update()
    assert all_aligned(ema.ema_model)
    x = torch.randn(4099, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ema(x), cloned(ema.ema_model)(x))


def test_every_layout_emakit_makes_is_aligned():
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 1)).to(torch.bfloat16)
    assert all_aligned(EMA(model, ema_dtype=torch.float32).ema_model)
    assert all(all_aligned(e.ema_model) for e in MultiEMA(model, betas=(0.9, 0.99)))
    assert all_aligned(EMA(model, device="cpu").ema_model)
    flats = flatten_parameters(model)
    assert all_aligned(model) and len(flats) == 2  # bf16 and the int64 counter


def test_an_aligned_flat_model_still_updates_in_one_span_padding_zero():
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    twin = cloned(model)
    flatten_parameters(model)
    ema = EMA(model, beta=0.5, update_after_step=0, update_every=1)
    ref = EMA(twin, beta=0.5, update_after_step=0, update_every=1, use_foreach=False)
    for _ in range(3):
        with torch.no_grad():
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                p.add_(1.0)
                q.add_(1.0)
        ema.update()
        ref.update()
    (group,) = ema.tracker.plan().groups
    assert len(group.lerp.dst) == len(group.lerp.src) == 1  # one lerp for all
    (span,) = group.lerp.dst
    covered = torch.zeros(span.numel(), dtype=torch.bool)
    base = span.storage_offset()
    for t in ema.ema_model.parameters():
        covered[t.storage_offset() - base : t.storage_offset() - base + t.numel()] = True
    assert not covered.all() and not span[~covered].any()  # padding exists and is zero
    for a, b in zip(ema.ema_model.parameters(), ref.ema_model.parameters(), strict=True):
        assert torch.equal(a, b)  # the reference loop's numbers
