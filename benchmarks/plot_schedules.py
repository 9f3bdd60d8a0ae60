"""Plot every schedule in ``emakit.schedules`` into ``docs/schedules.png`` and print the
step at which each reaches 0.999 and 0.9999 (the numbers quoted in ``docs/schedules.md``).

Left panel: decay against the optimizer step ``t`` (log axis, so the warm-ups show).
Right panel: ``1 - decay``, the weight of the newest model, against ``t`` on log-log
axes; a decay ``beta`` averages over about ``1 / (1 - beta)`` steps, so this is the
inverse of the averaging horizon.

Usage::

    python benchmarks/plot_schedules.py [--out docs/schedules.png]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from emakit import schedules as S

ROOT = Path(__file__).resolve().parent.parent

# (label, schedule, line style); arguments chosen to show each shape on a 1M-step axis
SCHEDULES: list[tuple[str, Callable[[int], float], str]] = [
    ("constant(0.999)", S.constant(0.999), "-"),
    ("inverse_gamma(power=2/3), default", S.inverse_gamma(beta=0.9999, power=2 / 3), "-"),
    ("inverse_gamma(power=3/4)", S.inverse_gamma(beta=0.9999, power=3 / 4), "-"),
    ("linear_warmup(0.999, warmup=2000)", S.linear_warmup(0.999, 2000), "--"),
    ("torch_ema_warmup(0.9999)", S.torch_ema_warmup(0.9999), "--"),
    ("half_life(6931) ~ 0.9999/step", S.half_life(6931), ":"),
    ("linear_ramp(0.9, 0.999, 10k)", S.linear_ramp(0.9, 0.999, 10_000), "-."),
    ("cosine_momentum(0.996, 100k)", S.cosine_momentum(0.996, 100_000), "-."),
    ("power_function(γ=6.94), σ_rel 0.10", S.power_function(6.94), "--"),
    ("power_function(γ=16.97), σ_rel 0.05", S.power_function(16.97), "--"),
    ("cumulative_average() (SWA)", S.cumulative_average(), ":"),
]


def first_step_reaching(schedule: Callable[[int], float], target: float, hi: int = 10**9) -> int:
    """The first ``t`` with ``schedule(t) >= target`` (binary search: the schedules here are
    non-decreasing in ``t``); -1 if it never gets there by ``hi``."""
    if schedule(hi) < target:
        return -1
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if schedule(mid) < target:
            lo = mid + 1
        else:
            hi = mid
    return lo


def print_horizons() -> None:
    print("first optimizer step t at which the decay reaches a target (inv_gamma=1, no ceiling)")
    print(f"{'schedule':42s} {'0.999':>12s} {'0.9999':>12s}")
    rows = [
        ("inverse_gamma(power=2/3)", S.inverse_gamma(beta=1.0, power=2 / 3)),
        ("inverse_gamma(power=3/4)", S.inverse_gamma(beta=1.0, power=3 / 4)),
        ("torch_ema_warmup", S.torch_ema_warmup(1.0)),
        ("power_function(γ=6.94)", S.power_function(6.94)),
        ("power_function(γ=16.97)", S.power_function(16.97)),
        ("cumulative_average", S.cumulative_average()),
    ]
    for name, s in rows:
        a, b = first_step_reaching(s, 0.999), first_step_reaching(s, 0.9999)
        print(f"{name:42s} {a:>12,d} {b:>12,d}")
    for power in (2 / 3, 3 / 4):
        exact = [(1 - target) ** (-1 / power) - 1 for target in (0.999, 0.9999)]
        print(f"closed form (1 - d)^(-1/p) - 1, p={power:.4f}: {exact[0]:,.1f}  {exact[1]:,.1f}")
    for beta in (0.99, 0.999, 0.9999):
        print(
            f"beta={beta}: horizon 1/(1-beta) = {1 / (1 - beta):,.0f} steps, "
            f"half-life ln2/-ln(beta) = {math.log(2) / -math.log(beta):,.1f} steps"
        )


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.unique(np.logspace(0, 6, 600).astype(np.int64))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.8), constrained_layout=True)
    colors = [*plt.get_cmap("tab10").colors, "black"]
    for i, (label, s, style) in enumerate(SCHEDULES):
        d = np.array([s(int(k)) for k in t])
        color = colors[i % len(colors)]
        left.plot(t, d, style, color=color, lw=1.8, label=label)
        right.plot(t, np.clip(1 - d, 1e-7, None), style, color=color, lw=1.8, label=label)
    left.set_xscale("log")
    left.set_xlabel("optimizer steps since averaging began, t")
    left.set_ylabel("decay")
    left.set_title("decay vs step (update_every=1, log step axis)")
    left.set_ylim(0, 1.02)
    left.grid(True, which="both", alpha=0.3)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("optimizer steps since averaging began, t")
    right.set_ylabel("1 - decay  (~ 1 / averaging horizon)")
    right.set_title("1 - decay vs step, log-log (1e-7: decay 1, frozen)")
    right.set_ylim(1e-7, 1.5)
    for target in (1e-3, 1e-4):
        right.axhline(target, color="grey", lw=0.8, alpha=0.6)
        right.annotate(
            f"decay {1 - target:g}",
            (1.2, target),
            va="bottom",
            fontsize=8,
            color="grey",
        )
    right.grid(True, which="both", alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=9, frameon=False)
    fig.suptitle("emakit.schedules")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "schedules.png")
    args = parser.parse_args()
    print_horizons()
    plot(args.out)


if __name__ == "__main__":
    main()
