"""The cost of ``skip_nonfinite=True`` on the CPU: one averaging ``update()`` with and without.

Usage::

    python benchmarks/bench_skip_nonfinite.py [--rounds 40] [--batch 10]

For two models (300 x ``Linear(64, 64)`` + ``LayerNorm(64)``: 1200 small tensors; 6 x
``Linear(2048, 2048)``: 12 large ones) and two paths (the default, ``use_foreach=True``),
a plain EMA and a guarded one of the same model (``update_after_step=0, update_every=1``,
so every call averages) are timed side by side: ``--rounds`` alternated rounds of
``--batch`` calls each (the order reversed every other round), CPU time of this thread
(``time.thread_time``; torch runs on one thread), the median per call. To compare with an
older emakit, run the script with ``PYTHONPATH`` pointing at that version's ``src``. A
script, not a test: it asserts nothing; the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from emakit import EMA


def per_call_us(model: nn.Module, rounds: int, batch: int, **kw: object) -> tuple[float, float]:
    """Median CPU microseconds per averaging call: ``(plain, skip_nonfinite=True)``."""
    emas = [
        EMA(model, update_after_step=0, update_every=1, skip_nonfinite=skip, **kw)
        for skip in (False, True)
    ]
    for ema in emas:
        for _ in range(5):
            ema.update()
    samples: list[list[float]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            start = time.thread_time()
            for _ in range(batch):
                emas[i].update()
            samples[i].append((time.thread_time() - start) / batch * 1e6)
    assert emas[1].num_skipped_nonfinite == 0
    plain, guarded = (statistics.median(s) for s in samples)
    return plain, guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
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
            plain, guarded = per_call_us(model, args.rounds, args.batch, **kw)
            print(f"| {name} | {label} | {plain:,.0f} | {guarded:,.0f} | {guarded / plain:.2f} |")


if __name__ == "__main__":
    main()
