"""Post-hoc EMA synthesis memory: about one model, however many snapshots.

A model of ``--params`` float32 parameters is tracked by a two-profile ``PostHocEMA``
(sigma_rels 0.05 and 0.28, float16 snapshots). Snapshots are written for 2, 8 and 16
checkpoints (4, 16 and 32 snapshots), and each folder is synthesized for
``sigma_rel=0.1`` in a fresh Python process, which reports:

* **peak extra RSS**: the process's peak resident set size during synthesis (the
  kernel's ``VmHWM``, reset just before) minus its resident set size just before (after
  ``import torch, emakit`` and a warm-up). It counts the float32 accumulator, the tensor
  being read and its float32 copy, and the pages of the one snapshot file mapped at a time.
* **time**: wall time of the synthesis.

For contrast, the same folders are summed the naive way (load every snapshot, then sum),
whose memory grows with the number of snapshots. Each point is the median of
``--repeats`` fresh processes.

Usage::

    python benchmarks/bench_posthoc_memory.py [--params 4194304] [--counts 4,16,32]
        [--repeats 3] [--write-docs docs/posthoc.md]

``--write-docs`` replaces the block between ``<!-- bench-posthoc-memory:start -->`` and
``<!-- bench-posthoc-memory:end -->`` in that file with the table. This file is a script,
not a test; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = "<!-- bench-posthoc-memory:start -->"
END = "<!-- bench-posthoc-memory:end -->"


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib() -> float:
    return _status("VmRSS")


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0), so the
    peak measured afterwards is the synthesis's, not that of ``import torch``."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux: fall back to the lifetime peak
        pass


def peak_mib() -> float:
    hwm = _status("VmHWM")
    if hwm == hwm:  # not NaN
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(folder: str, mode: str) -> None:
    """Run one synthesis in this (fresh) process and print its numbers as JSON."""
    import torch
    from safetensors.torch import load_file

    from emakit.posthoc import plan_synthesis

    torch.set_num_threads(1)
    plan = plan_synthesis(folder, sigma_rel=0.1)
    # Warm up: the first call of each torch/safetensors routine maps code pages into the
    # process, which would otherwise be counted as memory the synthesis uses.
    from safetensors import safe_open

    with safe_open(str(plan.snapshots[0].path), framework="pt") as f:
        small = min(f.keys(), key=lambda k: f.get_slice(k).get_shape())
        x = f.get_tensor(small)
    torch.zeros(x.shape).add_(x.to(torch.float32), alpha=0.5)
    del x
    reset_peak()
    before = rss_mib()
    start = time.perf_counter()
    if mode == "stream":
        state = plan.run()
    else:  # naive: every snapshot in memory, then the weighted sum
        loaded = [load_file(str(s.path)) for s in plan.snapshots]
        state = {
            name: sum(w * sd[name].float() for w, sd in zip(plan.weights, loaded, strict=True))
            for name in loaded[0]
            if name not in plan.buffers_from.copied
        }
    seconds = time.perf_counter() - start
    peak = peak_mib()
    print(
        json.dumps(
            {
                "snapshots": len(plan.snapshots),
                "extra_mib": peak - before,
                "seconds": seconds,
                "tensors": len(state),
            }
        )
    )


def make_folder(root: Path, params: int, checkpoints: int) -> tuple[Path, int]:
    """A snapshot folder with ``checkpoints`` steps x 2 profiles."""
    import torch
    from torch import nn

    from emakit.posthoc import PostHocEMA

    torch.manual_seed(0)
    width = 1024
    depth = max(1, params // (width * width))
    net = nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))
    folder = root / f"n{checkpoints * 2}"
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps="manual",
        checkpoint_folder=folder,
    )
    with torch.no_grad():
        for _ in range(checkpoints):
            for p in net.parameters():
                p.add_(torch.randn_like(p), alpha=1e-2)
            ema.update()
            ema.checkpoint()
    return folder, sum(p.numel() for p in net.parameters())


def run_child(folder: Path, mode: str) -> dict:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), "--mode", mode],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def median_run(folder: Path, mode: str, repeats: int) -> dict:
    """Median (by peak memory) of ``repeats`` fresh-process runs: when the kernel drops a
    snapshot's mapped pages varies a little from run to run."""
    runs = sorted((run_child(folder, mode) for _ in range(repeats)), key=lambda r: r["extra_mib"])
    return runs[len(runs) // 2]


def table(params: int, rows: list[tuple[int, dict, dict]]) -> str:
    model_mib = params * 4 / 2**20
    lines = [
        f"Model: {params:,} float32 parameters ({model_mib:.1f} MiB); float16 snapshots of "
        f"two profiles; synthesis of sigma_rel=0.1 at the last step; "
        f"{platform.system()} {platform.machine()}, Python {platform.python_version()}.",
        "",
        "| snapshots | on disk | streamed: peak extra RSS | streamed: time | "
        "load-all-then-sum: peak extra RSS |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, stream, naive in rows:
        disk = n * params * 2 / 2**20
        lines.append(
            f"| {n} | {disk:.0f} MiB | {stream['extra_mib']:.0f} MiB "
            f"({stream['extra_mib'] / model_mib:.2f} x model) | {stream['seconds']:.2f} s | "
            f"{naive['extra_mib']:.0f} MiB ({naive['extra_mib'] / model_mib:.2f} x model) |"
        )
    return "\n".join(lines)


def write_docs(path: Path, text: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from emakit._files.atomic import atomic_write_bytes

    doc = path.read_text()
    if START not in doc or END not in doc:
        raise SystemExit(f"{path} has no {START} ... {END} block to replace")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(path, f"{head}{START}\n{text}\n{END}{tail}".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--counts", default="4,16,32", help="snapshot counts (even)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    parser.add_argument("--write-docs", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="stream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.mode)
        return
    counts = [int(c) for c in args.counts.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-posthoc-"))
    try:
        rows = []
        for n in counts:
            folder, params = make_folder(root, args.params, n // 2)
            stream = median_run(folder, "stream", args.repeats)
            naive = median_run(folder, "naive", args.repeats)
            rows.append((stream["snapshots"], stream, naive))
            shutil.rmtree(folder)
        text = table(params, rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(text)
    if args.write_docs is not None:
        write_docs(args.write_docs, text)
        print(f"\nwrote the table into {args.write_docs}")


if __name__ == "__main__":
    main()
