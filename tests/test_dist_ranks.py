"""Ranks that must agree (issue 15, items 2-4): ``skip_nonfinite`` under FSDP2, saves that
check every rank is at the same step, settings that differ across ranks (refused on every rank,
nothing written), a partitioned EMA resumed from rank 0's state (issue 30), and the streamed
full export.

Real multi-process jobs on CPU with gloo over loopback (``tests/_launch.py``): 4 ranks
where shard shapes matter (parameters with fewer rows than ranks leave some ranks an
empty shard, or nothing at all), 2 elsewhere. Results are compared bit for bit with an
EMA of the gathered full weights computed in the same job, or with single-process files.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from _launch import DIST_MARKS, need_fsdp2, run_ranks, store_waits, wait_for_rank_zero
from _models import gathered, seeded
from emakit import (
    EMA,
    EMAError,
    EMARuntimeError,
    EMAStateError,
    EMAWriteError,
    MultiEMA,
    PostHocEMA,
)
from emakit.checkpoint import save_ema_weights
from emakit.distributed import (
    load_sharded_ema,
    local_tensor,
    save_full_ema_weights,
    save_sharded_ema,
)

pytestmark = DIST_MARKS

KW = dict(beta=0.9, update_after_step=1, update_every=1)


class Wide(nn.Module):
    """Parameters of 16, 3, 2 and 1 rows: over 4 ranks, rank 3 holds nothing of ``mid``'s
    3 rows, ranks 2-3 nothing of ``out``, ranks 1-3 nothing of ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 3)
        self.out = nn.Linear(3, 2)
        self.gate = nn.Parameter(torch.ones(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x))))) * self.gate


class Tiny(nn.Module):
    """Two rows only: over 4 ranks, ranks 2 and 3 hold no element of it at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def shard_all(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def poke(param: Any, value: float) -> float | None:
    """Write ``value`` into the first element of this rank's shard (None: empty shard)."""
    local = local_tensor(param)
    if local.numel() == 0:
        return None
    with torch.no_grad():
        old = float(local.view(-1)[0])
        local.view(-1)[0] = value
    return old


# -- item 2: skip_nonfinite under FSDP2 ------------------------------------------------------

NAN_AT = {4: (0, "mid.weight"), 6: (1, "inp.bias"), 7: (3, "inp.weight")}  # call: (rank, name)
TINY_NAN_AT = (5, 1)  # call, rank: Tiny's ranks 2-3 hold nothing and must skip all the same
CALLS = 9


