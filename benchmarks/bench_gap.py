"""The default path against a bare ``torch._foreach_lerp_`` over the EMA's *own* tensors.

Usage::

    python benchmarks/bench_gap.py [--rounds 120] [--model tiny|transformer]

On 1,200 small tensors (300 x ``Linear(64, 64)`` + ``LayerNorm(64)``): ``ema.update()``
(``update_after_step=0, update_every=1``, so every call averages) against
``torch._foreach_lerp_(shadows, onlines, w)`` over the very shadow and online tensors the
EMA's plan holds (the same memory, so cache effects are the same), and against the same
bare call over the online Parameters themselves (not detached) under ``no_grad`` (how the
plan called it before) and under inference mode (how it calls it now). CPU time
of this thread (``time.thread_time``: torch is single-threaded), ``--rounds`` alternated
rounds of a batch each (the order reversed every other round); prints the median per call
and the ratios. Asserts nothing; the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_update as B
from emakit import EMA


def contenders(model: torch.nn.Module) -> dict[str, Callable[[], None]]:
    """``update()`` and the bare kernel over the EMA's own tensors."""
    ema = EMA(model, beta=B.BETA, update_after_step=0, update_every=1)
    ema.update()
    plan = ema.tracker.plan()
    shadows = [p.shadow for p in plan.pairs if p.average]
    onlines = [p.online for p in plan.pairs if p.average]
    detached = [t.detach() for t in onlines]
    w = 1.0 - B.BETA

    def bare() -> None:
        torch._foreach_lerp_(shadows, detached, w)

    def bare_no_grad() -> None:
        with torch.no_grad():
            torch._foreach_lerp_(shadows, onlines, w)

    def bare_inference() -> None:
        with torch._C._InferenceMode(True):
            torch._foreach_lerp_(shadows, onlines, w)

    return {
        "update()": ema.update,
        "bare, own tensors": bare,
        "bare, no_grad, Parameters": bare_no_grad,
        "bare, inference, Parameters": bare_inference,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--model", choices=("tiny", "transformer"), default="tiny")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = B.tiny_1200() if args.model == "tiny" else B.transformer()
    fns = contenders(model)
    for fn in fns.values():
        for _ in range(20):
            fn()
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    order = list(fns.items())
    for r in range(args.rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            t = time.thread_time()
            for _ in range(args.batch):
                fn()
            cpu[name].append((time.thread_time() - t) / args.batch * 1e6)
    med = {n: statistics.median(v) for n, v in cpu.items()}
    base = med["bare, own tensors"]
    for n, m in med.items():
        print(f"{n:28s} {m:9.1f} us CPU median  {m / base:.3f}x")


if __name__ == "__main__":
    main()
