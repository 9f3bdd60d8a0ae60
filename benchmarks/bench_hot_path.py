"""The hot path alone: emakit's default update vs a bare ``torch._foreach_lerp_`` over the
same tensors, and the flattened update vs the flat floor, on the 1200-tensor model.

Usage::

    python benchmarks/bench_hot_path.py [--runs 3]

The four contenders of ``bench_update.py`` that these targets compare, interleaved in one
process (torch single-threaded, the order reversed on every other repeat, as there),
repeated ``--runs`` times; prints the ratios of each run.
Where many tiny tensors make the Python work per update visible, this is the quick check
that a change to the update path did not add to it. Asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as B


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [B.EMAKIT_DEFAULT, B.BARE_FOREACH, B.EMAKIT_FLAT, B.FLOOR]
    for run in range(args.runs):
        torch.manual_seed(0)
        model = B.tiny_1200()
        fns = {n: B.CONTENDERS[n](model) for n in names}
        stats = {
            n: t.summary()
            for n, t in B.time_side_by_side(fns, repeats=30, sample_s=0.02, warmup=5).items()
        }
        med = {n: stats[n]["median_us"] for n in names}
        print(
            f"run {run + 1}: default {med[B.EMAKIT_DEFAULT]:.1f} us / bare foreach "
            f"{med[B.BARE_FOREACH]:.1f} us = {med[B.EMAKIT_DEFAULT] / med[B.BARE_FOREACH]:.3f}x;"
            f" flattened {med[B.EMAKIT_FLAT]:.1f} us / floor {med[B.FLOOR]:.1f} us = "
            f"{med[B.EMAKIT_FLAT] / med[B.FLOOR]:.3f}x"
        )


if __name__ == "__main__":
    main()