def skip_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    model, side = seeded(Wide, 0), seeded(Wide, 0)
    tiny, tiny_side = seeded(Tiny, 1), seeded(Tiny, 1)
    shard_all(model, mesh)
    shard_all(tiny, mesh)
    emas = {
        impl: EMA(model, skip_nonfinite=True, use_foreach=impl, **KW)
        for impl in (False, True, None)
    }
    multi = MultiEMA(
        model, betas=(0.9, 0.99), skip_nonfinite=True, update_after_step=1, update_every=1
    )
    plain = EMA(model, **KW)  # without the guard: the NaN reaches it
    tiny_ema = EMA(tiny, skip_nonfinite=True, **KW)
    side_ema = EMA(side, skip_nonfinite=True, use_foreach=False, **KW)
    tiny_side_ema = EMA(tiny_side, skip_nonfinite=True, use_foreach=False, **KW)
    ddp_like = EMA(seeded(Wide, 2), skip_nonfinite=True, **KW)  # plain tensors: no collective
    opt = torch.optim.SGD([*model.parameters(), *tiny.parameters()], lr=0.05)
    g = torch.Generator().manual_seed(rank)
    reduces = {"guarded": 0, "unguarded": 0, "plain": 0}
    real_all_reduce = torch.distributed.all_reduce
    counting = ["guarded"]

    def counted(*args: Any, **kwargs: Any) -> Any:
        reduces[counting[0]] += 1
        return real_all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counted
    try:
        for call in range(1, CALLS + 1):
            x = torch.randn(4, 8, generator=g)
            model(x).pow(2).mean().backward()
            tiny(x[:, :4]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            restore = None
            if call in NAN_AT and NAN_AT[call][0] == rank:  # one rank's shard only
                name = NAN_AT[call][1]
                restore = (name, poke(model.get_parameter(name), float("nan")))
            tiny_restore = None
            if (call, rank) == TINY_NAN_AT:
                tiny_restore = poke(tiny.lin.weight, float("inf"))
            counting[0] = "guarded"
            for e in emas.values():
                e.update()
            multi.update()
            tiny_ema.update()
            counting[0] = "unguarded"
            plain.update()
            counting[0] = "plain"
            ddp_like.update()
            counting[0] = "guarded"
            side.load_state_dict(full(model))  # a collective: outside the counted calls
            tiny_side.load_state_dict(full(tiny))
            side_ema.update()
            tiny_side_ema.update()
            if restore is not None and restore[1] is not None:
                poke(model.get_parameter(restore[0]), restore[1])
            if tiny_restore is not None:
                poke(tiny.lin.weight, tiny_restore)
    finally:
        torch.distributed.all_reduce = real_all_reduce
    with pytest.warns(RuntimeWarning, match="skipped an EMA update at step 4"):
        skips = {str(k): e.num_skipped_nonfinite for k, e in emas.items()}
    return {
        "skips": skips,
        "multi_skips": [e.num_skipped_nonfinite for e in multi],
        "tiny_skips": tiny_ema.num_skipped_nonfinite,
        "side_skips": side_ema.num_skipped_nonfinite,
        "tiny_side_skips": tiny_side_ema.num_skipped_nonfinite,
        "emas": {str(k): full(e.ema_model) for k, e in emas.items()},
        "multi": [full(e.ema_model) for e in multi],
        "plain_finite": all(bool(t.isfinite().all()) for t in full(plain.ema_model).values()),
        "tiny": full(tiny_ema.ema_model),
        "side": {k: v.clone() for k, v in side_ema.ema_model.state_dict().items()},
        "tiny_side": {k: v.clone() for k, v in tiny_side_ema.ema_model.state_dict().items()},
        "shards": {n: local_tensor(p).numel() for n, p in model.named_parameters()},
        "tiny_shards": sum(local_tensor(p).numel() for p in tiny.parameters()),
        "reduces": reduces,
        "state_skips": emas[None].state_dict()._metadata[""]["num_skipped_nonfinite"],
    }


@pytest.fixture(scope="module")
def skip_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    need_fsdp2()
    return run_ranks(skip_worker, tmp_path_factory.mktemp("skip"), world=4)


def test_skip_nonfinite_shards_are_empty_on_some_ranks(skip_results: list[dict]) -> None:
    """The job really has empty shards: the cases the guard must survive."""
    shards = [r["shards"] for r in skip_results]
    assert [s["mid.weight"] for s in shards] == [16, 16, 16, 0]
    assert [s["out.weight"] for s in shards] == [3, 3, 0, 0]
    assert [s["gate"] for s in shards] == [2, 0, 0, 0]
    assert [r["tiny_shards"] for r in skip_results] == [5, 5, 0, 0]  # ranks 2-3: nothing


def test_skip_nonfinite_every_rank_skips_the_same_calls(skip_results: list[dict]) -> None:
    """A NaN in one rank's shard makes every rank skip, with the same count everywhere;
    the EMA equals, bit for bit, an EMA of the gathered full weights with the guard."""
    for r in skip_results:
        assert r["side_skips"] == len(NAN_AT)
        assert r["skips"] == {"False": 3, "True": 3, "None": 3}
        assert r["multi_skips"] == [3, 3]
        assert r["tiny_skips"] == r["tiny_side_skips"] == 1  # ranks 2-3 hold nothing of it
        assert r["state_skips"] == 3
        for impl, got in r["emas"].items():
            for n, v in r["side"].items():
                assert torch.equal(got[n], v), (impl, n)
        for n, v in r["tiny_side"].items():
            assert torch.equal(r["tiny"][n], v), n
        assert not r["plain_finite"]  # without the guard the NaN got in
    for r in skip_results[1:]:  # MultiEMA members: the same on every rank
        for got, ref in zip(r["multi"], skip_results[0]["multi"], strict=True):
            assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_skip_nonfinite_one_all_reduce_per_update_only_when_sharded(
    skip_results: list[dict],
) -> None:
    """Guarded sharded EMAs: one all-reduce per call each; without the guard, or for plain
    tensors (DDP, one process), none."""
    # 3 EMAs and the tiny one: one per call. MultiEMA: one for both members on averaging
    # calls (3..9), one per member on the first call and the warm-up copy (calls 1-2).
    guarded = 4 * CALLS + 2 * 2 + (CALLS - 2)
    for r in skip_results:
        assert r["reduces"] == {"guarded": guarded, "unguarded": 0, "plain": 0}


# -- item 3: ranks that disagree are detected --------------------------------------------------


def _outcome(fn: Any) -> str | None:
    """None if ``fn()`` returned, else ``"<ExceptionType>: <message>"`` (EMAErrors only)."""
    try:
        fn()
    except (EMAStateError, EMARuntimeError, EMAWriteError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def disagree_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    res: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2,))
    model = seeded(Wide, 0)
    shard_all(model, mesh)
    ema = EMA(model, **KW)
    for _ in range(3):
        ema.update()
    ckpt, weights = out / "ckpt", out / "ema.safetensors"
    save_sharded_ema(ema, ckpt)  # step 3 everywhere: fine
    save_full_ema_weights(ema, weights)
    first = weights.read_bytes()
    if rank == 1:
        ema.update()  # one call more than rank 0
    res["sharded"] = _outcome(lambda: save_sharded_ema(ema, ckpt))
    res["full"] = _outcome(lambda: save_full_ema_weights(ema, weights))
    res["full_unchanged"] = weights.read_bytes() == first
    load_sharded_ema(ema, ckpt)  # the last good checkpoint: step 3 again on every rank
    res["reloaded_step"] = int(ema.step)
    ema.update()
    res["agreed"] = _outcome(lambda: save_sharded_ema(ema, ckpt))
    load_sharded_ema(ema, ckpt)
    res["loaded_step"] = int(ema.step)
    if rank == 1:  # a load that leaves this rank elsewhere (here: by hand) is reported too
        real_load = ema.load_state_dict

        def load_then_drift(*args: Any, **kwargs: Any) -> Any:
            result = real_load(*args, **kwargs)
            ema.tracker.set_counters(step=99)
            return result

        ema.load_state_dict = load_then_drift  # type: ignore[method-assign]
    res["load_drift"] = _outcome(lambda: load_sharded_ema(ema, ckpt))

    # DDP: every rank holds the whole EMA; a rank that updated once more is still caught
    ddp = DistributedDataParallel(seeded(Wide, 0))
    ddp_ema = EMA(ddp, **KW)
    for _ in range(2 + rank):
        ddp_ema.update()
    res["ddp"] = _outcome(lambda: save_sharded_ema(ddp_ema, out / "ddp"))
    # ... and so are different skip counts (a NaN in rank 1's copy of the weights only)
    guarded = EMA(ddp, skip_nonfinite=True, **KW)
    guarded.update()
    if rank == 1:
        with torch.no_grad():
            ddp.module.inp.weight[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning) if rank == 1 else contextlib.nullcontext():
        guarded.update()
        res["skips"] = _outcome(lambda: save_full_ema_weights(guarded, out / "guarded.st"))
    res["ddp_files"] = sorted(p.name for p in out.iterdir() if p.name.startswith(("ddp", "gu")))
    return res


