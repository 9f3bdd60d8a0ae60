"""Sharded post-hoc snapshots store shared frozen weights once per rank (issue 21): 2 gloo
ranks, a model whose trainable head is DTensor-sharded and whose frozen base is shared with
the EMA (``shares()``), and an FSDP2 model whose frozen base's shards are shared, each
snapshotted with side files and with every tensor in every rank
file (``store_frozen_once=False``) in the same run; synthesis on the ranks and in one
process equals the reference's.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _launch import DIST_MARKS, FSDP2_MARK, run_ranks
from _models import gathered, seeded
from emakit import PostHocEMA
from emakit._files.safetensors_file import SafetensorsFile
from emakit.posthoc import PostHocWarning, list_snapshots, synthesize_state_dict
from emakit.posthoc.snapshots.frozen import is_side_file
from emakit.posthoc.snapshots.shards import ShardEntry, set_frozen_names

pytestmark = [*DIST_MARKS, FSDP2_MARK]

#: share_frozen=True: the frozen base is shared (copied by default), so the snapshots store
#: it in side files.
KW: dict[str, Any] = dict(
    sigma_rels=(0.05, 0.28),
    update_every=1,
    checkpoint_every_num_steps=3,
    checkpoint_dtype=torch.float32,
    share_frozen=True,
)


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x)))


def ranks(rank: int, out: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = seeded(Adapted, 0)
    # The head's weights are DTensors (row shards); the frozen base stays a plain tensor,
    # shared with the EMA on every rank and stored by rank 0.
    for name, p in list(model.head.named_parameters()):
        setattr(model.head, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    once = PostHocEMA(model, checkpoint_folder=out / "once", run_id="sharded", **KW)
    every = PostHocEMA(
        model, checkpoint_folder=out / "every", run_id="sharded", store_frozen_once=False, **KW
    )
    res: dict[str, Any] = {"shared": sorted(once.profiles[0].shared_names())}
    for i in range(9):
        with torch.no_grad():
            if i == 5:
                # a new frozen value: a new side file (written through .data, which the
                # EMA does not see; a visible in-place write is refused, test_frozen.py)
                model.base.bias.data.add_(0.5)
            for p in model.head.parameters():  # a training step, the same on every rank
                noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
                p.add_(distribute_tensor(noise, mesh, [Shard(0)]))
        once.update()
        every.update()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        res["on_ranks"] = gathered(once.synthesize_ema_model(sigma_rel=0.15).ema_model)
        res["ref_on_ranks"] = gathered(every.synthesize_ema_model(sigma_rel=0.15).ema_model)
    res["fsdp"] = fsdp_part(rank, out / "fsdp", mesh)
    return res


def fsdp_part(rank: int, out: Path, mesh: Any) -> dict[str, Any]:
    """FSDP2: the frozen base's shards are shared (``shares()`` of their local shards), so
    each rank stores its own shard of the base in its own side file."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(seeded(Adapted, 0), mesh=mesh)
    once = PostHocEMA(model, checkpoint_folder=out / "once", run_id="fsdp", **KW)
    every = PostHocEMA(
        model, checkpoint_folder=out / "every", run_id="fsdp", store_frozen_once=False, **KW
    )
    res: dict[str, Any] = {"shared": sorted(once.profiles[0].shared_names())}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(20 + rank)
    for i in range(9):
        if i == 5:
            with torch.no_grad():
                # each rank changes its shard in place (through .data, as above)
                model.base.bias.to_local().data.add_(0.5)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        once.update()
        every.update()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        res["on_ranks"] = gathered(once.synthesize_ema_model(sigma_rel=0.15).ema_model)
        res["ref_on_ranks"] = gathered(every.synthesize_ema_model(sigma_rel=0.15).ema_model)
    return res


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("frozen-sharded")
    return out, run_ranks(ranks, out, world=2, timeout_s=120)


