"""A launcher for multi-process tests: ``run_ranks(fn, out, world=4)``.

The same scheme as ``tests/test_distributed.py``'s: ``world`` ranks forked from the test
process, gloo over loopback, a process-group timeout, and a deadline for the whole job. A
worker that raises, dies or hangs fails the test with its traceback. ``fn(rank, out)``
returns a picklable result per rank. With ``barrier=False`` the ranks skip the final
barrier (for jobs that leave the process group unusable on purpose, e.g. a collective
that only some ranks called).

Inside a rank, ``store_waits()`` records the waits of emakit's arrival check, and
``wait_for_rank_zero(name)`` orders the ranks through the process group's store: what the
tests assert and wait on instead of durations and sleeps.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from emakit._dist.dtensor import FSDP2_MIN_TORCH, torch_version

PG_TIMEOUT_S = 60

#: Why FSDP2 tests cannot run on this torch, or None: emakit refuses FSDP2 below
#: ``FSDP2_MIN_TORCH`` by design, and torch 2.6's FSDP2 cannot run on CPU gloo ranks
#: ("'Stream' object has no attribute 'record_event'", fixed in torch 2.7).
NO_FSDP2 = (
    f"emakit supports FSDP2 from torch {'.'.join(map(str, FSDP2_MIN_TORCH))} (by design)"
    if torch_version() < FSDP2_MIN_TORCH
    else "torch 2.6's FSDP2 cannot run on CPU (Stream.record_event)"
    if torch_version() < (2, 7)
    else None
)
#: The mark of a module whose every test shards a model with FSDP2 on CPU ranks.
FSDP2_MARK = pytest.mark.skipif(NO_FSDP2 is not None, reason=str(NO_FSDP2))


def need_fsdp2() -> None:
    """Skip the calling test or fixture where FSDP2 cannot run (`NO_FSDP2`)."""
    if NO_FSDP2 is not None:
        pytest.skip(NO_FSDP2)


#: The marks of every test module that launches ranks: the ``dist`` marker, and skips
#: where gloo or ``fork`` is missing.
DIST_MARKS = [
    pytest.mark.dist,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
    ),
    pytest.mark.skipif(
        "fork" not in multiprocessing.get_all_start_methods(), reason="forks its workers"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[[int, Path], Any], rank: int, world: int, port: int, out: Path, barrier: bool
) -> None:
    try:
        torch.set_num_threads(1)  # several ranks on two cores; no OpenMP pool after fork
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, out)
        torch.save(result, out / f"result-{rank}.pt")
        if barrier:
            dist.barrier()
            dist.destroy_process_group()
        os._exit(0)  # a process group left broken on purpose must not block the exit
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


def run_ranks(
    fn: Callable[[int, Path], Any],
    out: Path,
    *,
    world: int = 2,
    timeout_s: float = 90,
    barrier: bool = True,
    may_die: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, out)`` on ``world`` forked gloo ranks; return each rank's result
    (None for a rank in ``may_die`` that was killed by a signal, e.g. one that SIGKILLs
    itself on purpose)."""
    import torch._dynamo  # fully_shard imports it: once here, not per rank
    import torch.distributed.checkpoint
    import torch.distributed.fsdp

    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, out, barrier)) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    errors = [out / f"error-{r}.txt" for r in range(world)]
    report = "\n".join(f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errors) if e.exists())
    if report:
        pytest.fail(f"a worker raised:\n{report}")
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout_s} s")
    died = {r for r, p in enumerate(procs) if r in may_die and (p.exitcode or 0) < 0}
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in died]
    if bad:
        pytest.fail(f"workers died: (rank, exit code) {bad}")
    return [
        None if r in died else torch.load(out / f"result-{r}.pt", weights_only=False)
        for r in range(world)
    ]


@contextlib.contextmanager
def store_waits() -> Iterator[list[tuple[float, bool]]]:
    """Within the block, every wait of emakit's arrival check on the process group's store
    (``emakit._dist.arrival``), recorded in order as ``(its bound in seconds, whether the
    awaited keys came)``; call it in a rank.

    What a test asserts instead of a duration: a check that gave up waited once, with the
    bound it was given (``[(timeout_s, False)]``: torch's store waited that long, no longer),
    and a rank that learned at once that it came late did not wait at all (``[]``).
    """
    from emakit._dist import collectives

    waits: list[tuple[float, bool]] = []
    real = collectives.default_store

    class Recording:
        def __init__(self, store: Any) -> None:
            self._store = store

        def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
            try:
                self._store.wait(keys, timeout)
            except RuntimeError:
                waits.append((timeout.total_seconds(), False))
                raise
            waits.append((timeout.total_seconds(), True))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._store, name)

    def recording() -> Any:
        store = real()
        return None if store is None else Recording(store)

    collectives.default_store = recording  # type: ignore[assignment]
    try:
        yield waits
    finally:
        collectives.default_store = real


def wait_for_rank_zero(name: str) -> None:
    """Order the ranks through the process group's store, for jobs whose collectives are
    broken on purpose (no ``dist.barrier()`` at hand): the other ranks block here until rank
    0 comes here (each at most the store's timeout, ``PG_TIMEOUT_S``), and rank 0 leaves only
    once every other rank has passed, since the store lives in rank 0's process."""
    from emakit._dist.arrival import default_store

    store = default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        store.set(f"tests/{name}", b"")
        store.wait([f"tests/{name}/{r}" for r in range(1, world)])
    else:
        store.wait([f"tests/{name}"])
        store.set(f"tests/{name}/{rank}", b"")