@pytest.fixture(scope="module")
def disagree_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    need_fsdp2()
    return run_ranks(disagree_worker, tmp_path_factory.mktemp("disagree"), world=2)


def test_saves_refuse_ranks_at_different_steps(disagree_results: list[dict]) -> None:
    """Rank 1 called update() once more: both saves raise on every rank, naming the ranks
    and their steps, and write nothing; the previous checkpoint and file stay current."""
    for r in disagree_results:
        for what in ("sharded", "full"):
            message = r[what]
            assert message is not None and message.startswith("EMAStateError"), message
            assert "(step 3 on rank 0, step 4 on rank 1; nothing was written)" in message, message
            assert "update()" in message
        assert "save_sharded_ema" in r["sharded"] and "save_full_ema_weights" in r["full"]
        assert r["full_unchanged"]
        assert r["reloaded_step"] == 3  # the refused save did not replace the checkpoint
        assert r["agreed"] is None and r["loaded_step"] == 4
        assert r["load_drift"].startswith("EMAStateError: load_sharded_ema (after loading)")
        assert "(step 4 on rank 0, step 99 on rank 1; it loaded)" in r["load_drift"]


def test_ddp_saves_refuse_diverged_steps_and_skip_counts(disagree_results: list[dict]) -> None:
    for r in disagree_results:
        assert "step 2 on rank 0, step 3 on rank 1" in r["ddp"], r["ddp"]
        skips = "num_skipped_nonfinite 0 on rank 0, num_skipped_nonfinite 1 on rank 1"
        assert skips in r["skips"], r["skips"]
        assert r["ddp_files"] == []  # nothing was written


