"""MultiEMA (two betas, one pass) vs two separate EMA objects, per update() call, on CPU.

Usage: python benchmarks/bench_multi.py [--repeats R]
Contenders run interleaved, round-robin, in one process; the median per call is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from emakit import EMA, MultiEMA, flatten_parameters


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "1200 tiny tensors": nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(300)]
        ),
        "transformer 12x384": nn.TransformerEncoder(
            nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True), 12
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kw = dict(update_after_step=0, update_every=1)
    print(f"torch {torch.__version__}, 1 thread; median µs per update() of both EMAs")
    print(f"{'model':<22}{'2 x EMA':>12}{'MultiEMA':>12}{'speed-up':>10}")
    for name, model in models().items():
        for flat in (False, True):
            m = model
            if flat:
                flatten_parameters(m)
            two = [EMA(m, beta=0.999, **kw), EMA(m, beta=0.9999, **kw)]
            multi = MultiEMA(m, betas=(0.999, 0.9999), **kw)
            for u in (*two, multi):
                u.update()
                u.update()
            times: dict[str, list[float]] = {"two": [], "multi": []}
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for e in two:
                    e.update()
                times["two"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                multi.update()
                times["multi"].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k]) * 1e6 for k in ("two", "multi"))
            label = name + (" (flat)" if flat else "")
            print(f"{label:<22}{a:>12.0f}{b:>12.0f}{a / b:>9.2f}x")


if __name__ == "__main__":
    main()
