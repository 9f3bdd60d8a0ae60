"""Post-hoc EMA of a sharded model: memory and traffic per rank, measured.

A model of ``--params`` float32 parameters (Linear layers of 4096 x 4096) is sharded with
FSDP2 over ``--world`` gloo ranks (CPU, forked from this process) and tracked by a
two-profile ``PostHocEMA`` (float16 snapshots). After ``--steps`` snapshot steps (two
snapshots each) it measures, per rank:

* **snapshot**: peak extra RSS while ``checkpoint()`` writes the rank's shard files (the
  kernel's ``VmHWM``, reset just before, minus the RSS just before), its time, and the
  bytes the rank received in collectives (the agreement, the run id, the outcomes);
* **synthesis on the ranks** (``synthesize_ema_model(sigma_rel=0.1)``, all snapshots):
  peak extra RSS and time;
* **full export** (``save_full_ema_weights`` of one profile): bytes received per rank by
  the gather to rank 0, next to the all-gather it replaced (the same tensors through
  ``_files.export.full_tensor``), measured in the same run;

then the synthesis **in one process** (``synthesize_state_dict``, a fresh process) and **on
``--world // 2`` ranks** (resharded) from the same folder. Bytes received are counted by
wrapping ``torch.distributed``'s ``gather``, ``all_gather``, ``all_gather_into_tensor``
and ``broadcast_object_list`` (tensor bytes arriving from other ranks).

Usage::

    python benchmarks/bench_posthoc_sharded.py [--params 67108864] [--steps 16] [--world 4]

This file is a script, not a test; it asserts nothing. It prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_posthoc_memory import peak_mib, rss_mib  # this folder is sys.path[0]
from bench_posthoc_memory import reset_peak as clear_peak

WIDTH = 4096


def reset_peak() -> float:
    """Reset VmHWM to the current RSS; return the RSS (MiB)."""
    clear_peak()
    return rss_mib()


def peak() -> float:
    """The peak RSS (MiB) since the last `reset_peak()`."""
    return peak_mib()


class Received:
    """Tensor bytes this rank receives from other ranks in torch.distributed calls."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = 0
        self.dist = dist
        names = ("gather", "all_gather", "all_gather_into_tensor", "all_gather_single")
        self.real = {
            n: getattr(dist, n) for n in (*names, "broadcast_object_list") if hasattr(dist, n)
        }

        def gather(tensor, gather_list=None, *a, **k):
            if gather_list is not None:
                self.bytes += tensor.nbytes * (len(gather_list) - 1)
            return self.real["gather"](tensor, gather_list, *a, **k)

        def all_gather(tensors, tensor, *a, **k):
            self.bytes += tensor.nbytes * (len(tensors) - 1)
            return self.real["all_gather"](tensors, tensor, *a, **k)

        def all_gather_into_tensor(out, tensor, *a, **k):
            self.bytes += out.nbytes - tensor.nbytes
            return self.real["all_gather_into_tensor"](out, tensor, *a, **k)

        def all_gather_single(out, tensor, *a, **k):
            self.bytes += out.nbytes - tensor.nbytes
            return self.real["all_gather_single"](out, tensor, *a, **k)

        def broadcast_object_list(objects, *a, **k):
            result = self.real["broadcast_object_list"](objects, *a, **k)
            if dist.get_rank() != k.get("src", a[0] if a else 0):
                self.bytes += len(json.dumps([str(o) for o in objects]))
            return result

        self.wrappers = {
            "gather": gather,
            "all_gather": all_gather,
            "all_gather_into_tensor": all_gather_into_tensor,
            "all_gather_single": all_gather_single,
            "broadcast_object_list": broadcast_object_list,
        }
        self.wrappers = {n: f for n, f in self.wrappers.items() if n in self.real}

    def __enter__(self) -> Received:
        for n, f in self.wrappers.items():
            setattr(self.dist, n, f)
        return self

    def __exit__(self, *exc: object) -> None:
        for n, f in self.real.items():
            setattr(self.dist, n, f)


