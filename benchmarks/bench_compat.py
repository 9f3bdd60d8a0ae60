"""Per-update cost of the drop-ins in ``emakit.compat`` against their peers, side by side.

Usage::

    python benchmarks/bench_compat.py [--width 128] [--depth 40] [--calls 50] [--rounds 7]

On one model (``depth`` Linear layers of ``width``, fp32, CPU, one thread), the same
update is timed for each pair, round-robin, ``rounds`` x ``calls`` calls each:

* diffusers ``EMAModel.step(params)`` (``foreach=False``, its default, and ``True``)
  against ``emakit.compat.diffusers.EMAModel.step(params)``;
* Lightning ``EMAWeightAveraging``'s update, ``AveragedModel.update_parameters(model)``
  with ``get_ema_avg_fn(0.999)`` and ``use_buffers=True``, against the drop-in's
  ``ema.update()`` (what ``emakit.compat.lightning.EMAWeightAveraging`` calls).

Prints the minimum and median microseconds per call and the ratio to emakit's. A script,
not a test: it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def per_call(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=40)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from diffusers.training_utils import EMAModel
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from emakit import EMA, schedules
    from emakit.compat.diffusers import EMAModel as CompatEMAModel

    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.depth)))
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.depth} x Linear({args.width}): {n:,} parameters, fp32, CPU, 1 thread")
    diffusers_plain = EMAModel(model.parameters())
    diffusers_foreach = EMAModel(model.parameters(), foreach=True)
    compat = CompatEMAModel(model.parameters())
    averaged = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999), use_buffers=True)
    lightning_ema = EMA(
        model, update_after_step=0, update_every=1, schedule=schedules.constant(0.999),
        include_online_model=False,
    )  # fmt: skip
    groups = {
        "diffusers": {
            "diffusers EMAModel (foreach=False)": lambda: diffusers_plain.step(model.parameters()),
            "diffusers EMAModel (foreach=True)": lambda: diffusers_foreach.step(model.parameters()),
            "emakit.compat.diffusers.EMAModel": lambda: compat.step(model.parameters()),
        },
        "lightning": {
            "Lightning AveragedModel update": lambda: averaged.update_parameters(model),
            "emakit.compat.lightning (ema.update)": lightning_ema.update,
        },
    }
    for group, contenders in groups.items():
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for fn in contenders.values():
            per_call(fn, 5)  # warm-up: plans, first allocations
        for r in range(args.rounds):
            names = list(contenders)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                times[name].append(per_call(contenders[name], args.calls))
        ours = min(times[list(contenders)[-1]])
        print(f"\n{group}: us per update (min / median of {args.rounds}), min / emakit's min")
        for name, values in times.items():
            best = min(values)
            print(f"  {name:40s} {best:9.1f} {statistics.median(values):9.1f}  {best / ours:5.2f}x")


if __name__ == "__main__":
    main()
