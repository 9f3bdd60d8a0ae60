"""BEMA of an FSDP2 model on 2 gloo ranks: shard-local (no collective in update()), the
same numbers as a BEMA of the full weights, and a sharded state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from _models import LayerNormMLP, seeded
from emakit import BEMA
from emakit._dist.dtensor import is_dtensor, local_tensor

pytestmark = [*DIST_MARKS, FSDP2_MARK]
WORLD, STEPS = 2, 7
KW = {"update_freq": 2, "update_after": 1, "lag": 10}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_to_all_single",
)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int, rank: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)
    n = 8 // WORLD
    part = slice(rank * n, (rank + 1) * n)
    torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
    opt.step()
    opt.zero_grad()


def worker(rank: int, out: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = seeded(LayerNormMLP, 0)
    side = seeded(LayerNormMLP, 0)  # the reference: a BEMA of the full weights
    side_bema = BEMA(side, **KW)
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bema = BEMA(model, **KW)
    calls = {"n": 0}
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return fn(*args, **kwargs)

        return wrapped

    for i in range(1, STEPS + 1):
        step(model, opt, i, rank)
        for name, fn in real.items():
            setattr(dist, name, counting(fn))
        try:
            bema.update()
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        side.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()})
        side_bema.update()
    state = bema.state_dict()
    return {
        "collectives_in_update": calls["n"],
        "sharded": all(is_dtensor(state[k]) for k in state if k.startswith(("bema_", "ema_model"))),
        "local_numel": sum(
            local_tensor(t).numel() for k, t in state.items() if k.startswith("bema_ema.")
        ),
        "full": {k: v.full_tensor() for k, v in state.items() if is_dtensor(v)},
        "side": {
            k: v.clone() for k, v in side_bema.state_dict().items() if isinstance(v, torch.Tensor)
        },
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("bema-fsdp"), world=WORLD, timeout_s=120)


def test_update_is_shard_local(results: list[dict]) -> None:
    assert [r["collectives_in_update"] for r in results] == [0, 0]
    assert all(r["sharded"] for r in results)
    total = sum(p.numel() for p in LayerNormMLP().parameters())
    assert sum(r["local_numel"] for r in results) == total  # each rank holds its shards only


def test_same_numbers_as_a_bema_of_the_full_weights(results: list[dict]) -> None:
    full, side = results[0]["full"], results[0]["side"]
    assert full.keys() and {k for k in side if k.startswith(("bema_", "ema_model"))} == set(full)
    for k, v in full.items():
        torch.testing.assert_close(v, side[k], rtol=1e-6, atol=1e-7, msg=k)
