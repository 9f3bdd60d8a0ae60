"""Diffusion-style post-hoc EMA: choose the EMA length after training, by a sweep.

Trains a small denoiser (it predicts the noise added to 2-D points at a random noise
level, the training objective of diffusion models) with a high learning rate, tracks a
``PostHocEMA`` with two profiles (sigma_rel 0.05 and 0.28) that writes snapshots, and
after training calls ``PostHocEMA.sweep``: it synthesizes the EMA at a range of lengths
in one pass over the snapshots, scores each on held-out data (denoising loss at fixed
noise levels) and plots the validation loss against the EMA length, the way the EMA
length of a diffusion model is chosen (Karras et al. 2024, arXiv:2312.02696, Fig. 1 / §3).

    python examples/posthoc_sweep.py --steps 1500 --plot sweep.png
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch
from torch import nn

from emakit import PostHocEMA
from emakit.posthoc import sweep_lengths

TRACKED = (0.05, 0.28)


def sample_data(n: int, g: torch.Generator) -> torch.Tensor:
    """Points on three rings of radius 1, 2 and 3 (a toy image distribution)."""
    radius = torch.randint(1, 4, (n, 1), generator=g).float()
    angle = torch.rand(n, 1, generator=g) * 2 * math.pi
    ring = torch.cat([angle.cos(), angle.sin()], 1) * radius
    return ring + 0.05 * torch.randn(n, 2, generator=g)


def make_denoiser() -> nn.Module:
    """Input: a noisy point and its log noise level; output: the predicted noise."""
    return nn.Sequential(
        nn.Linear(3, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 2)
    )


def denoising_loss(
    model: nn.Module, x0: torch.Tensor, sigma: torch.Tensor, eps: torch.Tensor
) -> torch.Tensor:
    x = x0 + sigma * eps
    return (model(torch.cat([x, sigma.log()], 1)) - eps).pow(2).mean()


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--points", type=int, default=12, help="EMA lengths in the sweep")
    parser.add_argument("--plot", type=Path, default=None, help="write the sweep as a PNG")
    parser.add_argument("--snapshots", type=Path, default=None, help="snapshot folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and noise)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = make_denoiser()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.snapshots or Path(tmp) / "post-hoc-ema"
        posthoc = PostHocEMA(
            net,
            sigma_rels=TRACKED,
            update_every=1,
            checkpoint_every_num_steps=max(1, args.steps // 20),  # 20 snapshots per profile
            checkpoint_folder=folder,
        )
        for _ in range(args.steps):
            x0 = sample_data(64, g)
            sigma = torch.exp(torch.randn(64, 1, generator=g) * 1.2 - 1.0)  # log-normal levels
            loss = denoising_loss(net, x0, sigma, torch.randn(64, 2, generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            posthoc.update()
        if not any(s.step == args.steps for s in posthoc.snapshots()):
            posthoc.checkpoint()  # synthesize at the last step

        # Held-out: fixed points, noise levels and noise, scored for every candidate.
        gv = torch.Generator().manual_seed(123)
        x0 = sample_data(4096, gv)
        sigma = torch.exp(torch.randn(4096, 1, generator=gv) * 1.2 - 1.0)
        eps = torch.randn(4096, 2, generator=gv)
        with torch.no_grad():
            online = denoising_loss(net.eval(), x0, sigma, eps).item()
        # The sweep: every length synthesized in one pass over the snapshots, each scored.
        result = posthoc.sweep(
            lambda ema_model: denoising_loss(ema_model, x0, sigma, eps).item(),
            sigma_rels=sweep_lengths(f"{TRACKED[0]}:{TRACKED[1]}:{args.points}"),
        )
    print(f"online weights: validation loss {online:.4f}")
    print(result.table())
    if args.plot is not None:
        result.plot(args.plot, ylabel="validation denoising loss")
        print(f"wrote {args.plot}")
    return {"online": online, "sweep": dict(result), "best": result.best[0]}


if __name__ == "__main__":
    main()