def same_sum(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Bit-equal, except the frozen base: its side file is read once with the summed
    weights, where every-tensor snapshots add it snapshot by snapshot (float32 rounding)."""
    tol = 0.0 if not name.startswith("base.") else 1e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol / 10, msg=name)


def test_each_rank_stores_its_shared_frozen_blocks_once(job) -> None:
    out, results = job
    assert results[0]["shared"] == ["base.bias", "base.weight"]
    sides = sorted(p.name for p in (out / "once").iterdir() if is_side_file(p.name))
    # rank 0 holds the whole base (not a DTensor); rank 1 stores nothing of it
    assert len(sides) == 2 and all("rank-00000-of-00002" in n for n in sides), sides
    for p in (out / "once").glob("step-*.safetensors"):
        with SafetensorsFile(p) as f:
            assert not {"base.weight", "base.bias"} & set(f.keys()), p.name
    snaps = list_snapshots(out / "once")
    assert len(snaps) == 6 and all(s.frozen_names == {"base.weight", "base.bias"} for s in snaps)
    assert len({s.frozen for s in snaps}) == 2  # before and after the change


def test_sharded_synthesis_equals_the_every_tensor_snapshots(job) -> None:
    out, results = job
    for r in results:
        for name, want in r["ref_on_ranks"].items():
            same_sum(r["on_ranks"][name], want, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        one = synthesize_state_dict(out / "once", sigma_rel=0.15)
        ref = synthesize_state_dict(out / "every", sigma_rel=0.15)
    assert set(one) == set(ref) == set(results[0]["on_ranks"])
    for name in ref:
        same_sum(one[name], ref[name], name)
        torch.testing.assert_close(one[name], results[0]["on_ranks"][name], msg=name)


def test_fsdp2_frozen_shards_are_stored_once_per_rank(job) -> None:
    out, results = job
    folder = out / "fsdp" / "once"
    assert all(r["fsdp"]["shared"] == ["base.bias", "base.weight"] for r in results)
    sides = sorted(p.name for p in folder.iterdir() if is_side_file(p.name))
    for rank in (0, 1):  # the base's shard before and after the change, on each rank
        assert sum(f"rank-0000{rank}-of-00002" in n for n in sides) == 2, sides
    for p in folder.glob("step-*.safetensors"):
        with SafetensorsFile(p) as f:
            assert not {"base.weight", "base.bias"} & set(f.keys()), p.name
    snaps = list_snapshots(folder)
    assert len(snaps) == 6 and all(len(s.frozen) == 2 for s in snaps)  # a side file per rank
    for r in results:
        for name, want in r["fsdp"]["ref_on_ranks"].items():
            same_sum(r["fsdp"]["on_ranks"][name], want, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        one = synthesize_state_dict(folder, sigma_rel=0.15)
        ref = synthesize_state_dict(out / "fsdp" / "every", sigma_rel=0.15)
    for name in ref:
        same_sum(one[name], ref[name], name)
    assert not torch.equal(one["base.bias"], seeded(Adapted, 0).base.bias)  # the change


def test_a_set_reads_a_frozen_tensor_once_only_where_no_rank_keeps_it_itself() -> None:
    def entry(rank: int, volumes: dict[str, int]) -> ShardEntry:
        shapes = {n: ((4, 2), v) for n, v in volumes.items()}
        return ShardEntry((), rank, 3, Path(f"r{rank}"), shapes)

    entries = [
        entry(0, {"base": 4, "odd": 4, "head": 4}),
        entry(1, {"base": 4, "odd": 4, "head": 4}),
        entry(2, {"base": 0, "odd": 0, "head": 0}),  # an empty shard: stores nothing
    ]
    # rank 1 un-shared ``odd`` (a load changed its shard): its block varies per snapshot
    own = [frozenset({"base", "odd"}), frozenset({"base"}), frozenset()]
    assert set_frozen_names(entries, own) == {"base"}
