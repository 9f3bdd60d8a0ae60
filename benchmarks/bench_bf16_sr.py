"""Is a bf16 EMA shadow with stochastic rounding good enough? (half the bytes of fp32)

A bf16 "model" drifts by small random steps (noisy-SGD-like, ~1e-3 relative); four
shadows track it for N updates at a constant beta: float64 (the reference), fp32, bf16 with
round-to-nearest (what a bf16 ema-pytorch shadow does) and bf16 with stochastic rounding
(the update is computed in fp32 and rounded up or down at random, in proportion to the
distance, so tiny increments survive on average). Reported: relative error
||shadow - ref|| / ||ref|| at the end, and its maximum over the run.

Usage: python benchmarks/bench_bf16_sr.py [--updates N] [--beta B] [--numel M] [--seed S]
"""

from __future__ import annotations

import argparse

import torch


def stochastic_round_bf16(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding each value up or down at random in proportion to distance."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def run(updates: int, beta: float, numel: int, seed: int) -> dict[str, tuple[float, float]]:
    gen = torch.Generator().manual_seed(seed)
    sr_gen = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(numel, generator=gen).to(torch.bfloat16)
    ref = w.double()
    shadows = {"fp32": w.float(), "bf16 nearest": w.clone(), "bf16 stochastic": w.clone()}
    worst = dict.fromkeys(shadows, 0.0)
    weight = 1.0 - beta
    for i in range(updates):
        step = torch.randn(numel, generator=gen) * 1e-3 * w.float().abs().clamp_min(1e-2)
        w = (w.float() + step).to(torch.bfloat16)
        ref.lerp_(w.double(), weight)
        shadows["fp32"].lerp_(w.float(), weight)
        shadows["bf16 nearest"].lerp_(w, weight)
        s = shadows["bf16 stochastic"].float()
        shadows["bf16 stochastic"] = stochastic_round_bf16(s.lerp_(w.float(), weight), sr_gen)
        if i % 100 == 99 or i == updates - 1:
            for k, v in shadows.items():
                err = ((v.double() - ref).norm() / ref.norm()).item()
                worst[k] = max(worst[k], err)
    return {
        k: (((v.double() - ref).norm() / ref.norm()).item(), worst[k]) for k, v in shadows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--beta", type=float, default=0.9999)
    parser.add_argument("--numel", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    res = run(args.updates, args.beta, args.numel, args.seed)
    print(
        f"{args.updates} updates at beta {args.beta}, {args.numel} weights; relative error vs float64"
    )
    print(f"{'shadow':<18}{'final':>12}{'max over run':>14}")
    for k, (final, worst) in res.items():
        print(f"{k:<18}{final:>12.2e}{worst:>14.2e}")


if __name__ == "__main__":
    main()
