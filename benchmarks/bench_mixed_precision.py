"""Precision of an EMA of a bf16 model: emakit's fp32 shadow against bf16 shadows.

Usage::

    python benchmarks/bench_mixed_precision.py [--quick] [--json OUT] [--steps N]

A small bf16 model (Linear layers) is trained by a stand-in for noisy SGD: fp32 master
weights take a random step of about 1e-3 of each tensor's RMS per iteration and the bf16
model weights are the master rounded to bf16 (as in mixed-precision training). After every
step each tracker calls ``update()`` (``update_after_step=0, update_every=1``), and a
float64 reference EMA of the *same bf16 weights* is advanced by hand with exactly the decay
that tracker used (``shadow64 <- shadow64.lerp(w.double(), 1 - decay)``).

Reported per tracker: the max over tensors of ``||shadow - ref|| / ||ref||`` at the end,
and the shadow dtype. The requirement (issue 2): emakit's fp32 shadow stays within 1e-4
relative of the float64 reference after 3000 updates at beta 0.999.

Schedules: "constant" runs at beta from the first averaging update on; both emakit and
ema-pytorch get it through the same keywords (``inv_gamma=1e-6, power=1``, which makes the
inverse-gamma warm-up saturate at ``beta`` immediately). "warm-up" is the default
inverse-gamma warm-up (``inv_gamma=1, power=2/3``) capped at beta.

This file is a script, not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from emakit import EMA

REQUIREMENT = 1e-4
CONSTANT = {"inv_gamma": 1e-6, "power": 1.0}  # decay = beta for every averaging update
WARMUP = {"inv_gamma": 1.0, "power": 2 / 3}  # ema-pytorch's default warm-up


def bf16_model(width: int = 256) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Linear(width, 10)
    ).to(torch.bfloat16)


@dataclass
class Tracker:
    """One EMA implementation: how to update it, which decay it just used, its shadow."""

    name: str
    update: Callable[[], None]
    last_decay: Callable[[], float]
    shadow: Callable[[], dict[str, torch.Tensor]]
    copies_at_construction: bool = False  # else the first update() copies the model


def trackers(model: nn.Module, beta: float, sched: dict[str, float]) -> list[Tracker]:
    import ema_pytorch

    kw = {"beta": beta, "update_after_step": 0, "update_every": 1, **sched}
    ours = EMA(model, ema_dtype=torch.float32, **kw)
    theirs = ema_pytorch.EMA(model, include_online_model=False, **kw)
    out = [
        Tracker(
            "emakit EMA(ema_dtype=torch.float32)",
            ours.update,
            ours.get_current_decay,
            lambda: dict(ours.ema_model.named_parameters()),
        ),
        Tracker(
            "ema-pytorch 0.8.3 EMA (bf16 shadow)",
            theirs.update,
            theirs.get_current_decay,
            lambda: dict(theirs.ema_model.named_parameters()),
        ),
    ]
    if sched is CONSTANT:
        from timm.utils.model_ema import ModelEmaV3

        # timm keeps a bf16 shadow with stochastic rounding by default; its decay is
        # exactly ``beta`` on every call (it starts from a copy made at construction).
        timm_ema = ModelEmaV3(model, decay=beta)
        out.append(
            Tracker(
                "timm ModelEmaV3 (bf16 shadow, stochastic rounding)",
                lambda: timm_ema.update(model),
                lambda: beta,
                lambda: dict(timm_ema.module.named_parameters()),
                copies_at_construction=True,
            )
        )
    return out


def run(
    steps: int, beta: float, sched: dict[str, float], rel_step: float, seed: int = 0
) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = bf16_model()
    online = dict(model.named_parameters())
    master = {n: p.detach().float().clone() for n, p in online.items()}
    tracks = trackers(model, beta, sched)
    refs = [
        {n: p.detach().double().clone() for n, p in online.items()}
        if tr.copies_at_construction
        else None
        for tr in tracks
    ]
    gen = torch.Generator().manual_seed(seed + 1)
    started = time.perf_counter()
    for _ in range(steps):
        with torch.no_grad():
            for n, w in master.items():
                rms = w.pow(2).mean().sqrt()
                w.add_(torch.randn(w.shape, generator=gen) * (rel_step * rms))
                online[n].copy_(w)  # the bf16 model: master rounded to bf16
        for i, tr in enumerate(tracks):
            tr.update()
            decay = tr.last_decay()
            if refs[i] is None or decay == 0.0:
                refs[i] = {n: p.detach().double().clone() for n, p in online.items()}
            else:
                for n, r in refs[i].items():
                    r.lerp_(online[n].detach().double(), 1.0 - decay)
    seconds = time.perf_counter() - started
    rows = []
    for tr, ref in zip(tracks, refs, strict=True):  # every ref is set after one step
        shadow = tr.shadow()
        errs = {n: ((shadow[n].double() - r).norm() / r.norm()).item() for n, r in ref.items()}
        worst = max(errs, key=errs.__getitem__)
        rows.append(
            {
                "tracker": tr.name,
                "shadow_dtype": str(next(iter(shadow.values())).dtype),
                "max_rel_err": errs[worst],
                "worst_tensor": worst,
                "final_decay": tr.last_decay(),
            }
        )
    drift = max(
        ((online[n].detach().double() - refs[0][n]).norm() / refs[0][n].norm()).item()
        for n in online
    )
    return {
        "steps": steps,
        "beta": beta,
        "schedule": "constant" if sched is CONSTANT else "warm-up",
        "rel_step": rel_step,
        "model_dtype": str(next(model.parameters()).dtype),
        "online_vs_ref_rel": drift,
        "seconds": seconds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 steps instead of 3000")
    parser.add_argument("--steps", type=int, default=None, help="override the number of updates")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (300 if args.quick else 3000)
    configs = [(0.999, CONSTANT), (0.999, WARMUP), (0.9999, CONSTANT)]
    results = [run(steps, beta, sched, rel_step=1e-3) for beta, sched in configs]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(json.dumps(results, indent=2))
    else:
        console = Console(width=130)
        for res in results:
            table = Table(
                title=(
                    f"{res['steps']} updates, beta={res['beta']} ({res['schedule']}), "
                    f"{res['model_dtype']} model, step {res['rel_step']:g} x RMS"
                )
            )
            for col in ("tracker", "shadow dtype", "max rel. error vs float64", "meets 1e-4"):
                table.add_column(col)
            for r in res["rows"]:
                table.add_row(
                    r["tracker"],
                    r["shadow_dtype"],
                    f"{r['max_rel_err']:.2e}",
                    "yes" if r["max_rel_err"] <= REQUIREMENT else "no",
                )
            console.print(table)
            console.print(
                f"(the online weights differ from the reference EMA by "
                f"{res['online_vs_ref_rel']:.2e} relative; {res['seconds']:.1f} s)\n"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
