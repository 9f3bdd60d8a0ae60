"""``EMA(model, partition=True)`` on a replicated model: per-rank memory and time.

Usage::

    python benchmarks/bench_partition.py [--world 2] [--dim 1024] [--blocks 4] [--json OUT]

The model (replicated on every rank, as under DDP or DeepSpeed ZeRO-1/2): ``blocks`` MLP
blocks (``Linear(dim, 4 dim)``, ``Linear(4 dim, dim)``), float32 (33.6M parameters,
128 MiB by default). On ``world`` gloo ranks on the CPU, each rank builds ``EMA(model)``
(``whole``) or ``EMA(model, partition=True)`` (``partitioned``), one per fresh process
group, and measures:

* **EMA bytes**: the bytes of the EMA copy's tensors on this rank (exact, by construction);
* **RSS growth**: ``VmRSS`` after building the EMA minus before (started with
  ``MALLOC_MMAP_THRESHOLD_=131072``, so freed blocks go back to the system);
* **update**: the median of 20 averaging ``update()`` calls (ms);
* **swap**: the median of 5 ``with ema.swap(): pass`` (ms; the partitioned one all-gathers
  every parameter twice);
* **export**: one ``save_full_ema_weights`` (ms).

Both contenders run side by side in one invocation. This file is a script, not part of
the test suite; it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from emakit import EMA
from emakit.distributed import save_full_ema_weights


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def make(dim: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)]
    return nn.Sequential(*layers)


def timed(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def swap_once(ema: EMA) -> None:
    with ema.swap():
        pass


def worker(rank: int, world: int, port: int, args: Any, partition: bool, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = make(args.dim, args.blocks)
    before = rss()
    ema = EMA(model, beta=0.999, update_after_step=0, update_every=1, partition=partition)
    grown = rss() - before
    held = sum(t.numel() * t.element_size() for t in ema.ema_model.state_dict().values())
    ema.update()
    update = timed(ema.update, 20)
    swap = timed(lambda: swap_once(ema), 5)
    with tempfile.TemporaryDirectory() as d:
        export = timed(lambda: save_full_ema_weights(ema, Path(d) / "ema.safetensors"), 1)
    row = {"rank": rank, "ema_bytes": held, "rss_growth": grown, "update_ms": update}
    row.update(swap_ms=swap, export_ms=export)
    (out / f"{int(partition)}-{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def run(args: Any, partition: bool, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=worker, args=(r, args.world, port, args, partition, out))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return [json.loads((out / f"{int(partition)}-{r}.json").read_text()) for r in range(args.world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    params = sum(p.numel() for p in make(args.dim, args.blocks).parameters())
    print(f"{params / 1e6:.1f}M float32 parameters, {args.world} gloo ranks, CPU")
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, partition in (("whole", False), ("partitioned", True)):
            results[name] = run(args, partition, Path(d))
    print(
        f"{'':12} {'rank':>4} {'EMA MiB':>8} {'RSS +MiB':>8} {'update ms':>9} "
        f"{'swap ms':>8} {'export ms':>9}"
    )
    for name, rows in results.items():
        for r in rows:
            print(
                f"{name:12} {r['rank']:>4} {r['ema_bytes'] / 2**20:>8.1f} "
                f"{r['rss_growth'] / 2**20:>8.1f} {r['update_ms']:>9.2f} "
                f"{r['swap_ms']:>8.1f} {r['export_ms']:>9.1f}"
            )
    if args.json is not None:
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        args.json.write_text(json.dumps({"when": stamp, "params": params, **results}, indent=1))


if __name__ == "__main__":
    main()
