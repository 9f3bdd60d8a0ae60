"""Post-hoc EMA of sharded models (issue 23): snapshots written by every rank, synthesis on
the same ranks, in one process and on another number of ranks, all compared with a
single-process ``PostHocEMA`` fed the full weights; a rank killed mid-snapshot.

Two launches (``tests/_launch.py``): 4 gloo ranks (FSDP2 with empty shards, HSDP, FSDP with
tensor parallelism, the rank-0-only misuse last), then 2 ranks (the 4-rank folder
resharded, also from ``partition=True``'s flat ranges, a full disk on one rank, a failed
rewrite of a step, a SIGKILL during a snapshot).
"""

from __future__ import annotations

import hashlib
import os
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks, store_waits, wait_for_rank_zero
from _models import gathered, seeded, train
from emakit import PostHocEMA
from emakit.posthoc import PostHocWarning, list_snapshots, synthesize_state_dict, to_ema_pytorch

pytestmark = [*DIST_MARKS, FSDP2_MARK]

SIGMAS = (0.05, 0.28)
TARGET = 0.15
RUN = "shardrun"
#: float32 snapshots: the sharded and the full-weight runs agree to float32 rounding.
KW = dict(sigma_rels=SIGMAS, update_every=1, checkpoint_dtype=torch.float32)
TOL = dict(rtol=1e-5, atol=1e-6)


class Wide(nn.Module):
    """Rows 16, 3, 2 and 1: over 4 ranks rank 3 holds nothing of ``mid``, ranks 2-3
    nothing of ``out``, ranks 1-3 nothing of ``gate``; ``count`` is a buffer (copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 3)
        self.out = nn.Linear(3, 2)
        self.gate = nn.Parameter(torch.ones(1, 2))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x))))) * self.gate


def shard_all(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def twin_of(model: nn.Module, twin: nn.Module) -> Callable[[int], None]:
    """`train()`'s ``then``: after each step ``twin`` receives ``model``'s full weights (a
    collective), so that a reference PostHocEMA of ``twin`` averages them."""
    return lambda i: twin.load_state_dict(gathered(model))


def fsdp_part(rank: int, out: Path, mesh: Any, res: dict) -> None:
    model = shard_all(seeded(Wide, 0), mesh)
    twin = seeded(Wide, 0)
    ema = PostHocEMA(
        model, checkpoint_every_num_steps=4, checkpoint_folder=out / "fsdp", run_id=RUN, **KW
    )
    ref = PostHocEMA(twin, checkpoint_every_num_steps=4, checkpoint_folder=out / "ref", **KW)
    # partition=True (ZeRO-3's flat ranges) on 4 ranks: ranks 2-3 hold nothing of gate
    parted = PostHocEMA(
        twin, checkpoint_every_num_steps=4, checkpoint_folder=out / "parted", partition=True, **KW
    )
    train(model, [ema, ref, parted], 12, batch=(4, 8), seed=100 + rank, then=twin_of(model, twin))
    res["files"] = sorted(
        p.name for p in (out / "fsdp").iterdir() if "rank-0000" + str(rank) in p.name
    )
    synth = ema.synthesize_ema_model(sigma_rel=TARGET)
    res["on_ranks"] = gathered(synth.ema_model)
    res["synth_step"] = int(synth.step)
    res["profiles"] = [gathered(p.ema_model) for p in ema.profiles]  # KarrasEMA on FSDP2
    res["local_bytes"] = sum(
        p.stat().st_size for p in (out / "fsdp").iterdir() if f"rank-{rank:05d}" in p.name
    )
    if rank == 0:
        res["reference"] = ref.synthesize_ema_model(sigma_rel=TARGET).ema_model.state_dict()
        res["ref_profiles"] = [p.ema_model.state_dict() for p in ref.profiles]
        torch.save(res["reference"], out / "reference.pt")


def mesh_part(rank: int, out: Path, res: dict) -> None:
    """HSDP (replicate x shard) and FSDP with tensor parallelism (a factory)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_all(seeded(Wide, 1), hsdp)
    twin = seeded(Wide, 1)
    ema = PostHocEMA(model, checkpoint_every_num_steps=2, checkpoint_folder=out / "hsdp", **KW)
    ref = PostHocEMA(twin, checkpoint_every_num_steps=2, checkpoint_folder=out / "hsdp-ref", **KW)
    train(model, [ema, ref], 4, batch=(4, 8), seed=100 + rank, then=twin_of(model, twin))
    res["hsdp_on_ranks"] = gathered(ema.synthesize_ema_model(sigma_rel=TARGET).ema_model)
    if rank == 0:
        res["hsdp_ref"] = ref.synthesize_ema_model(sigma_rel=TARGET).ema_model.state_dict()

    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build() -> nn.Module:
        net = seeded(lambda: nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 8)), 2)
        parallelize_module(net, tp_mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(net, mesh=tp_mesh["dp"])
        return net

    model = build()
    twin = seeded(lambda: nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 8)), 2)
    _uneven_strided_rows(model, twin, build, out, res)
    if rank == 0:
        res["tp_initial"] = {n: v.clone() for n, v in twin.state_dict().items()}
    ema = PostHocEMA(
        model, ema_model=build, checkpoint_every_num_steps=2, checkpoint_folder=out / "tp", **KW
    )
    ref = PostHocEMA(twin, checkpoint_every_num_steps=2, checkpoint_folder=out / "tp-ref", **KW)
    train(
        model,
        [ema, ref],
        4,
        batch=(4, 8),
        seed=100 + tp_mesh["dp"].get_local_rank(),
        then=twin_of(model, twin),
    )
    res["tp_on_ranks"] = gathered(ema.synthesize_ema_model(sigma_rel=TARGET).ema_model)
    if rank == 0:
        res["tp_ref"] = ref.synthesize_ema_model(sigma_rel=TARGET).ema_model.state_dict()