# -- settings that differ across ranks; a partitioned EMA resumed from rank 0's state ------------
#
# Issue 30, on 4 ranks in one launch. Each case builds its EMAs so that one rank differs, calls a
# collective, and records what every rank raised and whether anything was written. Before the
# fix, ``ema_dtype=float64`` on one rank aborted rank 0 inside gloo's gather (SIGABRT), a
# different ``beta`` or ``update_every`` was written as one mixed EMA, different ``sigma_rels``
# wrote snapshots, and a ``partition=True`` EMA resumed from rank 0's ``client_state`` loaded on
# rank 0 while the other ranks raised (the job then hung in the next collective).


SETTINGS_WORLD = 4


SETTINGS_KW: dict[str, Any] = dict(beta=0.9, update_after_step=0, update_every=1)


def layernorm_net() -> nn.Module:
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
    """Run a collective; what it raised (type and message)."""
    try:
        fn()
    except EMAError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


def settings_cases(rank: int, out: Path) -> dict[str, Any]:
    r: dict[str, Any] = {}
    odd = rank == SETTINGS_WORLD - 1
    variants = {
        "ema_dtype": dict(SETTINGS_KW, ema_dtype=torch.float64 if odd else None),
        "beta": dict(SETTINGS_KW, beta=0.99 if odd else 0.9),
        "update_every": dict(SETTINGS_KW, update_every=2 if rank == 1 else 1),
        "skip_nonfinite": dict(SETTINGS_KW, skip_nonfinite=odd),
    }
    for name, kw in variants.items():
        model = layernorm_net()
        ema = trained(EMA(model, **kw), model, steps=2)  # the same step on every rank
        path = out / f"full-{name}.safetensors"
        r[f"full/{name}"] = attempt(lambda e=ema, p=path: save_full_ema_weights(e, p))
        r[f"full/{name}"]["written"] = path.exists()
        folder = out / f"sharded-{name}"
        r[f"sharded/{name}"] = attempt(lambda e=ema, f=folder: save_sharded_ema(e, f))
        r[f"sharded/{name}"]["written"] = folder.exists() and any(folder.rglob(".metadata"))
    # a load, and an export of a partitioned EMA (a collective of any EMA kind)
    model = layernorm_net()
    good = trained(EMA(model, **SETTINGS_KW), model)
    save_sharded_ema(good, out / "good")
    odd_ema = EMA(layernorm_net(), **SETTINGS_KW, ema_dtype=torch.float64 if odd else None)
    before = {k: v.clone() for k, v in odd_ema.ema_model.state_dict().items()}
    r["load/ema_dtype"] = attempt(lambda: load_sharded_ema(odd_ema, out / "good"))
    r["load/ema_dtype"]["unchanged"] = all(
        torch.equal(v, odd_ema.ema_model.state_dict()[k]) for k, v in before.items()
    )
    model = layernorm_net()
    parted = trained(
        EMA(model, **SETTINGS_KW, partition=True, ema_dtype=torch.float64 if odd else None), model
    )
    path = out / "parted-odd.safetensors"
    r["parted/ema_dtype"] = attempt(lambda: save_ema_weights(parted, path))
    r["parted/ema_dtype"]["written"] = path.exists()
    # post-hoc profiles: different sigma_rels on one rank; nothing is written
    model = layernorm_net()
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
    r["usable"] = float(t) == SETTINGS_WORLD
    return r


