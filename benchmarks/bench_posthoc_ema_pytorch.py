"""Accuracy of synthesis from ema-pytorch's post-hoc folders: emakit against ema-pytorch.

A Linear's 64 weights follow a known trajectory (an offset, drift, slow oscillations and a
random walk: the weights move by about their own size over training). The real
ema-pytorch 0.8.3 ``PostHocEMA`` runs over it in several configurations and writes its
``<index>.<step>.pt`` folder. Each row synthesizes ``sigma_rel`` at the last step and gives
the relative L2 distance to the exact per-step power-function EMA of the trajectory
(closed-form weights ``(s/T)^(gamma+1) - ((s-1)/T)^(gamma+1)``), for

* the raw weights at the last step,
* ema-pytorch's own ``synthesize_ema_model``,
* the nominal model: each file read as the power profile of its gamma ending at its last
  update (emakit before 0.5),
* emakit: each file read as the weights it really holds (``solve_weights_stepwise``).

Run::

    python benchmarks/bench_posthoc_ema_pytorch.py [--write-docs docs/posthoc.md]

``--write-docs`` replaces the block between ``<!-- bench-posthoc-ema-pytorch:start -->``
and ``<!-- bench-posthoc-ema-pytorch:end -->`` in that file with the table. A script, not a
test; it asserts nothing (``tests/test_posthoc_ema_pytorch_folders.py`` checks the claims).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import ema_pytorch

from emakit._files.atomic import atomic_write_bytes
from emakit.posthoc import (
    LegacyProfiles,
    PostHocWarning,
    plan_synthesis,
    sigma_rel_to_gamma,
    solve_weights,
)

START = "<!-- bench-posthoc-ema-pytorch:start -->"
END = "<!-- bench-posthoc-ema-pytorch:end -->"

#: label -> (steps, update_every, checkpoint_every_num_steps, checkpoint dtype)
CONFIGS = {
    "defaults (update_every=100, every 1000 steps, fp16)": (2000, 100, 1000, torch.float16),
    "update_every=100, every 200 steps, fp16": (2000, 100, 200, torch.float16),
    "update_every=10, every 100 steps, fp16": (2000, 10, 100, torch.float16),
    "update_every=1, every 100 steps, fp16": (2000, 1, 100, torch.float16),
    "update_every=1, every 10 steps, fp32": (200, 1, 10, torch.float32),
}
SIGMA_RELS = (0.05, 0.28)


def trajectory(steps: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c, a, b = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    freq = 0.25 + 0.75 * torch.rand(64, generator=g, dtype=torch.float64)
    phase = 2 * math.pi * torch.rand(64, generator=g, dtype=torch.float64)
    x = torch.arange(1, steps + 1, dtype=torch.float64)[:, None] / steps
    walk = torch.randn(steps, 64, generator=g, dtype=torch.float64).cumsum(0) / steps**0.5
    return 3 * c + a * torch.sin(2 * math.pi * freq * x + phase) + b * x * x + walk


def exact_ema(theta: torch.Tensor, gamma: float, upto: int) -> torch.Tensor:
    s = torch.arange(0, upto + 1, dtype=torch.float64) / upto
    return (s[1:] ** (gamma + 1) - s[:-1] ** (gamma + 1)) @ theta[:upto]


def rel(x: torch.Tensor, truth: torch.Tensor) -> float:
    return float((x.double().flatten() - truth).norm() / truth.norm())


def measure(label: str, steps: int, every: int, ckpt: int, dtype: torch.dtype) -> list[str]:
    theta = trajectory(steps)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        net = nn.Linear(8, 8, bias=False)
        theirs = ema_pytorch.PostHocEMA(
            net,
            sigma_rels=SIGMA_RELS,
            update_every=every,
            checkpoint_every_num_steps=ckpt,
            checkpoint_folder=folder,
            checkpoint_dtype=dtype,
        )
        for t in range(steps):
            with torch.no_grad():
                net.weight.copy_(theta[t].view(8, 8))
            theirs.update()
        legacy = LegacyProfiles.from_sigma_rels(SIGMA_RELS, update_every=every)
        for sigma_rel in (0.1, 0.15, 0.2):
            truth = exact_ema(theta, sigma_rel_to_gamma(sigma_rel), steps)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PostHocWarning)
                plan = plan_synthesis(folder, sigma_rel=sigma_rel, legacy=legacy)
                ours = plan.run()["weight"]
                snaps = plan.snapshots
                nominal = solve_weights(
                    [s.t for s in snaps], [s.gamma for s in snaps], steps, plan.gamma
                )
            files = [
                torch.load(s.path, weights_only=True)["ema_model.weight"].double() for s in snaps
            ]
            old = sum(w * x for w, x in zip(nominal.weights, files, strict=True))
            their = theirs.synthesize_ema_model(sigma_rel=sigma_rel).ema_model.weight
            rows.append(
                f"| {label} | {sigma_rel} | {rel(theta[steps - 1], truth):.2e} | "
                f"{rel(their, truth):.2e} | {rel(old, truth):.2e} | {rel(ours, truth):.2e} | "
                f"{plan.solution.residual:.2g} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        f"Relative L2 distance to the exact EMA at the last step; ema-pytorch "
        f"{ema_pytorch.__version__ if hasattr(ema_pytorch, '__version__') else '0.8.3'}, "
        f"sigma_rels={SIGMA_RELS}; the last column is emakit's reported profile error (1: no "
        f"closer than the raw weights).",
        "",
        "| ema-pytorch run | sigma_rel | raw weights | ema-pytorch | nominal profiles | emakit | profile error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, config in CONFIGS.items():
        lines += measure(label, *config)
    text = "\n".join(lines)
    print(text)
    if args.write_docs is not None:
        doc = args.write_docs.read_text()
        if START not in doc or END not in doc:
            raise SystemExit(f"{args.write_docs} has no {START} ... {END} block to replace")
        head, rest = doc.split(START, 1)
        _, tail = rest.split(END, 1)
        atomic_write_bytes(args.write_docs, f"{head}{START}\n{text}\n{END}{tail}".encode())
        print(f"\nwrote the table into {args.write_docs}")


if __name__ == "__main__":
    main()