def build(params: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    depth = max(1, params // (WIDTH * WIDTH))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(depth)))


def shard(model: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def write_job(rank: int, world: int, args: argparse.Namespace, folder: Path) -> dict:
    import warnings

    import torch

    import emakit._files.export as export
    from emakit import PostHocEMA
    from emakit.distributed import local_tensor, save_full_ema_weights

    warnings.simplefilter("ignore")
    model = shard(build(args.params), world)
    ema = PostHocEMA(
        model,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=folder,
        run_id="bench",
    )
    res: dict[str, Any] = {"snap_mib": [], "snap_s": [], "snap_bytes": []}
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        with torch.no_grad():
            for p in model.parameters():
                local = local_tensor(p)
                local.add_(torch.randn(local.shape, generator=g), alpha=0.01)
        ema.update()
        before = reset_peak()
        start = time.perf_counter()
        with Received() as got:
            ema.checkpoint()
        res["snap_s"].append(time.perf_counter() - start)
        res["snap_mib"].append(peak() - before)
        res["snap_bytes"].append(got.bytes)
    res["shard_mib"] = sum(local_tensor(p).nbytes for p in model.parameters()) / 2**20
    res.update(read_job(rank, world, args, folder))
    profile = ema.profiles[0]
    with Received() as got:
        save_full_ema_weights(profile, folder.parent / "full.safetensors", dtype=torch.bfloat16)
    res["export_bytes"] = got.bytes
    with Received() as got:  # the all-gather the export used before: the same tensors
        for t in profile.ema_model.state_dict().values():
            full = export.full_tensor(t, torch.bfloat16)
            del full
    res["allgather_bytes"] = got.bytes
    return res


def read_job(rank: int, world: int, args: argparse.Namespace, folder: Path) -> dict:
    """Synthesis on the ranks: the EMA model built (as synthesize_ema_model builds it),
    then the snapshots streamed into its shards; each step's peak measured apart."""
    import warnings

    import torch

    from emakit.posthoc import KarrasEMA
    from emakit.posthoc.synthesis.plan import load_into, plan_synthesis, region_args

    warnings.simplefilter("ignore")
    model = shard(build(args.params), world)
    before = reset_peak()
    start = time.perf_counter()
    target = KarrasEMA(model, sigma_rel=0.1, update_every=1).ema_model
    built_mib = peak() - before
    plan = plan_synthesis(folder, sigma_rel=0.1, run="bench")
    before = reset_peak()
    start = time.perf_counter()
    load_into(target, plan.run(dtype=torch.float32, **region_args(target)))
    return {
        "synth_s": time.perf_counter() - start,
        "synth_mib": peak() - before,
        "build_mib": built_mib,
    }


def _entry(job: Any, rank: int, world: int, port: int, args: Any, folder: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=1800),
    )
    result = job(rank, world, args, folder)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def launch(job: Any, world: int, args: argparse.Namespace, folder: Path) -> list[dict]:
    import torch._dynamo  # fully_shard imports it: once, before forking
    import torch.distributed.fsdp  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp())
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_entry, args=(job, r, world, port, args, folder, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def one_process(folder: Path) -> dict:
    code = f"""
import json, sys, time, warnings
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench_posthoc_sharded import reset_peak, peak
import torch
from emakit.posthoc import synthesize_state_dict, plan_synthesis
warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.zeros(4).add_(torch.ones(4, dtype=torch.float16), alpha=0.5)
plan = plan_synthesis({str(folder)!r}, sigma_rel=0.1)
before = reset_peak()
start = time.perf_counter()
state = plan.run()
print(json.dumps({{"synth_s": time.perf_counter() - start, "synth_mib": peak() - before}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4 * WIDTH * WIDTH)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    root = args.folder or Path(tempfile.mkdtemp(prefix="bench-posthoc-sharded-"))
    folder = root / "snapshots"
    model_mib = (args.params // (WIDTH * WIDTH)) * WIDTH * WIDTH * 4 / 2**20
    wrote = launch(write_job, args.world, args, folder)
    disk = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    alone = one_process(folder)
    half = launch(read_job, max(1, args.world // 2), args, folder)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(
        f"Model: {model_mib:.0f} MiB float32 ({args.params:,} parameters), FSDP2 over "
        f"{args.world} gloo ranks (CPU); {2 * args.steps} float16 snapshots "
        f"({args.steps} steps x 2 profiles), {disk:.0f} MiB on disk; synthesis of sigma_rel=0.1.\n"
    )
    print("| | rank | shard (f32) | peak extra RSS | time | bytes received |")
    print("|---|---:|---:|---:|---:|---:|")
    # synthesis rows: the EMA model built for it, then the snapshots streamed into it
    for r, w in enumerate(wrote):
        print(
            f"| snapshot (median of {args.steps}) | {r} | {w['shard_mib']:.0f} MiB | "
            f"{med(w['snap_mib']):.0f} MiB | {med(w['snap_s']):.2f} s | {med(w['snap_bytes'])} B |"
        )
    for label, rows, size in (
        (f"synthesis on {args.world} ranks", wrote, model_mib / args.world),
        (f"synthesis on {len(half)} ranks (resharded)", half, model_mib / len(half)),
    ):
        for r, w in enumerate(rows):
            print(
                f"| {label} | {r} | {size:.0f} MiB | {w['synth_mib']:.0f} MiB "
                f"(+ {w['build_mib']:.0f} MiB building the EMA model) | {w['synth_s']:.2f} s "
                f"| 0 B |"
            )
    print(
        f"| synthesis in one process | - | {model_mib:.0f} MiB | {alone['synth_mib']:.0f} MiB | {alone['synth_s']:.2f} s | - |"
    )
    print(
        "\nFull export of one profile in bf16 (`save_full_ema_weights`), bytes received per rank:\n"
    )
    print("| rank | gather to rank 0 (now) | all-gather (before) |")
    print("|---:|---:|---:|")
    for r, w in enumerate(wrote):
        print(f"| {r} | {w['export_bytes']:,} B | {w['allgather_bytes']:,} B |")


if __name__ == "__main__":
    main()