def partition_cases(rank: int, out: Path) -> dict[str, Any]:
    r: dict[str, Any] = {}
    model = layernorm_net()
    parted = trained(EMA(model, **SETTINGS_KW, partition=True), model)
    reference = layernorm_net()
    plain = trained(EMA(reference, **SETTINGS_KW), reference)
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
    fresh = EMA(layernorm_net(), **SETTINGS_KW, partition=True)
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


def settings_worker(rank: int, out: Path) -> dict[str, Any]:
    return {"settings": settings_cases(rank, out), "partition": partition_cases(rank, out)}


@pytest.fixture(scope="module")
def settings_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("settings")
    return run_ranks(settings_worker, out, world=SETTINGS_WORLD, timeout_s=240)


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
def test_settings_that_differ_across_ranks_are_refused_on_every_rank(settings_results, case, named):
    """Every rank raises the same EMAStateError naming the setting, its values and the
    ranks, and nothing is written."""
    messages = set()
    for r in settings_results:
        got = r["settings"][case]
        assert got["error"] == "EMAStateError", (case, got)
        assert "nothing was written" in got["message"]
        for text in named:
            assert text in got["message"], (text, got["message"])
        assert not got["written"]
        messages.add(got["message"])
    assert len(messages) == 1  # the same message on every rank


def test_a_load_into_ranks_with_other_settings_is_refused_before_loading(settings_results):
    for r in settings_results:
        got = r["settings"]["load/ema_dtype"]
        assert got["error"] == "EMAStateError" and "nothing was loaded" in got["message"]
        assert "'torch.float64' on rank 3" in got["message"] and got["unchanged"]


def test_different_sigma_rels_on_one_rank_write_no_snapshot(settings_results):
    for r in settings_results:
        got = r["settings"]["posthoc/sigma_rels"]
        assert got["error"] == "EMAStateError", got
        assert "profiles (sigma_rels or gammas)" in got["message"]
        assert "sigma_rel=0.2," in got["message"] and "rank 3" in got["message"]
        assert got["written"] == []
    assert all(r["settings"]["usable"] for r in settings_results)


def test_a_partitioned_ema_resumed_from_rank_0s_state_raises_on_every_rank(settings_results):
    """Item 13: every rank takes the same path. Rank 0 (whose own state it is) raises too,
    naming the ranks that refused; the others raise their own reason; no rank loaded; each
    rank's own state then loads on every rank."""
    first = settings_results[0]["partition"]["rank0_state"]
    assert first["error"] == "EMAStateError"
    assert "'refused (EMAStateError)' on ranks 1, 2, 3" in first["message"]
    for rank, r in enumerate(settings_results):
        got = r["partition"]["rank0_state"]
        assert got["error"] == "EMAStateError" and got["unchanged"], got
        if rank:
            assert f"rank 0's EMA partitions, and this is rank {rank}" in got["message"]
        assert r["partition"]["own_state"] == {**r["partition"]["own_state"], "error": None}
        assert r["partition"]["own_state"]["loaded"]


def test_save_ema_weights_of_a_partitioned_ema_writes_the_models_shapes(settings_results):
    """Item 11 on 4 ranks (each holding a quarter of every weight): the file holds the
    model's own shapes, equal to a plain EMA's weights."""
    first = settings_results[0]["partition"]
    assert {k: tuple(v.shape) for k, v in first["file"].items()} == {
        k: tuple(v.shape) for k, v in first["plain"].items()
    }
    for k, v in first["plain"].items():
        assert torch.equal(first["file"][k], v), k


# -- item 4: the collective export called from rank 0 only ----------------------------------


