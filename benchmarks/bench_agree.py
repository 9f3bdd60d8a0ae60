"""The cost of one rank agreement (``emakit._dist.collectives.agree``) when every rank
arrives: the store-based arrival check now vs the collective check before it.

Usage::

    python benchmarks/bench_agree.py [--world 4] [--calls 200] [--rounds 5]

``world`` gloo ranks over loopback on the CPU. Each rank makes ``calls`` agreements in a row
per round; rounds alternate the two contenders, side by side in one job:

* ``store``: the arrival check on the process group's c10d store (``emakit._dist.arrival``,
  the default now), then the all-gather of the rows;
* ``collective``: what ``agree()`` did before (gloo's ``monitored_barrier``), then the same
  all-gather; chosen by hiding the store (``collectives.default_store`` returns None).

Rank 0 reports the median over rounds of the mean time per call, in milliseconds. An
agreement runs once per collective save, load, export or snapshot, so milliseconds are
cheap; the number shows what the store check adds. A script, not a test; it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, calls: int, rounds: int, queue: object) -> None:
    from emakit._dist import collectives

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    store_of = collectives.default_store
    times: dict[str, list[float]] = {"store": [], "collective": []}
    for i in range(rounds * 2):
        name = "store" if i % 2 == 0 else "collective"
        collectives.default_store = store_of if name == "store" else (lambda: None)
        dist.barrier()
        start = time.perf_counter()
        for step in range(calls):
            collectives.agree("save_sharded_ema", step=step, skips=0)
        times[name].append((time.perf_counter() - start) / calls * 1e3)
    dist.barrier()
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()})  # type: ignore[attr-defined]
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args.calls, args.rounds, queue))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    print(f"{args.world} gloo ranks, {args.calls} agreements per round, {args.rounds} rounds")
    print("| arrival check | ms per agreement (median of rounds) |")
    print("|---|---:|")
    for name, ms in result.items():
        print(f"| {name} | {ms:.3f} |")
    print(f"store / collective: {result['store'] / result['collective']:.2f}x")


if __name__ == "__main__":
    main()
