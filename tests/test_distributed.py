"""EMAs under torch.distributed: DDP, FSDP2 (DTensor shards), DCP checkpoints, full export.

Every test runs real 2-process jobs on CPU with the gloo backend over loopback. The
workers are forked from this process (torch, FSDP and dynamo are imported once, here),
each job is bounded by a deadline, and a worker that raises, dies or hangs fails the
test with its traceback. A job runs several scenarios and saves what it measured; the
tests below check those results against references computed in this process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from _launch import DIST_MARKS, need_fsdp2, run_ranks
from _models import LayerNormMLP, seeded
from emakit import EMA, EMAStateError
from emakit.distributed import (
    is_dtensor,
    is_rank_zero,
    load_sharded_ema,
    local_tensor,
    save_full_ema_weights,
    save_sharded_ema,
    swap_in_place,
)

pytestmark = DIST_MARKS

WORLD = 2
STEPS = 6
JOB_TIMEOUT_S = 120
EMA_KW = dict(beta=0.9, update_after_step=1, update_every=1)


class Net(LayerNormMLP):
    """``LayerNormMLP`` (the head's 5 rows shard unevenly over 2 ranks, 3 + 2) under the class
    name that the full export's ``model_class`` header is checked against."""


make_net = partial(seeded, Net, seed=0)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rank_batch(x: torch.Tensor, rank: int) -> torch.Tensor:
    n = x.shape[0] // WORLD
    return x[rank * n : (rank + 1) * n]


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- the launcher ------------------------------------------------------------------------


def run_job(fn: Callable[[int, Path], dict], out: Path) -> list[dict]:
    """Run ``fn(rank, out)`` on WORLD forked gloo ranks (tests/_launch.py)."""
    return run_ranks(fn, out, world=WORLD, timeout_s=JOB_TIMEOUT_S)


# -- DDP (and torch.compile) --------------------------------------------------------------

DDP_KW = dict(EMA_KW, update_model_with_ema_every=2, update_model_with_ema_beta=0.5)


def ddp_worker(rank: int, out: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = make_net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = EMA(ddp, **DDP_KW)
    assert ema.model is model
    for x, y in batches():
        train_step(ddp, opt, rank_batch(x, rank), rank_batch(y, rank))
        ema.update()

    # swap(): the DDP forward runs on the EMA weights, and the model's come back.
    x = batches()[0][0]
    with torch.no_grad():
        before, want = ddp(x), ema(x)
        with ema.swap():
            inside = ddp(x)
        after = ddp(x)

    # torch.compile around DDP, and DDP around a compiled module, are unwrapped too; a
    # compiled DDP model trains and the EMA follows the module under both wrappers.
    inner = make_net()
    compiled = torch.compile(DistributedDataParallel(inner), backend="eager")
    ema_c = EMA(compiled, **EMA_KW)
    opt_c = torch.optim.SGD(inner.parameters(), lr=0.1)
    for x, y in batches()[:2]:
        train_step(compiled, opt_c, rank_batch(x, rank), rank_batch(y, rank))
        ema_c.update()
    other = make_net()
    ema_d = EMA(DistributedDataParallel(torch.compile(other, backend="eager")), **EMA_KW)

    path = save_full_ema_weights(ema, out / "ddp-ema.safetensors")
    return {
        "ema": {k: v.clone() for k, v in ema.state_dict().items()},
        "online": cpu_state(model),
        "swap": (before, want, inside, after),
        "compiled": (ema_c.model is inner, ema_d.model is other, sorted(ema_c.state_dict())),
        "compiled_ema": {k: v.clone() for k, v in ema_c.ema_model.state_dict().items()},
        "compiled_online": cpu_state(inner),
        "file": str(path),
        "rank_zero": is_rank_zero(),
    }


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_job(ddp_worker, tmp_path_factory.mktemp("ddp"))


def test_ddp_ema_identical_on_every_rank(ddp_results: list[dict]) -> None:
    r0, r1 = ddp_results
    assert r0["rank_zero"] and not r1["rank_zero"]
    assert not any(k.startswith("ema_model.module.") for k in r0["ema"])
    assert sorted(r0["ema"]) == sorted(r1["ema"])
    for k in r0["ema"]:
        assert torch.equal(r0["ema"][k], r1["ema"][k]), k
    # update_model_with_ema pulled both ranks' models the same way: still in sync.
    for k in r0["online"]:
        assert torch.equal(r0["online"][k], r1["online"][k]), k


def test_ddp_ema_equals_single_process_ema(ddp_results: list[dict]) -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = EMA(model, **DDP_KW)
    for x, y in batches():  # the full batch: DDP's averaged gradient is its gradient
        train_step(model, opt, x, y)
        ema.update()
    got = ddp_results[0]
    for k, v in ema.state_dict().items():
        torch.testing.assert_close(got["ema"][k], v, atol=1e-5, rtol=0, msg=k)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got["online"][k], v, atol=1e-5, rtol=0, msg=k)


def test_ddp_swap_runs_the_ema_weights(ddp_results: list[dict]) -> None:
    for r in ddp_results:
        before, want, inside, after = r["swap"]
        torch.testing.assert_close(inside, want)
        assert torch.equal(after, before)
        assert (inside - before).abs().max() > 1e-3  # the EMA really differs


def test_compiled_and_ddp_models_are_unwrapped(ddp_results: list[dict]) -> None:
    for r in ddp_results:
        tracks_inner, tracks_other, keys = r["compiled"]
        assert tracks_inner and tracks_other
        assert not any("module." in k or "_orig_mod." in k for k in keys), keys
    r0, r1 = ddp_results
    for k, v in r0["compiled_ema"].items():
        assert torch.equal(v, r1["compiled_ema"][k]), k
    # after two steps the EMA (update_after_step=1) holds a copy of the second-to-last
    # weights blended with the last; at least it moved with the trained module
    assert not torch.equal(r0["compiled_ema"]["inp.weight"], make_net().inp.weight)


def test_ddp_full_export_loads_into_the_model_class(ddp_results: list[dict]) -> None:
    path = Path(ddp_results[0]["file"])
    net = Net()
    net.load_state_dict(safetensors.torch.load_file(path))
    for k, v in net.state_dict().items():
        assert torch.equal(v, ddp_results[0]["ema"][f"ema_model.{k}"]), k


# -- FSDP2 --------------------------------------------------------------------------------


def shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root (norm's parameters), reshard_after_forward=False


def fsdp_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_net()
    side = make_net()  # the reference: an EMA of the full weights, computed on the side
    side_ema = EMA(side, **EMA_KW)
    side_ema64 = EMA(side, ema_dtype=torch.float64, **EMA_KW)
    early = EMA(model, **EMA_KW)  # built before fully_shard: a full, unsharded copy
    shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ema = EMA(model, **EMA_KW)
    ema64 = EMA(model, ema_dtype=torch.float64, use_foreach=False, **EMA_KW)
    res: dict[str, Any] = {}
    res["sharded"] = all(is_dtensor(p) for p in ema.ema_model.parameters())
    res["placements"] = all(
        s.placements == o.placements and local_tensor(s).shape == local_tensor(o).shape
        for s, o in zip(ema.ema_model.parameters(), model.parameters(), strict=True)
    )
    plans = set()
    for x, y in batches():
        train_step(model, opt, rank_batch(x, rank), rank_batch(y, rank))
        ema.update()
        ema64.update()
        plans.add(id(ema.tracker.plan()))
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        side.load_state_dict(full)
        side_ema.update()
        side_ema64.update()
    res["plans_built"] = len(plans)  # the plan survives FSDP's forward/backward
    res["side_ema"] = cpu_state(side_ema.ema_model)
    res["side_ema64"] = cpu_state(side_ema64.ema_model)
    res["ema64_full"] = {n: p.full_tensor() for n, p in ema64.ema_model.named_parameters()}
    res["ema_full"] = {n: p.full_tensor().clone() for n, p in ema.ema_model.named_parameters()}
    res["local_numel"] = sum(local_tensor(p).numel() for p in ema.ema_model.parameters())
    res["total_numel"] = sum(p.numel() for p in ema.ema_model.parameters())
    res["step"] = int(ema.step)
    res["refused"] = []
    for make in (lambda: EMA(model, ema_model=make_net(), **EMA_KW), early.update):
        try:
            make()
            res["refused"].append("")
        except EMAStateError as e:
            res["refused"].append(str(e))

    # Evaluation: the EMA model's own sharded forward, and swap() on the sharded model.
    # The root keeps its gathered weights after a no-grad forward (reshard_after_forward
    # is False for it); swap() must not run on those stale ones.
    x = batches()[0][0]
    with torch.no_grad():
        before = model(x)
        res["ema_forward"] = ema(x)
        with ema.swap():
            res["swap_forward"] = model(x)
        res["after_swap"] = model(x)
        with swap_in_place(ema):
            res["inplace_forward"] = model(x)
    res["before_swap"] = before
    res["side_forward"] = side_ema(x)

    # update() runs no collective: one rank alone updates, then both meet at a barrier
    # (a collective inside would deadlock until the job's deadline).
    lone = EMA(model, **EMA_KW)
    if rank == 0:
        for _ in range(3):
            lone.update()
    dist.barrier()

    # DCP: save, disturb, load back; the step comes back too.
    ckpt = out / "dcp"
    save_sharded_ema(ema, ckpt)
    saved = {n: local_tensor(p).clone() for n, p in ema.ema_model.named_parameters()}
    for x, y in batches()[:2]:
        train_step(model, opt, rank_batch(x, rank), rank_batch(y, rank))
        ema.update()
    load_sharded_ema(ema, ckpt)
    res["dcp_roundtrip"] = all(
        torch.equal(local_tensor(p), saved[n]) for n, p in ema.ema_model.named_parameters()
    )
    res["dcp_step"] = int(ema.step)
    res["dcp_dir"] = str(ckpt)

    # The full EMA weights, gathered to rank 0 and written once.
    res["file"] = str(save_full_ema_weights(ema, out / "fsdp-ema.safetensors"))

    # Hare and tortoise on shards: model <- (model + ema) / 2, shard-locally.
    online_full = {n: p.full_tensor() for n, p in model.named_parameters()}
    ema.update_model_with_ema(0.5)
    res["pull_err"] = max(
        (p.full_tensor() - (online_full[n] + res["ema_full"][n]) / 2).abs().max().item()
        for n, p in model.named_parameters()
    )
    return res


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    need_fsdp2()
    return run_job(fsdp_worker, tmp_path_factory.mktemp("fsdp"))


def test_fsdp_ema_is_sharded_like_the_model(fsdp_results: list[dict]) -> None:
    r0, r1 = fsdp_results
    assert r0["sharded"] and r0["placements"] and r1["sharded"] and r1["placements"]
    total = r0["total_numel"]
    assert r0["local_numel"] + r1["local_numel"] == total
    for r in fsdp_results:  # about half each (uneven rows: 3 + 2 of the head)
        assert abs(r["local_numel"] - total / 2) <= 0.1 * total


def test_fsdp_ema_equals_ema_of_full_weights(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        assert r["step"] == STEPS and r["plans_built"] == 1
        for n, v in r["side_ema"].items():
            torch.testing.assert_close(r["ema_full"][n], v, atol=1e-5, rtol=0, msg=n)
        for n, v in r["side_ema64"].items():  # a float64 shadow of float32 shards
            assert r["ema64_full"][n].dtype == torch.float64
            torch.testing.assert_close(r["ema64_full"][n], v, atol=1e-5, rtol=0, msg=n)


def test_fsdp_eval_forwards_use_ema_weights(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        torch.testing.assert_close(r["ema_forward"], r["side_forward"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["swap_forward"], r["side_forward"], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["inplace_forward"], r["side_forward"], atol=1e-5, rtol=0)
        assert torch.equal(r["after_swap"], r["before_swap"])
        assert (r["swap_forward"] - r["before_swap"]).abs().max() > 1e-3


def test_fsdp_dcp_round_trip(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        assert r["dcp_roundtrip"]
        assert r["dcp_step"] == STEPS


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_dcp_loads_into_one_unsharded_process(fsdp_results: list[dict]) -> None:
    # 2 ranks -> 1: DCP reshards the saved shards into the full tensors of a plain EMA.
    assert not dist.is_initialized()
    ema = EMA(Net(), **EMA_KW)
    load_sharded_ema(ema, fsdp_results[0]["dcp_dir"], no_dist=True)
    assert int(ema.step) == STEPS
    for n, v in fsdp_results[0]["side_ema"].items():
        torch.testing.assert_close(ema.ema_model.state_dict()[n], v, atol=1e-5, rtol=0, msg=n)


def test_fsdp_full_export_loads_into_the_model_class(fsdp_results: list[dict]) -> None:
    net = Net()
    tensors = safetensors.torch.load_file(fsdp_results[0]["file"])
    net.load_state_dict(tensors)
    for n, v in fsdp_results[0]["side_ema"].items():
        torch.testing.assert_close(net.state_dict()[n], v, atol=1e-5, rtol=0, msg=n)
    with safetensors.safe_open(fsdp_results[0]["file"], "pt") as f:
        meta = f.metadata()
    assert meta["model_class"] == "Net" and meta["step"] == str(STEPS)


def test_fsdp_update_model_with_ema_is_shard_local(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        assert r["pull_err"] < 1e-6


def test_plain_ema_model_of_a_sharded_model_is_refused(fsdp_results: list[dict]) -> None:
    for r in fsdp_results:
        for message in r["refused"]:  # an unsharded ema_model; an EMA built before sharding
            assert "is a DTensor (sharded) in the model but a plain tensor in the EMA" in message
            assert "build the EMA after fully_shard" in message


def test_helpers_without_distributed() -> None:
    t = torch.zeros(3)
    assert not is_dtensor(t) and local_tensor(t) is t
    assert is_rank_zero()