def _uneven_strided_rows(
    model: nn.Module, twin: nn.Module, build: Any, out: Path, res: dict
) -> None:
    """FSDP2 over tensor parallelism, ``0``'s 6 rows: 3 per tensor-parallel rank, split
    2 + 1 over the FSDP ranks (``_StridedShard(0, sf=2), Shard(0)``). Each rank's blocks,
    with the values it really holds there (``twin`` is the same model, whole), and an
    export of a fresh EMA made without ``DTensor.full_tensor()``, which misplaces these
    rows on torch 2.8 and 2.9."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    from emakit import EMA, save_ema_weights
    from emakit.posthoc.snapshots.shards import model_blocks

    local, blocks, _ = model_blocks(model, empty=True)
    full = twin.state_dict()
    res["tp_blocks"] = {n: (b.offset, b.size) for n, b in blocks.items()}
    res["tp_block_values"] = {
        n: torch.equal(
            local[n].detach(),
            full[n][tuple(slice(o, o + s) for o, s in zip(b.offset, b.size, strict=True))],
        )
        for n, b in blocks.items()
    }
    ema = EMA(model, ema_model=build)
    refuse = AssertionError("emakit assembled a tensor with DTensor.full_tensor()")
    with mock.patch.object(DTensor, "full_tensor", side_effect=refuse):
        save_ema_weights(ema, out / "tp-export.safetensors")


def four_ranks(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    res: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # few snapshots: a rough fit
        fsdp_part(rank, out, init_device_mesh("cpu", (4,)), res)
        mesh_part(rank, out, res)
        # DDP: identical EMAs on every rank, rank 0 writes whole-model files, no collective
        from torch.nn.parallel import DistributedDataParallel

        ddp = PostHocEMA(
            DistributedDataParallel(seeded(Wide, 0)),
            checkpoint_every_num_steps="manual",
            checkpoint_folder=out / "ddp",
            **KW,
        )
        ddp.update()
        res["ddp_files"] = [p.name for p in ddp.checkpoint()]
        # the misuse, last (it leaves the process group unusable): rank 0 alone
        model = shard_all(seeded(Wide, 0), init_device_mesh("cpu", (4,)))
        ema = PostHocEMA(
            model, checkpoint_every_num_steps="manual", checkpoint_folder=out / "alone", **KW
        )
        ema.update()
    if rank == 0:
        with store_waits() as waits:
            try:
                ema.checkpoint(timeout_s=2)
                res["alone"] = ""
            except Exception as e:
                res["alone"] = f"{type(e).__name__}: {e}"
        res["alone_waits"] = waits
    wait_for_rank_zero("alone")  # the other ranks go on once rank 0's snapshot has returned
    return res


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sharded4")
    return out, run_ranks(four_ranks, out, world=4, timeout_s=150, barrier=False)


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        if want[name].is_floating_point():
            torch.testing.assert_close(got[name].float(), want[name].float(), **TOL, msg=name)
        else:
            assert torch.equal(got[name], want[name]), name


def test_every_rank_writes_its_own_shards(four: tuple[Path, list[dict]]) -> None:
    out, results = four
    for rank, r in enumerate(results):
        assert len(r["files"]) == 6, r["files"]  # 3 steps x 2 profiles, this rank's
        assert all(f.endswith(f"rank-{rank:05d}-of-00004.safetensors") for f in r["files"])
    snaps = list_snapshots(out / "fsdp")
    assert [(s.step, s.world) for s in snaps] == [(4, 4), (4, 4), (8, 4), (8, 4), (12, 4), (12, 4)]
    # the shards partition the model: one model's bytes per set, not world copies
    ref = list_snapshots(out / "ref")
    assert abs(snaps[0].nbytes - ref[0].nbytes) < 4 * 4096  # headers only differ
    assert results[3]["local_bytes"] < results[0]["local_bytes"]  # rank 3's shards are empty


def test_ddp_snapshots_are_written_by_rank_zero_whole(four: tuple[Path, list[dict]]) -> None:
    out, results = four
    assert len(results[0]["ddp_files"]) == 2 and all(not r["ddp_files"] for r in results[1:])
    assert [s.world for s in list_snapshots(out / "ddp")] == [1, 1]


def test_karras_profiles_on_fsdp_equal_the_full_weight_ones(four: tuple[Path, list[dict]]) -> None:
    _, results = four
    for got, want in zip(results[0]["profiles"], results[0]["ref_profiles"], strict=True):
        close(got, want)


def test_synthesis_on_the_ranks_equals_the_full_weight_reference(four) -> None:
    _, results = four
    want = results[0]["reference"]
    for r in results:
        close(r["on_ranks"], want)
        assert r["synth_step"] == 12


def test_synthesis_in_one_process_reassembles_the_shards(four) -> None:
    out, results = four
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        got = synthesize_state_dict(out / "fsdp", sigma_rel=TARGET)
    close(got, results[0]["reference"])


def test_a_sharded_folder_converts_to_ema_pytorch_whole(four, tmp_path: Path) -> None:
    """`to_ema_pytorch` reassembles every rank's blocks into one whole file per snapshot:
    the files of the 4-rank FSDP2 folder equal those of the one-process reference run."""
    out, _ = four
    sharded = to_ema_pytorch(out / "fsdp", tmp_path / "fsdp")
    whole = to_ema_pytorch(out / "ref", tmp_path / "ref")
    assert [p.name for p in sharded] == [p.name for p in whole] and len(sharded) == 6
    for a, b in zip(sharded, whole, strict=True):
        got, want = (torch.load(p, weights_only=True) for p in (a, b))
        assert int(got["step"]) == int(want["step"]) and bool(got["initted"])
        close(
            {k: got[k] for k in sorted(got) if k.startswith("ema_model.")},
            {k: want[k] for k in sorted(want) if k.startswith("ema_model.")},
        )


def test_hsdp_and_tensor_parallel_snapshots(four) -> None:
    out, results = four
    for r in results:
        close(r["hsdp_on_ranks"], results[0]["hsdp_ref"])
        close(r["tp_on_ranks"], results[0]["tp_ref"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        close(synthesize_state_dict(out / "hsdp", sigma_rel=TARGET), results[0]["hsdp_ref"])
        close(synthesize_state_dict(out / "tp", sigma_rel=TARGET), results[0]["tp_ref"])
    # TP x FSDP2 over uneven rows: the blocks FSDP2 filled, and the export, exact
    for rank, r in enumerate(results):
        dp, tp = divmod(rank, 2)
        assert r["tp_blocks"]["0.weight"] == ((3 * tp + 2 * dp, 0), (2 - dp, 8)), rank
        assert r["tp_blocks"]["2.weight"] == ((4 * dp, 3 * tp), (4, 3)), rank
        assert all(r["tp_block_values"].values()), (rank, r["tp_block_values"])
    exported = safetensors.torch.load_file(str(out / "tp-export.safetensors"))
    initial = results[0]["tp_initial"]
    assert list(exported) == list(initial)
    for name, value in initial.items():
        assert torch.equal(exported[name], value), name
    # HSDP: ranks 2 and 3 (replicate coordinate 1) store nothing; ranks 0 and 1 the shards
    stored = {}
    for path in sorted((out / "hsdp").glob("step-000000002_sigma_rel-0.05_*")):
        with safetensors.safe_open(str(path), "pt") as f:
            stored[path.name.split(".rank-")[1][:5]] = sorted(f.keys())
    assert stored["00002"] == stored["00003"] == []
    assert "count" in stored["00000"] and "count" not in stored["00001"]
    assert "inp.weight" in stored["00000"] and "inp.weight" in stored["00001"]


def test_a_snapshot_on_rank_zero_alone_fails_fast_naming_the_others(four) -> None:
    out, results = four
    alone = results[0]["alone"]
    assert alone.startswith("EMARuntimeError"), alone
    assert "call on every rank" in alone and "ranks 1, 2, 3 did not arrive" in alone, alone
    # it waited for the others once, for its timeout_s and no longer, then gave up
    assert results[0]["alone_waits"] == [(2.0, False)]
    assert not (out / "alone").exists() or not any((out / "alone").glob("*.safetensors"))


# -- 2 ranks: the 4-rank folder resharded, a full disk, a SIGKILL -------------------------------


def two_ranks(rank: int, out: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from emakit.posthoc.snapshots import format as snapshots
    from emakit.posthoc.snapshots import writer as writing

    res: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (2,))
    warnings.simplefilter("ignore", PostHocWarning)
    model = shard_all(seeded(Wide, 5), mesh)
    ema = PostHocEMA(
        model, checkpoint_every_num_steps="manual", checkpoint_folder=out / "fsdp", run_id=RUN, **KW
    )
    res["resharded"] = gathered(ema.synthesize_ema_model(sigma_rel=TARGET).ema_model)
    # 4 ranks' flat ranges into 2 ranks' FSDP2 row blocks, and into 2 ranks' flat ranges
    flat = PostHocEMA(
        model, checkpoint_every_num_steps="manual", checkpoint_folder=out / "parted", **KW
    )
    res["flat_to_fsdp"] = gathered(flat.synthesize_ema_model(sigma_rel=TARGET).ema_model)
    twin = seeded(Wide, 5)
    flat = PostHocEMA(
        twin,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=out / "parted",
        partition=True,
        **KW,
    )
    synth = flat.synthesize_ema_model(sigma_rel=TARGET)
    res["flat_to_flat"] = {n: synth.ema_model.full(n, None) for n in synth.ema_model.layout()}
    # the sweep on the ranks (evaluate runs the sharded forward) vs one synthesis per length
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            return float(m(x).pow(2).sum())

    res["sweep"] = list(ema.sweep(score, sigma_rels=[0.1, 0.2], lengths_per_pass=1))
    res["per_length"] = [
        (s, score(ema.synthesize_ema_model(sigma_rel=s).ema_model.eval())) for s in (0.1, 0.2)
    ]

    _rewrite(model, out / "rewrite", res)
    kill = PostHocEMA(
        model, checkpoint_every_num_steps="manual", checkpoint_folder=out / "kill", **KW
    )
    kill.update()
    kill.checkpoint()
    first = sorted((out / "kill").glob("*.safetensors"))
    res["first"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in first}
    real = snapshots.write_safetensors
    # rank 1's disk fills up: every rank raises, rank 0's files of the step are removed
    kill.update()
    if rank == 1:

        def full(f: Any, tensors: Any, header: Any) -> None:
            raise OSError(28, "No space left on device")

        snapshots.write_safetensors = full
    try:
        kill.checkpoint()
        res["full_disk"] = ""
    except Exception as e:
        res["full_disk"] = f"{type(e).__name__}: {e}"
    snapshots.write_safetensors = real
    res["after_full_disk"] = sorted(p.name for p in (out / "kill").glob("*.safetensors"))
    # rank 1 is killed while writing its first file of the next step
    kill.update()
    writing.OUTCOME_TIMEOUT_S = 3.0
    if rank == 1:

        def killed(f: Any, tensors: Any, header: Any) -> None:
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        snapshots.write_safetensors = killed
    try:
        kill.checkpoint()
        res["killed"] = ""
    except Exception as e:
        res["killed"] = f"{type(e).__name__}: {e}"
    res["after_kill"] = sorted(p.name for p in (out / "kill").glob("*.safetensors"))
    return res


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("step-*")}


def _rewrite(model: nn.Module, folder: Path, res: dict[str, Any]) -> None:
    """A resumed run (the same run id) snapshots step 1 again, and the rewrite fails on rank
    1: its disk is full; then its rename fails after every rank has voted."""
    from emakit.posthoc.snapshots import format as snapshots

    rank = torch.distributed.get_rank()
    kw: dict[str, Any] = dict(checkpoint_every_num_steps="manual", checkpoint_folder=folder)
    first = PostHocEMA(model, run_id=RUN, **kw, **KW)
    first.update()
    first.checkpoint()
    # checkpoint() returns on each rank once its own files are in place: wait for the
    # other rank's renames before listing the folder
    torch.distributed.barrier()
    res["rewrite_before"] = _digests(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the resumed run's step 1 differs from the first one's
    resumed = PostHocEMA(model, run_id=RUN, **kw, **KW)
    resumed.update()
    real, replace = snapshots.write_safetensors, os.replace
    if rank == 1:

        def full(f: Any, tensors: Any, header: Any) -> None:
            raise OSError(28, "No space left on device")

        snapshots.write_safetensors = full
    res["rewrite_full"] = _outcome(resumed.checkpoint)
    snapshots.write_safetensors = real
    res["rewrite_after"] = _digests(folder)
    if rank == 1:

        def broken(src: Any, dst: Any) -> None:
            raise OSError(5, "Input/output error")

        os.replace = broken  # type: ignore[assignment]
    outcome = _outcome(resumed.checkpoint)
    os.replace = replace
    res["rename"] = [""] * 2  # rank 1 does not live to return its results
    torch.distributed.all_gather_object(res["rename"], outcome)


@pytest.fixture(scope="module")
def two(four: tuple[Path, list[dict]]) -> list[dict]:
    out, _ = four
    return run_ranks(two_ranks, out, world=2, timeout_s=90, barrier=False, may_die=(1,))


def test_synthesis_on_two_ranks_reshards_the_four_rank_snapshots(four, two) -> None:
    _, results = four
    close(two[0]["resharded"], results[0]["reference"])


def test_flat_ranges_of_four_ranks_reshard_into_two_ranks_either_kind(four, two) -> None:
    out, results = four
    assert [s.world for s in list_snapshots(out / "parted")][:2] == [4, 4]
    r = two[0]  # gathered from both ranks (rank 1 is killed later in the job)
    close(r["flat_to_fsdp"], results[0]["reference"])  # flat ranges -> FSDP2 row blocks
    close(r["flat_to_flat"], results[0]["reference"])  # 4 ranks' ranges -> 2 ranks'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        close(synthesize_state_dict(out / "parted", sigma_rel=TARGET), results[0]["reference"])


def test_the_sweep_on_two_ranks_equals_one_synthesis_per_length(two) -> None:
    r0 = two[0]
    assert [s for s, _ in r0["sweep"]] == [0.1, 0.2]
    for (_, got), (_, want) in zip(r0["sweep"], r0["per_length"], strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_a_full_disk_on_one_rank_fails_every_rank(two) -> None:
    r0 = two[0]
    assert r0["full_disk"].startswith("EMAWriteError"), r0["full_disk"]
    assert "rank 1" in r0["full_disk"] and "No space left" in r0["full_disk"]
    assert all("step-000000002" not in n for n in r0["after_full_disk"])  # nothing kept


def test_a_failed_rewrite_of_a_step_keeps_its_earlier_set(two) -> None:
    r = two[0]
    # every rank's file of the first write of step 1 is still there, byte for byte
    assert len(r["rewrite_before"]) == 4  # 2 profiles x 2 ranks
    assert r["rewrite_after"] == r["rewrite_before"]
    assert r["rewrite_full"].startswith("EMAWriteError"), r["rewrite_full"]
    assert "rank 1" in r["rewrite_full"] and "No space left" in r["rewrite_full"]
    assert "as they were before the call" in r["rewrite_full"]


def test_a_rewrite_interrupted_after_the_vote_is_never_read_as_one_set(four, two) -> None:
    """Rank 0 replaced its files, rank 1's rename failed: two writes' halves of step 1,
    skipped with a warning each instead of being mixed into one model."""
    out, _ = four
    on_rank0, on_rank1 = two[0]["rename"]
    assert on_rank0 == ""
    assert on_rank1.startswith("EMAWriteError") and "Input/output error" in on_rank1, on_rank1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PostHocWarning)
        snaps = list_snapshots(out / "rewrite")
    texts = sorted(str(w.message) for w in caught)
    assert snaps == []
    assert len(texts) == 4  # 2 profiles, each: rank 0's new file, rank 1's old one
    assert sum("ranks [0] are missing" in t for t in texts) == 2, texts
    assert sum("ranks [1] are missing" in t for t in texts) == 2, texts


def test_a_rank_killed_mid_snapshot_leaves_the_previous_set_usable(four, two) -> None:
    out, _ = four
    r0 = two[0]
    assert two[1] is None  # rank 1 was killed
    assert r0["killed"].startswith("EMARuntimeError") and "died" in r0["killed"], r0["killed"]
    assert "put none of them in place" in r0["killed"]
    assert all("step-000000003" not in n for n in r0["after_kill"])  # rank 0 replaced nothing
    folder = out / "kill"
    for name, digest in r0["first"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
    with warnings.catch_warnings():
        warnings.simplefilter("error", PostHocWarning)  # no incomplete set left behind
        snaps = list_snapshots(folder)
    assert {s.step for s in snaps} == {1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)  # 1 step: a rough profile
        state = synthesize_state_dict(folder, sigma_rel=TARGET)
    assert set(state) == set(Wide().state_dict())
