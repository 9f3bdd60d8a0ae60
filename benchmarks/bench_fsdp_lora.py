"""EMA of an FSDP2-sharded PEFT LoRA model: memory and update time per rank, with the frozen
base's shards shared (``share_frozen=True``) or copied (``share_frozen=False``, the default).

Usage: python benchmarks/bench_fsdp_lora.py [--repeats R] [--layers L] [--world W]

The model of ``bench_lora.py`` (a config-built GPT-2, ``n_embd=768``, vocabulary 2048, LoRA
``r=8`` on ``c_attn``; nothing downloaded), each transformer block and the root sharded with
``fully_shard`` over ``W`` gloo ranks on the CPU, one thread per rank. Per rank:

* **EMA memory**: the bytes of every parameter storage the EMA copy holds that the model
  does not (a shard shared with the model costs nothing), and the model's own shards;
* **update**: one averaging ``update()`` (``update_every=1``), the two EMAs interleaved
  round-robin, the median per call; the floor is a bare ``torch._foreach_lerp_`` over this
  rank's trainable shards.

Rank 0 prints the table (memory: the largest over the ranks; time: rank 0's).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_lora import lora_model  # this folder is the script's: sys.path[0]
from emakit import EMA
from emakit.distributed import local_tensor

MIB = 2**20


def extra_bytes(model: torch.nn.Module, ema_model: torch.nn.Module) -> int:
    """Bytes of ``ema_model``'s parameter storages (local shards) that ``model`` does not hold."""
    own = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    for p in ema_model.parameters():
        s = local_tensor(p).untyped_storage()
        if s.data_ptr() not in own:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def shard_bytes(model: torch.nn.Module, trainable: bool | None = None) -> int:
    return sum(
        local_tensor(p).numel() * p.element_size()
        for p in model.parameters()
        if trainable is None or p.requires_grad == trainable
    )


def median_us(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = lora_model(args.layers)
    for block in model.base_model.model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = {"beta": 0.999, "update_after_step": 0, "update_every": 1}
    t0 = time.perf_counter()
    shared = EMA(model, share_frozen=True, **kw)
    build_shared = time.perf_counter() - t0
    t0 = time.perf_counter()
    copied = EMA(model, **kw)
    build_copied = time.perf_counter() - t0
    trainable = [local_tensor(p) for p in model.parameters() if p.requires_grad]
    floor_shadows = [t.clone() for t in trainable]
    rows: dict[str, tuple[int | None, Callable[[], Any], float | None]] = {
        "emakit EMA, share_frozen=True": (
            extra_bytes(model, shared.ema_model),
            shared.update,
            build_shared,
        ),
        "emakit EMA, share_frozen=False (default)": (
            extra_bytes(model, copied.ema_model),
            copied.update,
            build_copied,
        ),
        "floor: _foreach_lerp_ over this rank's adapter shards": (
            None,
            lambda: torch._foreach_lerp_(floor_shadows, trainable, 0.001),
            None,
        ),
    }
    for _, fn, _ in rows.values():
        fn()
        fn()
    timings: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeats):
        for name, (_, fn, _) in rows.items():
            timings[name].append(median_us(fn, 3))
    sizes = torch.tensor(
        [r[0] or 0 for r in rows.values()] + [shard_bytes(model), shard_bytes(model, True)],
        dtype=torch.int64,
    )
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        ntrain = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(
            f"torch {torch.__version__}, {world} gloo ranks, 1 thread each; GPT-2 "
            f"{args.layers}x768 + LoRA r=8, FSDP2 (each block and the root): "
            f"{total / 1e6:.1f}M parameters, {ntrain / 1e6:.3f}M trainable; per rank (largest): "
            f"model shards {int(sizes[-2]) / MIB:.2f} MiB, adapter shards "
            f"{int(sizes[-1]) / MIB:.2f} MiB"
        )
        floor = statistics.median(timings[next(reversed(timings))])
        print("\n| contender | EMA memory per rank (MiB) | update (µs) | vs floor | build (s) |")
        print("|---|---:|---:|---:|---:|")
        for i, (name, (nbytes, _, build)) in enumerate(rows.items()):
            mem = "-" if nbytes is None else f"{int(sizes[i]) / MIB:.2f}"
            t = statistics.median(timings[name])
            b = "-" if build is None else f"{build:.2f}"
            print(f"| {name} | {mem} | {t:.0f} | {t / floor:.2f}x | {b} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
