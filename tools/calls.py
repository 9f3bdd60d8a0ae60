"""The Python calls of one plain averaging ``EMA.update()``, listed in order.

Usage: python tools/calls.py [--skip-nonfinite] [--modules N]

Counts with ``sys.setprofile`` every Python function entered during one update of an EMA of
``N x Linear(8, 8)`` (default 4) after warm-up (``update_after_step=0, update_every=1``);
C functions (the kernels) are not counted. ``tests/test_hot_path.py`` holds the count.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch import nn

from emakit import EMA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-nonfinite", action="store_true", help="skip_nonfinite=True")
    parser.add_argument("--modules", type=int, default=4, help="Linear(8, 8) layers (default 4)")
    args = parser.parse_args()
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(args.modules)])
    ema = EMA(
        net, beta=0.99, update_after_step=0, update_every=1, skip_nonfinite=args.skip_nonfinite
    )
    for _ in range(5):
        ema.update()
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename.replace("\\", "/")
            calls.append((path.split("site-packages/")[-1].split("src/")[-1], frame.f_code.co_name))

    sys.setprofile(profile)
    ema.update()
    sys.setprofile(None)
    files = collections.Counter(f for f, _ in calls)
    print(f"{len(calls)} Python calls in {len(files)} files (torch {torch.__version__})")
    for path, name in calls:
        print(f"  {path}: {name}")


if __name__ == "__main__":
    main()
