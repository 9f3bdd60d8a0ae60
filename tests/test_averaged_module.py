"""The drop-ins shaped as a module (timm's ``ModelEmaV3``, torch's ``AveragedModel``,
mmengine's averaged models) on their shared base, `emakit.compat.averaged_module`: a copy
or pickle leaves the engine (and the online model it holds) behind and averages the same
after; the count buffer is read back only when written or replaced."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from _models import bn_mlp
from emakit.compat.averaged_module import HostCount, version_of
from emakit.compat.mmengine import ExponentialMovingAverage
from emakit.compat.swa_utils import AveragedModel, get_ema_multi_avg_fn
from emakit.compat.timm import ModelEmaV3

BUILD = {
    "timm": lambda net: ModelEmaV3(net, decay=0.9),
    "swa_utils": lambda net: AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
    "mmengine": lambda net: ExponentialMovingAverage(net, momentum=0.1),
}


def update(ema: nn.Module, net: nn.Module) -> None:
    if isinstance(ema, ModelEmaV3):
        ema.update(net)
    else:
        ema.update_parameters(net)


def step(net: nn.Module, seed: int) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("peer", BUILD)
def test_a_copy_leaves_the_engine_behind_and_averages_the_same(peer):
    torch.manual_seed(0)
    net = bn_mlp(4, 8, 2)
    ema = BUILD[peer](net)
    update(ema, net)
    step(net, 1)
    update(ema, net)
    assert ema._engine is not None and ema._engine.model is net
    copies = [copy.deepcopy(ema), pickle.loads(pickle.dumps(ema))]
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    copies.append(torch.load(buffer, weights_only=False))
    for other in copies:
        assert other._engine is None  # no second online model inside the copy
    for i in range(2, 5):
        step(net, i)
        for e in (ema, *copies):
            update(e, net)
    for other in copies:
        for (k, a), b in zip(ema.state_dict().items(), other.state_dict().values(), strict=True):
            assert torch.equal(a, b), (peer, k)
    assert ema.state_dict()  # compared something


def test_host_count_reads_a_written_or_replaced_buffer_only():
    count, buffer = HostCount(), torch.tensor(3)
    assert count.changed(buffer)  # never read: the first update reads it
    assert count.read(buffer) == 3 and not count.changed(buffer)
    version = version_of(buffer)
    buffer += 1  # the update's own increment
    count.advanced(buffer, version)
    assert count.value == 4 and not count.changed(buffer)
    buffer.fill_(0)  # torchvision's warm-up
    assert count.changed(buffer) and count.read(buffer) == 0
    other = torch.tensor(0)
    assert count.changed(other)  # a replaced buffer, even of the same value
    count.read(other)
    other.data.fill_(7)  # a write through .data moves no version counter: not seen
    assert not count.changed(other)
    version = version_of(other)
    other += 1
    other.fill_(2)  # someone else's write during the update
    count.advanced(other, version)
    assert count.changed(other)
    with torch.inference_mode():
        frozen = torch.tensor(5)
    assert version_of(frozen) == -1
    count.read(frozen)
    assert count.changed(frozen)  # no version counter: read every time
    restored = pickle.loads(pickle.dumps(count))
    assert restored.value == 5 and restored.changed(frozen) and restored.buffer is None


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x) * scale


@pytest.mark.parametrize("peer", list(BUILD))
def test_forward_passes_positional_and_keyword_arguments_on(peer):
    ema = BUILD[peer](_Scaled())
    x = torch.ones(4, 3)
    assert torch.equal(ema(x, scale=3.0), ema.module(x) * 3.0)
    assert torch.equal(ema(x=x), ema.module(x))
