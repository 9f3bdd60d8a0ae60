"""The cost of ``skip_nonfinite=True`` on the CPU: one averaging ``update()`` with and without.

Usage::

    python benchmarks/bench_skip_nonfinite.py [--threads 1]

For two models (300 x ``Linear(64, 64)`` + ``LayerNorm(64)``: 1200 small tensors; 6 x
``Linear(2048, 2048)``: 12 large ones), the median over 7 samples of 20 back-to-back
averaging calls (``update_after_step=0, update_every=1``, after 5 warm-up calls), for the
default path and ``use_foreach=True``. To compare with an older emakit, run the script
with ``PYTHONPATH`` pointing at that version's ``src``. A script, not a test: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from emakit import EMA


def per_call_us(model: nn.Module, **kw: object) -> float:
    ema = EMA(model, update_after_step=0, update_every=1, **kw)
    for _ in range(5):
        ema.update()
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            ema.update()
        samples.append((time.perf_counter() - start) / 20 * 1e6)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        "1200 small tensors": nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(300)]
        ),
        "6 x Linear(2048)": nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(6)]),
    }
    print("| model | path | plain (µs) | skip_nonfinite (µs) | ratio |")
    print("|---|---|---:|---:|---:|")
    for name, model in models.items():
        for label, kw in (("default", {}), ("use_foreach=True", {"use_foreach": True})):
            plain = per_call_us(model, **kw)
            guarded = per_call_us(model, skip_nonfinite=True, **kw)
            print(f"| {name} | {label} | {plain:,.0f} | {guarded:,.0f} | {guarded / plain:.2f} |")


if __name__ == "__main__":
    main()
