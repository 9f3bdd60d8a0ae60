"""Rank 0's memory during a full export of an FSDP2 EMA: streamed vs gathered whole.

Usage::

    python benchmarks/bench_full_export.py [--world 2] [--blocks 6] [--dim 1024] [--rows R] [--json OUT]

The model: an embedding of ``8 * dim`` rows (the largest tensor; ``--rows 4*dim`` makes
it the size of every MLP weight, a model of many equal tensors), ``blocks`` MLP blocks
(``Linear(dim, 4 dim)``, ``Linear(4 dim, dim)``) and a LayerNorm: ``4 * blocks + 3``
tensors (27 by default, 56.7M float32 parameters, 216 MiB). It is sharded with
``fully_shard`` over ``world`` gloo ranks on the CPU, an ``EMA`` is built and updated once,
and rank 0 measures one ``save_full_ema_weights`` call. Contenders:

* ``streamed``: emakit's ``save_full_ema_weights`` (one tensor gathered, cast first, and
  written at a time);
* ``gathered``: what emakit 0.1.0 did (``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` on every rank, then rank 0 writes the whole dict), reimplemented
  here for comparison;

each with ``dtype=None`` (float32) and ``dtype=torch.bfloat16``.

How memory is measured (rank 0, around the export call only): each case runs in a fresh
Python process started with ``MALLOC_MMAP_THRESHOLD_=131072``, so glibc serves every
block over 128 KiB with its own mapping and unmaps it when freed (no dynamic threshold, no
arena keeping freed tensors): the resident set then follows the live tensor bytes. The
RSS high-water mark (``VmHWM``) is reset through ``/proc/self/clear_refs`` right before the
call, and "peak" is ``VmHWM`` after the call minus ``VmRSS`` before it. ``tracemalloc``
does not see torch's allocations and torch has no CPU allocator statistics, so the RSS is
the honest measure. (The torch profiler's memory events were tried and dropped: frees
outside an op, such as the ``del`` of a written tensor, are not all recorded, so its running
sum only grows.) Next to it, "held": the most bytes the exporter itself holds at once, by
construction: for ``streamed`` the largest gather buffer (recorded by wrapping
``emakit._files.export.tensor_for_writer``), for ``gathered`` the whole state dict.

This file is a script, not part of the test suite; it asserts nothing.
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
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MIB = 1024 * 1024


class Model(nn.Module):
    def __init__(self, blocks: int, dim: int, rows: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(rows or 8 * dim, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value, _ = line.split()
                out[key.rstrip(":")] = int(value) * 1024
    return out


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _gathered_export(ema: Any, path: Path, dtype: torch.dtype | None) -> None:
    """emakit 0.1.0's save_full_ema_weights for a sharded EMA, for comparison."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from emakit._files.atomic import atomic_path
    from emakit._files.safetensors_file import write_safetensors
    from emakit.checkpoint import weights_header

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    tensors = get_model_state_dict(ema.ema_model, options=options)
    if dist.get_rank() == 0:
        header = weights_header(ema, tensors, dtype)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            write_safetensors(f, tensors, header, dtype)
    dist.barrier()


def _rank(rank: int, port: int, args: dict, out: Path) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=args["world"],
            timeout=datetime.timedelta(seconds=600),
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import emakit._files.export as export
        from emakit import EMA
        from emakit.distributed import save_full_ema_weights

        mesh = init_device_mesh("cpu", (args["world"],))
        torch.manual_seed(0)
        model = Model(args["blocks"], args["dim"], args["rows"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ema = EMA(model, beta=0.999, update_after_step=0, update_every=1)
        ema.update()
        dtype = torch.bfloat16 if args["dtype"] == "bf16" else None
        path = out / f"ema-{args['case']}-{args['dtype']}.safetensors"
        tensors = ema.ema_model.state_dict()
        width = torch.empty(0, dtype=dtype or torch.float32).element_size()
        largest = max(t.numel() for t in tensors.values()) * width
        total = sum(t.numel() for t in tensors.values()) * width

        held = [0]
        gather = export.tensor_for_writer

        def recorded(t: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor | None:
            out = gather(t, dt)
            if out is not None and out is not t:  # a gather buffer on rank 0
                held[0] = max(held[0], out.untyped_storage().nbytes())
            return out

        export.tensor_for_writer = recorded
        dist.barrier()
        before = _status()
        _reset_hwm()
        start = time.perf_counter()
        if args["case"] == "streamed":
            save_full_ema_weights(ema, path, dtype=dtype)
        else:
            _gathered_export(ema, path, dtype)
            held[0] = sum(t.numel() * t.element_size() for t in tensors.values())  # shadow dtype
        seconds = time.perf_counter() - start
        after = _status()
        result = {
            "rss_peak": after["VmHWM"] - before["VmRSS"],
            "rss_retained": after["VmRSS"] - before["VmRSS"],
            "seconds": seconds,
            "held": held[0],
        }
        result.update(tensors=len(tensors), largest=largest, total=total, file=path.stat().st_size)
        if rank == 0:
            (out / "result.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_case(args: dict, out: Path) -> dict:
    """One case, in this (fresh) process: fork the ranks, return rank 0's numbers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, port, args, out)) for r in range(args["world"])]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    errors = sorted(out.glob("error-*.txt"))
    if errors:
        raise SystemExit("\n".join(e.read_text() for e in errors))
    return json.loads((out / "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument(
        "--rows", type=int, help="embedding rows (default 8 * dim; 4 * dim: every weight alike)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    base = {"world": ns.world, "blocks": ns.blocks, "dim": ns.dim, "rows": ns.rows}
    if ns.case:
        result = run_case({**base, "case": ns.case, "dtype": ns.dtype}, ns.out)
        print(json.dumps(result))
        return
    import tempfile

    rows = []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    for dtype in ("f32", "bf16"):
        for case in ("streamed", "gathered"):
            row: dict[str, Any] = {"case": case, "dtype": dtype}
            with tempfile.TemporaryDirectory() as folder:
                cmd = [sys.executable, __file__, "--case", case, "--dtype", dtype]
                cmd += ["--out", folder, "--world", str(ns.world)]
                cmd += ["--blocks", str(ns.blocks), "--dim", str(ns.dim)]
                cmd += ["--rows", str(ns.rows)] if ns.rows else []
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(proc.stdout + proc.stderr)
                row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print(
                f"{case:>8} {dtype:>4}: RSS peak {row['rss_peak'] / MIB:7.1f} MiB, "
                f"held {row['held'] / MIB:7.1f} MiB, retained "
                f"{row['rss_retained'] / MIB:6.1f} MiB, {row['seconds']:.2f} s | largest "
                f"tensor {row['largest'] / MIB:.1f} MiB, all {row['total'] / MIB:.1f} MiB, "
                f"{row['tensors']} tensors",
                flush=True,
            )
    print()
    print(
        "| export | dtype | rank-0 RSS peak (MiB) | x largest tensor | held (MiB) | largest "
        "tensor (MiB) | all tensors (MiB) | time (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['case']} | {r['dtype']} | {r['rss_peak'] / MIB:.1f} | "
            f"{r['rss_peak'] / r['largest']:.2f} | {r['held'] / MIB:.1f} | "
            f"{r['largest'] / MIB:.1f} | {r['total'] / MIB:.1f} | {r['seconds']:.2f} |"
        )
    if ns.json:
        ns.json.write_text(json.dumps({"args": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