def misuse_worker(rank: int, out: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    res: dict[str, Any] = {}
    ema = EMA(DistributedDataParallel(seeded(Wide, 0)), **KW)
    ema.update()
    # rank 0 exports while rank 1 saves: both meet in the agreement and both raise
    if rank == 0:
        res["mixed"] = _outcome(lambda: save_full_ema_weights(ema, out / "a.safetensors"))
    else:
        res["mixed"] = _outcome(lambda: save_sharded_ema(ema, out / "ckpt"))
    # ... and a load on rank 0 while rank 1 exports
    if rank == 0:
        res["mixed_load"] = _outcome(lambda: load_sharded_ema(ema, out / "ckpt"))
    else:
        res["mixed_load"] = _outcome(lambda: save_full_ema_weights(ema, out / "c.safetensors"))
    # the recipe's old mistake: `if is_rank_zero(): save_full_ema_weights(...)`; rank 1 goes
    # on with something else until rank 0's export has returned
    if rank == 0:
        with store_waits() as waits:
            res["alone"] = _outcome(
                lambda: save_full_ema_weights(ema, out / "b.safetensors", timeout_s=2)
            )
        res["waits"] = waits
    wait_for_rank_zero("alone")
    res["files"] = sorted(p.name for p in out.iterdir() if "safetensors" in p.name)
    return res


def test_export_from_rank_zero_only_raises_instead_of_hanging(tmp_path: Path) -> None:
    r0, r1 = run_ranks(misuse_worker, tmp_path, world=2, barrier=False)
    for r in (r0, r1):
        assert r["mixed"].startswith("EMARuntimeError"), r["mixed"]
        assert "rank 0 in save_full_ema_weights; rank 1 in save_sharded_ema" in r["mixed"]
        assert "rank 0 in load_sharded_ema; rank 1 in save_full_ema_weights" in r["mixed_load"]
    assert r0["alone"].startswith("EMARuntimeError"), r0["alone"]
    assert "save_full_ema_weights is a collective: call on every rank" in r0["alone"]
    assert "rank 1 did not arrive" in r0["alone"], r0["alone"]
    assert "if is_rank_zero():" in r0["alone"] and "timeout_s=2 s" in r0["alone"]
    # it waited for rank 1 once, for its whole timeout_s and no longer, then gave up
    assert r0["waits"] == [(2.0, False)]
    assert r0["files"] == [] and r1["files"] == []


# -- item 4: the full export streams ---------------------------------------------------------

WIDTHS = (8, 32, 16, 24, 8, 12, 6, 10, 16, 5, 3)


class Deep(nn.Module):
    """26 tensors: 10 Linear layers (a 3-row head: rank 3 of 4 holds none of it), a
    BatchNorm (its running statistics are plain, unsharded buffers, one of them int64),
    and a 1-row parameter."""

    def __init__(self) -> None:
        super().__init__()
        pairs = itertools.pairwise(WIDTHS)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairs)
        self.norm = nn.BatchNorm1d(WIDTHS[1])
        self.scale = nn.Parameter(torch.ones(1, WIDTHS[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = self.norm(x) if i == 0 else torch.tanh(x)
        return x * self.scale


def export_worker(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import emakit._files.export as export

    mesh = init_device_mesh("cpu", (4,))
    model = seeded(Deep, 0)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ema = EMA(model, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        model(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()

    # Watch the gathers: what dtype the shards have when gathered, and whether the
    # previous full tensor is still alive when the next one is gathered.
    gathers: list[tuple[torch.dtype, int]] = []
    alive = [0]
    last: list[Any] = [None]
    real_full, real_rows = export.tensor_for_writer, export._gather_rows

    def full_spy(t: torch.Tensor, dtype: Any) -> torch.Tensor:
        if last[0] is not None and last[0]() is not None:
            alive[0] += 1
        result = real_full(t, dtype)
        if result is not None and result is not t:  # gathered (a buffer is written as it is)
            last[0] = weakref.ref(result)
        return result

    def rows_spy(local: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        gathers.append((local.dtype, local.numel()))  # what goes over the wire
        return real_rows(local, *args, **kwargs)

    # Count the bytes each rank receives in the collectives of the export.
    received = {"data": 0, "control": 0}
    real_gather, real_all_gather = torch.distributed.gather, torch.distributed.all_gather
    real_bcast = torch.distributed.broadcast_object_list

    def gather_spy(tensor: torch.Tensor, gather_list: Any = None, *args: Any, **kw: Any) -> Any:
        if gather_list is not None:  # the destination receives every other rank's shard
            received["data"] += tensor.nbytes * (len(gather_list) - 1)
        return real_gather(tensor, gather_list, *args, **kw)

    real_irecv = torch.distributed.irecv

    def irecv_spy(tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        received["data"] += tensor.nbytes  # gloo: the writer receives each rank's rows
        return real_irecv(tensor, *args, **kw)

    def all_gather_spy(tensors: list, tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        received["control"] += tensor.nbytes * (len(tensors) - 1)
        return real_all_gather(tensors, tensor, *args, **kw)

    def bcast_spy(objects: list, *args: Any, **kw: Any) -> Any:
        received["control"] += len(repr(objects))  # a few bytes of pickled outcome
        return real_bcast(objects, *args, **kw)

    torch.distributed.gather, torch.distributed.all_gather = gather_spy, all_gather_spy
    torch.distributed.broadcast_object_list, torch.distributed.irecv = bcast_spy, irecv_spy
    export.tensor_for_writer, export._gather_rows = full_spy, rows_spy
    try:
        f32 = save_full_ema_weights(ema, out / "ema.safetensors")
        gathers_f32 = list(gathers)
        gathers.clear()
        bf16 = save_full_ema_weights(ema, out / "ema-bf16.safetensors", dtype=torch.bfloat16)
    finally:
        export.tensor_for_writer, export._gather_rows = real_full, real_rows
        torch.distributed.gather, torch.distributed.all_gather = real_gather, real_all_gather
        torch.distributed.broadcast_object_list, torch.distributed.irecv = real_bcast, real_irecv
    res: dict[str, Any] = {
        "paths": (str(f32), str(bf16)),
        "gathers_f32": gathers_f32,
        "gathers_bf16": list(gathers),
        "alive": alive[0],
        "received": dict(received),
        "shard_bytes": sum(local_tensor(t).nbytes for t in ema.ema_model.state_dict().values()),
        "full": gathered(ema.ema_model),
        "step": int(ema.step),
        "empty_shards": sum(local_tensor(p).numel() == 0 for p in ema.ema_model.parameters()),
    }
    if rank == 0:  # what save_ema_weights writes for an unsharded EMA holding these values
        ref = EMA(seeded(Deep, 0), **KW)
        ref.ema_model.load_state_dict(res["full"])
        ref.step.fill_(res["step"])
        ref.initted.fill_(True)
        res["reference"] = save_ema_weights(ref, out / "reference.safetensors").read_bytes()
        res["reference_bf16"] = save_ema_weights(
            ref, out / "reference-bf16.safetensors", dtype=torch.bfloat16
        ).read_bytes()

    # Every placement gathers to the full tensor: FSDP's rows over a 1-D mesh through one
    # buffer, the rest through DTensor.full_tensor()
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    square = init_device_mesh("cpu", (2, 2))
    source = torch.randn(5, 6, generator=torch.Generator().manual_seed(9))
    rows_path = [0]
    real_rows = export._gather_rows

    def counted_rows(*args: Any, **kwargs: Any) -> torch.Tensor:
        rows_path[0] += 1
        return real_rows(*args, **kwargs)

    export._gather_rows = counted_rows
    placed = {
        "rows": (mesh, [Shard(0)]),
        "columns": (mesh, [Shard(1)]),
        "replicated": (mesh, [Replicate()]),
        "hsdp": (square, [Replicate(), Shard(0)]),
    }
    res["placements"] = {
        name: bool(
            torch.equal(
                export.full_tensor(distribute_tensor(source, m, p), torch.bfloat16),
                source.to(torch.bfloat16),
            )
        )
        for name, (m, p) in placed.items()
    }
    res["rows_path"] = rows_path[0]
    # to the writer only: FSDP's and HSDP's rows are gathered to rank 0 (None elsewhere)
    res["to_writer"] = {
        name: (lambda got: None if got is None else bool(torch.equal(got, source)))(
            export.tensor_for_writer(distribute_tensor(source, m, p), None)
        )
        for name, (m, p) in placed.items()
    }
    res["rows_path_writer"] = rows_path[0] - res["rows_path"]
    export._gather_rows = real_rows

    # one verb for every EMA: save_ema_weights of a sharded EMA is this collective, and
    # its older name meets it (ranks 0 and 2 call one, ranks 1 and 3 the other)
    before = (out / "ema.safetensors").read_bytes()
    save = save_ema_weights if rank % 2 == 0 else save_full_ema_weights
    res["verb"] = save(ema, out / "verb.safetensors").read_bytes() == before

    # rank 0's disk fills up in the middle: every rank raises, no rank hangs, the previous
    # file stays whole and no temporary file is left
    if rank == 0:
        writes = [0]
        real_write = export.write_tensor

        def full_disk(f: Any, t: torch.Tensor, dtype: Any) -> None:
            writes[0] += 1
            if writes[0] == 3:
                raise OSError(28, "No space left on device")
            real_write(f, t, dtype)

        export.write_tensor = full_disk
    res["disk_full"] = _outcome(lambda: save_full_ema_weights(ema, out / "ema.safetensors"))
    res["kept"] = (out / "ema.safetensors").read_bytes() == before
    res["listing"] = sorted(p.name for p in out.iterdir())
    return res


@pytest.fixture(scope="module")
def export_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    need_fsdp2()
    return run_ranks(export_worker, tmp_path_factory.mktemp("export"), world=4)


def test_full_export_streams_one_tensor_at_a_time(export_results: list[dict]) -> None:
    for r in export_results:
        sharded = [n for _, n in r["gathers_f32"]]
        assert len(sharded) == 23 and len(r["full"]) == 26  # buffers are not gathered
        assert r["alive"] == 0  # each full tensor was dropped before the next gather
        # cast before gathering: the bf16 export moves bf16 shards
        assert {d for d, _ in r["gathers_bf16"]} == {torch.bfloat16}
        assert {d for d, _ in r["gathers_f32"]} == {torch.float32}
    # rank 3 holds nothing of the 6-, 5- and 3-row layers (weights, biases) nor of `scale`
    assert [r["empty_shards"] for r in export_results] == [0, 1, 1, 7]


def test_full_export_sends_the_tensors_to_the_writer_only(export_results: list[dict]) -> None:
    # gathered to rank 0, not all-gathered: the other ranks receive no tensor data at all,
    # only the agreement rows (7 int64 per rank) and rank 0's outcome (two exports)
    r0 = export_results[0]
    assert r0["received"]["data"] > 0
    for r in export_results[1:]:
        assert r["received"]["data"] == 0, r["received"]
        assert r["received"]["control"] <= 2 * (3 * 7 * 8 + 64), r["received"]


def test_full_export_is_save_ema_weights_byte_for_byte(export_results: list[dict]) -> None:
    assert all(r["verb"] for r in export_results)  # save_ema_weights of the sharded EMA
    r0 = export_results[0]
    f32, bf16 = (Path(p) for p in r0["paths"])
    assert f32.read_bytes() == r0["reference"]
    assert bf16.read_bytes() == r0["reference_bf16"]
    net = Deep()
    net.load_state_dict(safetensors.torch.load_file(f32))  # straight into the model class
    for n, v in net.state_dict().items():
        assert torch.equal(v, r0["full"][n]), n
    half = safetensors.torch.load_file(bf16)
    for n, v in r0["full"].items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert half[n].dtype == want.dtype and torch.equal(half[n], want), n


def test_full_export_gathers_every_placement(export_results: list[dict]) -> None:
    for r in export_results:
        assert r["placements"] == dict.fromkeys(("rows", "columns", "replicated", "hsdp"), True)
        assert r["rows_path"] == 1  # only FSDP's rows over a 1-D mesh take the one-buffer path
    # gathered to rank 0 alone: rows (FSDP) and HSDP's rows; the rest all-gathered
    assert export_results[0]["to_writer"] == dict.fromkeys(placed_names(), True)
    for r in export_results[1:]:
        want = {"rows": None, "columns": True, "replicated": True, "hsdp": None}
        assert r["to_writer"] == want, r["to_writer"]
    # HSDP: rank 1 sends its rows to rank 0 (same replica); ranks 2-3 (the other) take no part
    assert [r["rows_path_writer"] for r in export_results] == [2, 2, 1, 1]


def placed_names() -> tuple[str, ...]:
    return ("rows", "columns", "replicated", "hsdp")


def test_full_export_failure_on_rank_zero_raises_everywhere(export_results: list[dict]) -> None:
    for rank, r in enumerate(export_results):
        assert r["disk_full"] is not None and r["disk_full"].startswith("EMAWriteError"), r
        assert "No space left on device" in r["disk_full"]
        if rank:
            assert "rank 0 could not write" in r["disk_full"]
        assert r["kept"]
        assert not [n for n in r["listing"] if "emakit-tmp" in n], r["listing"]
