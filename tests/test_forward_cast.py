"""``ema(x)`` takes the inputs the model takes when the shadow's dtype or device differs
(``ema_dtype``, ``device=``): floating inputs cast to the shadow, outputs cast back."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch
from torch import nn

from emakit import EMA
from emakit._core.forward import IOCast, io_cast, map_tensors


def mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"device": "cpu"}, {"device": "cpu", "async_update": True}],
    ids=["plain", "offload", "offload-async"],
)
def test_fp32_shadow_of_a_half_model_takes_half_inputs(dtype, kwargs):
    net = mlp(dtype)
    ema = EMA(net, ema_dtype=torch.float32, update_after_step=0, update_every=1, **kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        net(torch.randn(4, 8).to(dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    x = torch.randn(5, 8).to(dtype)
    y = ema(x)
    # the model's dtype out, computed at the shadow's precision from the same input
    assert y.dtype == dtype
    with torch.no_grad():
        expected = ema.ema_model(x.float()).to(dtype)
    assert torch.equal(y, expected)
    assert ema.ema_model[0].weight.dtype == torch.float32
    assert torch.equal(ema.forward_eval(x), y)


def test_without_a_different_shadow_inputs_pass_through_untouched():
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            seen.append(x)
            return self.lin(x)

    net = Probe()
    ema = EMA(net)
    x = torch.randn(1, 2)
    ema(x)
    assert seen[-1] is x  # no copy, no cast
    assert io_cast(net, ema.ema_model, dtype=False, device=False) is None
    # ema_dtype equal to the model's dtype: nothing to map either
    same = EMA(net, ema_dtype=torch.float32)
    assert io_cast(net, same.ema_model, dtype=True, device=True) is None


class Out(NamedTuple):
    logits: torch.Tensor
    ids: torch.Tensor


class TokenModel(nn.Module):
    """Integer token ids and a float mask in, a named tuple and a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids, *, mask):
        h = self.emb(ids) * mask.unsqueeze(-1)
        assert h.dtype == self.head.weight.dtype  # the inputs reached the shadow's dtype
        return Out(self.head(h), ids), OrderedDict(hidden=h, extra=[h.sum()], note="x")


def test_nested_inputs_and_outputs_integer_tensors_keep_their_dtype():
    net = TokenModel().to(torch.bfloat16)
    ema = EMA(net, ema_dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    mask = torch.ones(1, 3, dtype=torch.bfloat16)
    out, extra = ema(ids, mask=mask)
    assert isinstance(out, Out)
    assert out.logits.dtype == torch.bfloat16
    assert out.ids.dtype == torch.int64
    assert torch.equal(out.ids, ids)
    assert isinstance(extra, OrderedDict)
    assert extra["hidden"].dtype == torch.bfloat16
    assert extra["extra"][0].dtype == torch.bfloat16
    assert extra["note"] == "x"


def test_a_model_with_several_floating_dtypes_gets_fp32_outputs():
    net = nn.Sequential(nn.Linear(3, 3).to(torch.bfloat16), nn.Linear(3, 3))
    ema = EMA(net, ema_dtype=torch.float32)
    cast = io_cast(net, ema.ema_model, dtype=True, device=False)
    assert cast == IOCast(torch.float32, None, None, None)
    assert ema(torch.randn(1, 3, dtype=torch.bfloat16)).dtype == torch.float32


def test_offloaded_shadow_outputs_go_back_to_the_model_device():
    """The device half of the mapping, without a GPU: the model on the meta device, its
    shadow on the CPU (a CUDA model with ``device="cpu"`` on a GPU machine)."""
    model = nn.Linear(2, 2, device="meta", dtype=torch.bfloat16)
    shadow = nn.Linear(2, 2, dtype=torch.float32)
    cast = io_cast(model, shadow, dtype=True, device=True)
    assert cast == IOCast(torch.float32, torch.bfloat16, torch.device("cpu"), torch.device("meta"))
    back = cast.outputs({"y": torch.ones(2, dtype=torch.float32), "n": torch.ones(2).long()})
    assert back["y"].device.type == "meta"
    assert back["y"].dtype == torch.bfloat16
    assert back["n"].device.type == "meta"
    assert back["n"].dtype == torch.int64
    args, kwargs = cast.inputs((torch.ones(2, dtype=torch.bfloat16),), {"k": 1})
    assert kwargs == {"k": 1}
    assert args[0].dtype == torch.float32
    assert args[0].device.type == "cpu"


def test_map_tensors_keeps_containers():
    t = torch.zeros(1)
    got = map_tensors({"a": [t, (t, 3)], "b": "s"}, lambda x: x + 1)
    assert got["a"][0].item() == 1
    assert isinstance(got["a"][1], tuple)
    assert got["a"][1][1] == 3
    assert got["b"] == "s"
