"""The arrival check that starts every collective save, load and export (issue 23, item
4): built on the process group's c10d store, it names the ranks that did not arrive on
every backend (``emakit._dist.arrival``), and leaves no key behind.

One job of 3 gloo ranks over loopback (``tests/_launch.py``) runs every case in turn; a
failed check starts no collective, so the ranks meet in a plain barrier between cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from _launch import DIST_MARKS, run_ranks, store_waits
from emakit import EMARuntimeError
from emakit._dist import arrival, collectives

pytestmark = DIST_MARKS


def _call(group: Any = None, timeout_s: float = 30.0, step: int = 0) -> str | None:
    """None if the agreement passed, else ``"<type>: <message>"``."""
    try:
        collectives.agree("save_sharded_ema", step=step, skips=0, group=group, timeout_s=timeout_s)
    except EMARuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ours(store: Any) -> list[str]:
    """emakit's keys in the store (none seen where the store cannot list them: torch 2.4)."""
    keys = store.list_keys() if hasattr(store, "list_keys") else []
    return [k for k in keys if arrival.KEY_ROOT in k]


def worker(rank: int, out: Path) -> dict:
    res: dict[str, Any] = {}
    store = arrival.default_store()
    # what emakit reads from torch: the default group's store, shared by the ranks
    res["store_is_store"] = isinstance(store, dist.Store)
    if rank == 0:
        store.set("pinned", "from rank 0")
    dist.barrier()
    res["pinned"] = store.get("pinned").decode()
    # every rank must create every group, in the same order
    sub = dist.new_group([0, 2])
    first = dist.new_group([0, 1])
    late = dist.new_group([1, 2])
    dist.barrier()
    # all arrive, many times in a row, on the default group and on a subgroup
    res["many"] = [_call(step=i) for i in range(25)]
    res["sub"] = [_call(sub, step=i) for i in range(3)] if rank in (0, 2) else []
    dist.barrier()
    res["keys_left"] = _ours(store)
    dist.barrier()
    # rank 1 alone, in a group where rank 0 is group rank 0: rank 1 names rank 0
    if rank == 1:
        with store_waits() as waits:
            res["rank1_alone"] = _call(first, timeout_s=1)
        res["rank1_alone_waits"] = waits
    dist.barrier()
    # rank 2 alone in [1, 2] (group rank 0 is rank 1), then rank 1 comes late: it learns so
    # at once, and the late read removes the failed check's keys
    before = set(_ours(store))  # the failed check above left its verdict and count
    dist.barrier()
    if rank == 2:
        res["rank2_alone"] = _call(late, timeout_s=1)
    dist.barrier()
    if rank == 1:
        with store_waits() as waits:
            res["late"] = _call(late, timeout_s=30)
        res["late_waits"] = waits
    dist.barrier()
    res["late_keys_left"] = sorted(set(_ours(store)) - before)
    dist.barrier()
    # without the store (a torch that hides it), the collective fallback still agrees
    kept = collectives.default_store
    collectives.default_store = lambda: None  # type: ignore[assignment]
    try:
        res["fallback"] = _call(step=7)
    finally:
        collectives.default_store = kept
    dist.barrier()
    # torch < 2.7 refuses get_process_group_ranks(None) with "KeyError: None", which every
    # save_full_ema_weights/load_full_ema_weights of a DDP job passed: emakit names the
    # default group itself (issue 31)
    real = dist.get_process_group_ranks

    def old_torch(group: Any) -> list[int]:
        if group is None:
            raise KeyError(None)
        return real(group)

    dist.get_process_group_ranks = old_torch  # type: ignore[assignment]
    try:
        res["old_torch"] = _call(step=8)
    finally:
        dist.get_process_group_ranks = real
    dist.barrier()
    # last, since it leaves the default group's checks out of step: rank 0 alone
    if rank == 0:
        with store_waits() as waits:
            res["rank0_alone"] = _call(timeout_s=1)
        res["rank0_alone_waits"] = waits
    dist.barrier()  # a failed check started no collective: the group still works
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(worker, tmp_path_factory.mktemp("arrival"), world=3, timeout_s=90)


def test_torch_internals_emakit_reads_are_where_it_expects(results: list[dict]) -> None:
    """Fails loudly when a torch release moves the default store (``default_store()``
    then returns None and emakit falls back to collectives that cannot always name ranks)."""
    assert callable(getattr(dist.distributed_c10d, "_get_default_store", None))
    for r in results:
        assert r["store_is_store"] and r["pinned"] == "from rank 0"


def test_every_rank_arriving_passes_and_leaves_no_key(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["many"] == [None] * 25
        assert r["sub"] == ([None] * 3 if rank in (0, 2) else [])
        assert r["keys_left"] == []
        assert r["fallback"] is None
        assert r["old_torch"] is None  # the default group passed by name, not as None


def test_rank_zero_alone_names_the_ranks_that_did_not_arrive(results: list[dict]) -> None:
    alone = results[0]["rank0_alone"]
    assert alone.startswith("EMARuntimeError: save_sharded_ema is a collective: call on every")
    assert "On rank 0, ranks 1, 2 did not arrive within timeout_s=1 s" in alone, alone
    assert "if is_rank_zero():" in alone and "No collective was started" in alone
    assert results[0]["rank0_alone_waits"] == [(1.0, False)]  # its timeout_s, no longer


def test_a_rank_alone_names_rank_zero(results: list[dict]) -> None:
    alone = results[1]["rank1_alone"]
    assert "call on every rank. On rank 1, rank 0 did not arrive within timeout_s=1" in alone
    assert results[1]["rank1_alone_waits"] == [(1.0, False)]  # its timeout_s, no longer


def test_a_subgroup_names_global_ranks_and_a_late_rank_learns_it_was_late(
    results: list[dict],
) -> None:
    # in [1, 2], group rank 0 is global rank 1
    assert "On rank 2, rank 1 did not arrive within timeout_s=1 s" in results[2]["rank2_alone"]
    late = results[1]["late"]
    assert "On rank 1, this rank arrived after the others had stopped waiting" in late, late
    assert results[1]["late_waits"] == []  # it did not wait its own 30 s: not at all
    assert all(r["late_keys_left"] == [] for r in results)
