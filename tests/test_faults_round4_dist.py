"""Faults of round 4 (issue 30) on 4 gloo ranks, in one launch: settings that differ
across ranks (a config read differently on one node), a partitioned EMA resumed from
another rank's state, and the full export of a partitioned EMA.

Each case builds its EMAs so that one rank differs, calls a collective, and records what
every rank raised and whether anything was written. Before the fix, ``ema_dtype=float64``
on one rank aborted rank 0 inside gloo's gather (SIGABRT), a different ``beta`` or
``update_every`` was written as one mixed EMA, different ``sigma_rels`` wrote snapshots,
and a ``partition=True`` EMA resumed from rank 0's ``client_state`` loaded on rank 0 while
the other ranks raised (the job then hung in the next collective).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from _launch import DIST_MARKS, run_ranks
from emakit import EMA, EMAError, PostHocEMA
from emakit.checkpoint import save_ema_weights
from emakit.distributed import load_sharded_ema, save_full_ema_weights, save_sharded_ema

pytestmark = DIST_MARKS

WORLD = 4
KW: dict[str, Any] = dict(beta=0.9, update_after_step=0, update_every=1)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def trained(ema: Any, model: nn.Module, steps: int = 3) -> Any:
    for k in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (k + 1))
        ema.update()
    return ema


def attempt(fn: Any) -> dict[str, Any]:
    """Run a collective; what it raised (type and message), and how long it took."""
    start = time.monotonic()
    try:
        fn()
    except EMAError as e:
        return {"error": type(e).__name__, "message": str(e), "s": time.monotonic() - start}
    return {"error": None, "message": "", "s": time.monotonic() - start}


def settings_cases(rank: int, out: Path) -> dict[str, Any]:
    r: dict[str, Any] = {}
    odd = rank == WORLD - 1
    variants = {
        "ema_dtype": dict(KW, ema_dtype=torch.float64 if odd else None),
        "beta": dict(KW, beta=0.99 if odd else 0.9),
        "update_every": dict(KW, update_every=2 if rank == 1 else 1),
        "skip_nonfinite": dict(KW, skip_nonfinite=odd),
    }
    for name, kw in variants.items():
        model = net()
        ema = trained(EMA(model, **kw), model, steps=2)  # the same step on every rank
        path = out / f"full-{name}.safetensors"
        r[f"full/{name}"] = attempt(lambda e=ema, p=path: save_full_ema_weights(e, p))
        r[f"full/{name}"]["written"] = path.exists()
        folder = out / f"sharded-{name}"
        r[f"sharded/{name}"] = attempt(lambda e=ema, f=folder: save_sharded_ema(e, f))
        r[f"sharded/{name}"]["written"] = folder.exists() and any(folder.rglob(".metadata"))
    # a load, and an export of a partitioned EMA (a collective of any EMA kind)
    model = net()
    good = trained(EMA(model, **KW), model)
    save_sharded_ema(good, out / "good")
    odd_ema = EMA(net(), **KW, ema_dtype=torch.float64 if odd else None)
    before = {k: v.clone() for k, v in odd_ema.ema_model.state_dict().items()}
    r["load/ema_dtype"] = attempt(lambda: load_sharded_ema(odd_ema, out / "good"))
    r["load/ema_dtype"]["unchanged"] = all(
        torch.equal(v, odd_ema.ema_model.state_dict()[k]) for k, v in before.items()
    )
    model = net()
    parted = trained(
        EMA(model, **KW, partition=True, ema_dtype=torch.float64 if odd else None), model
    )
    path = out / "parted-odd.safetensors"
    r["parted/ema_dtype"] = attempt(lambda: save_ema_weights(parted, path))
    r["parted/ema_dtype"]["written"] = path.exists()
    # post-hoc profiles: different sigma_rels on one rank; nothing is written
    model = net()
    sigma_rels = (0.05, 0.2) if odd else (0.05, 0.28)
    posthoc = PostHocEMA(
        model,
        sigma_rels=sigma_rels,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=out / "posthoc",
        partition=True,
        update_every=1,
    )
    trained(posthoc, model, steps=2)
    r["posthoc/sigma_rels"] = attempt(posthoc.checkpoint)
    r["posthoc/sigma_rels"]["written"] = sorted(
        p.name for p in (out / "posthoc").glob("*") if p.suffix == ".safetensors"
    )
    # the process group is still usable after every refusal
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    r["usable"] = float(t) == WORLD
    return r


def partition_cases(rank: int, out: Path) -> dict[str, Any]:
    r: dict[str, Any] = {}
    model = net()
    parted = trained(EMA(model, **KW, partition=True), model)
    reference = net()
    plain = trained(EMA(reference, **KW), reference)
    # item 11: save_ema_weights of a partitioned EMA writes the model's shapes, on 4 ranks
    path = save_ema_weights(parted, out / "parted.safetensors")
    if rank == 0:
        r["file"] = safetensors.torch.load_file(path)
        r["plain"] = {k: v.clone() for k, v in plain.ema_model.state_dict().items()}
    # item 13: DeepSpeed's save_checkpoint under ZeRO-1/2 keeps rank 0's client_state only:
    # every rank then loads rank 0's state of a partitioned EMA
    own = parted.state_dict()  # a collective of every rank
    box = [own if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    fresh = EMA(net(), **KW, partition=True)
    before = [p.clone() for p in fresh.ema_model.parameters()]
    r["rank0_state"] = attempt(lambda: fresh.load_state_dict(box[0]))
    r["rank0_state"]["unchanged"] = (
        all(torch.equal(a, b) for a, b in zip(before, fresh.ema_model.parameters(), strict=True))
        and int(fresh.step) == 0
    )
    r["own_state"] = attempt(lambda: fresh.load_state_dict(own))
    r["own_state"]["loaded"] = int(fresh.step) == 3 and all(
        torch.equal(a, b)
        for a, b in zip(fresh.ema_model.parameters(), parted.ema_model.parameters(), strict=True)
    )
    return r


def worker(rank: int, out: Path) -> dict[str, Any]:
    return {"settings": settings_cases(rank, out), "partition": partition_cases(rank, out)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("round4")
    return run_ranks(worker, out, world=WORLD, timeout_s=240)


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("full/ema_dtype", ["ema_dtype", "'torch.float64' on rank 3", "ranks 0, 1, 2"]),
        ("sharded/ema_dtype", ["ema_dtype", "'torch.float64' on rank 3"]),
        ("full/beta", ["decay (beta", "beta=0.99", "rank 3"]),
        ("sharded/beta", ["beta=0.99", "rank 3"]),
        ("full/update_every", ["update_every: '1' on ranks 0, 2, 3; '2' on rank 1"]),
        ("sharded/update_every", ["update_every", "'2' on rank 1"]),
        ("full/skip_nonfinite", ["skip_nonfinite: 'False' on ranks 0, 1, 2; 'True' on rank 3"]),
        ("sharded/skip_nonfinite", ["skip_nonfinite", "rank 3"]),
        ("parted/ema_dtype", ["ema_dtype", "rank 3", "dtypes"]),
    ],
)
def test_settings_that_differ_across_ranks_are_refused_on_every_rank(results, case, named):
    """Every rank raises the same EMAStateError naming the setting, its values and the
    ranks, and nothing is written."""
    messages = set()
    for r in results:
        got = r["settings"][case]
        assert got["error"] == "EMAStateError", (case, got)
        assert "nothing was written" in got["message"]
        for text in named:
            assert text in got["message"], (text, got["message"])
        assert not got["written"]
        messages.add(got["message"])
    assert len(messages) == 1  # the same message on every rank


def test_a_load_into_ranks_with_other_settings_is_refused_before_loading(results):
    for r in results:
        got = r["settings"]["load/ema_dtype"]
        assert got["error"] == "EMAStateError" and "nothing was loaded" in got["message"]
        assert "'torch.float64' on rank 3" in got["message"] and got["unchanged"]


def test_different_sigma_rels_on_one_rank_write_no_snapshot(results):
    for r in results:
        got = r["settings"]["posthoc/sigma_rels"]
        assert got["error"] == "EMAStateError", got
        assert "profiles (sigma_rels or gammas)" in got["message"]
        assert "sigma_rel=0.2," in got["message"] and "rank 3" in got["message"]
        assert got["written"] == []
    assert all(r["settings"]["usable"] for r in results)


def test_a_partitioned_ema_resumed_from_rank_0s_state_raises_on_every_rank(results):
    """Item 13: every rank takes the same path. Rank 0 (whose own state it is) raises too,
    naming the ranks that refused; the others raise their own reason; no rank loaded; each
    rank's own state then loads on every rank."""
    first = results[0]["partition"]["rank0_state"]
    assert first["error"] == "EMAStateError"
    assert "'refused (EMAStateError)' on ranks 1, 2, 3" in first["message"]
    for rank, r in enumerate(results):
        got = r["partition"]["rank0_state"]
        assert got["error"] == "EMAStateError" and got["unchanged"], got
        if rank:
            assert f"rank 0's EMA partitions, and this is rank {rank}" in got["message"]
        assert r["partition"]["own_state"] == {**r["partition"]["own_state"], "error": None}
        assert r["partition"]["own_state"]["loaded"]


def test_save_ema_weights_of_a_partitioned_ema_writes_the_models_shapes(results):
    """Item 11 on 4 ranks (each holding a quarter of every weight): the file holds the
    model's own shapes, equal to a plain EMA's weights."""
    first = results[0]["partition"]
    assert {k: tuple(v.shape) for k, v in first["file"].items()} == {
        k: tuple(v.shape) for k, v in first["plain"].items()
    }
    for k, v in first["plain"].items():
        assert torch.equal(first["file"][k], v), k
