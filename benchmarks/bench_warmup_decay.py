"""Ways to compute ema-pytorch's default warm-up decay, bit for bit, side by side.

Usage::

    python benchmarks/bench_warmup_decay.py [--rounds 41] [--calls 2000]

ema-pytorch 0.8.3 computes ``clamp(1 - (1 + t / inv_gamma) ** -power, min_value, beta)``
on a 0-dim float32 tensor and ``.item()``s it, once per averaging update. Each way below
is checked against that expression over warm-up and large steps first (they must give the
same bits), then timed in one process: ``--rounds`` alternated rounds of ``--calls`` calls
each (``t = 1 .. calls``), CPU time of this thread, median per call in µs. The ways:

* ``emakit``: what the default schedule runs (`emakit.schedules.inverse_gamma`: numpy
  scalars of torch's default dtype, torch's pow-kernel choices);
* ``torch, ema-pytorch's expression``: its operators on a fresh 0-dim tensor;
* ``torch functions``: the same ops through ``torch.div``/``add``/``pow``/``rsub``;
* ``torch in place``: one reused 0-dim tensor, in-place ops;
* ``struct rounding``: Python floats rounded to float32 through ``struct`` after every
  op (what emakit did before, behind a per-setting self-check).

Asserts only the bits; the machine may be shared, so read the differences.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import struct
import time
from collections.abc import Callable

import torch

from emakit import schedules

BETA, INV_GAMMA, POWER, MIN_VALUE = 0.9999, 1.0, 2 / 3, 0.0
_F32 = struct.Struct("<f")


def ema_pytorch(t: int) -> float:
    """ema-pytorch's expression: an int64 step clamped with a float, then its operators."""
    epoch = torch.tensor(t).clamp(min=0.0)
    value = 1 - (1 + epoch / INV_GAMMA) ** -POWER
    return value.clamp(min=MIN_VALUE, max=BETA).item()


def torch_functions(t: int) -> float:
    epoch = torch.tensor(float(t))
    value = torch.rsub(torch.pow(torch.add(torch.div(epoch, INV_GAMMA), 1), -POWER), 1)
    return value.clamp(MIN_VALUE, BETA).item()


_BUFFER = torch.zeros(())


def torch_in_place(t: int) -> float:
    b = _BUFFER.fill_(float(t))
    return b.div_(INV_GAMMA).add_(1).pow_(-POWER).neg_().add_(1).clamp_(MIN_VALUE, BETA).item()


def _f32(x: float) -> float:
    return _F32.unpack(_F32.pack(x))[0]


def struct_rounding(t: int) -> float:
    base = _f32(_f32(_f32(float(t)) / _f32(INV_GAMMA)) + 1.0)
    value = _f32(1.0 - _f32(math.pow(base, -POWER)))
    return min(max(value, _f32(MIN_VALUE)), _f32(BETA))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ways: dict[str, Callable[[int], float]] = {
        "emakit": schedules.inverse_gamma(BETA, INV_GAMMA, POWER, MIN_VALUE),
        "torch, ema-pytorch's expression": ema_pytorch,
        "torch functions": torch_functions,
        "torch in place": torch_in_place,
        "struct rounding": struct_rounding,
    }
    rng = random.Random(0)
    for t in [*range(1, 500), *(rng.randint(500, 1 << 26) for _ in range(500))]:
        for name, way in ways.items():
            assert way(t) == ema_pytorch(t), (name, t)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in ways if r % 2 == 0 else reversed(ways):
            way = ways[name]
            start = time.thread_time_ns()
            for t in range(1, args.calls + 1):
                way(t)
            times[name].append((time.thread_time_ns() - start) / args.calls / 1000)
    base = statistics.median(times["emakit"])
    print(f"µs per call, median of {args.rounds} rounds of {args.calls} (thread CPU time)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:32s} {median:6.2f}   ({median - base:+.2f} against emakit)")


if __name__ == "__main__":
    main()
