"""Per-step training overhead of an EMA in Lightning: emakit's ``EMACallback`` against
Lightning's own ``EMAWeightAveraging`` and against no EMA, on the same model.

Usage::

    python benchmarks/bench_lightning_overhead.py [--quick] [--device cpu|cuda]
        [--width 1024] [--depth 4] [--steps 300] [--rounds 5] [--threads 1] [--json OUT]

What is timed:

* **step**: the wall time between consecutive ``on_train_batch_end`` calls of a full
  ``Trainer.fit`` (data loading, forward, backward, optimizer step, every callback), after
  a warm-up, for three contenders built from the same seed: no EMA,
  ``emakit.integrations.lightning.EMACallback(beta=0.999, update_after_step=0,
  update_every=1)`` and ``lightning.pytorch.callbacks.EMAWeightAveraging(decay=0.999)``
  (an ``AveragedModel`` updated after every optimizer step). Both EMAs update on every
  step and track parameters and buffers. The contenders run round-robin (the order rotates
  each round); the table shows the median step over all rounds and its excess over the
  run without EMA.
* **EMA update alone**: one update call in isolation after the fit (emakit
  ``ema.update()``, Lightning ``AveragedModel.update_parameters``), median of 30; the part
  of the step overhead that is not noise.
* **eval swap**: putting the EMA weights into the module for validation and taking them
  out again (emakit: ``on_validation_start`` + ``on_validation_end``, a zero-copy
  ``swap()``; Lightning: ``on_validation_epoch_start`` + ``on_validation_epoch_end``, which
  copy every tensor three times each way), median of 30 pairs, after the fit.

Torch runs single-threaded by default on CPU (``--threads``): on small shared machines a
second OpenMP thread is often scheduled late, which buries sub-millisecond differences in
noise. This file is a script, not a test; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import emakit

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - a script
    raise SystemExit("this benchmark needs Lightning: pip install 'emakit[lightning]'") from e

from emakit.integrations.lightning import EMACallback

LightningEMA: Any = getattr(pl.callbacks, "EMAWeightAveraging", None)

NONE, EMAKIT, LIGHTNING = "no EMA", "emakit EMACallback", "Lightning EMAWeightAveraging"
BETA = 0.999
WARMUP = 20


class MLP(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(64, width), nn.LayerNorm(width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class StepTimer(pl.Callback):
    """Records the time of every ``on_train_batch_end`` (placed after the EMA callback)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.cuda = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def make_callback(name: str) -> pl.Callback | None:
    if name == EMAKIT:
        return EMACallback(beta=BETA, update_after_step=0, update_every=1)
    if name == LIGHTNING:
        return LightningEMA(decay=BETA)
    return None


def run_one(
    name: str, args: argparse.Namespace, loader: DataLoader
) -> tuple[list[float], float, float]:
    """Per-step times (s) of one fit, the median update and eval swap-in+out times (s)."""
    module = MLP(args.width, args.depth)
    timer = StepTimer()
    timer.cuda = args.device == "cuda"
    ema_cb = make_callback(name)
    callbacks = [c for c in (ema_cb, timer) if c is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator=args.device,
            devices=1,
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )
        trainer.fit(module, loader)
    stamps = timer.stamps[WARMUP:]
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    cuda = args.device == "cuda"
    if ema_cb is None:
        return steps, float("nan"), float("nan")
    if name == EMAKIT:
        update = ema_cb.ema.update
        enter, leave = ema_cb.on_validation_start, ema_cb.on_validation_end
    else:
        average_model = ema_cb._average_model
        update = lambda: average_model.update_parameters(module)  # noqa: E731
        enter, leave = ema_cb.on_validation_epoch_start, ema_cb.on_validation_epoch_end
    swap = lambda: (enter(trainer, module), leave(trainer, module))  # noqa: E731
    return steps, median_time(update, cuda), median_time(swap, cuda)


def median_time(fn: Any, cuda: bool, repeats: int = 30) -> float:
    """Median wall time (s) of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="80 steps, 2 rounds")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 80, 2
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = DataLoader(data, batch_size=args.batch, num_workers=0)

    names = [NONE, EMAKIT] + ([LIGHTNING] if LightningEMA is not None else [])
    steps: dict[str, list[float]] = {n: [] for n in names}
    updates: dict[str, list[float]] = {n: [] for n in names}
    swaps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            s, u, w = run_one(name, args, loader)
            steps[name] += s
            updates[name].append(u)
            swaps[name].append(w)

    n_params = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    base = statistics.median(steps[NONE])
    print(
        f"torch {torch.__version__}, lightning {pl.__version__}, emakit {emakit.__version__}, "
        f"python {platform.python_version()}, device {args.device}"
        + (f" ({torch.get_num_threads()} thread(s))" if args.device == "cpu" else "")
    )
    print(
        f"model: MLP width {args.width} depth {args.depth}, {n_params / 1e6:.2f} M parameters "
        f"(fp32), batch {args.batch}; {args.rounds} rounds x {args.steps} steps "
        f"(first {WARMUP} of each fit dropped)\n"
    )
    print(
        "| contender | median step (ms) | overhead vs no EMA (ms) | overhead (%) "
        "| EMA update alone (ms) | eval swap in+out (ms) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    results = {}
    for name in names:
        med = statistics.median(steps[name])
        upd = statistics.median(updates[name])
        swap = statistics.median(swaps[name])
        over = med - base
        results[name] = {
            "step_ms": med * 1e3,
            "overhead_ms": over * 1e3,
            "update_ms": upd * 1e3,
            "swap_ms": swap * 1e3,
        }
        if name == NONE:
            print(f"| {name} | {med * 1e3:.3f} | - | - | - | - |")
        else:
            print(
                f"| {name} | {med * 1e3:.3f} | {over * 1e3:+.3f} | {100 * over / base:+.1f} "
                f"| {upd * 1e3:.3f} | {swap * 1e3:.3f} |"
            )
    if LightningEMA is None:
        print(f"\n{LIGHTNING}: not in this Lightning version; compared against no EMA only")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "params": n_params, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
