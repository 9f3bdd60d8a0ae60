"""Training-step overhead of keeping an EMA: emakit paths vs ema-pytorch, timm, AveragedModel.

Each contender trains its own copy of a torchvision ResNet-18 (SGD, small batch, CPU) and
updates its EMA after every optimizer step (update_every 1, then 10). Contenders run
interleaved round-robin in one process, so machine noise hits all of them alike; the
report is the median step time and the overhead over "no EMA" in percent.

Usage:
    python benchmarks/bench_overhead.py [--rounds R] [--steps S] [--batch B] [--size PX]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import emakit
from peers import allow_timm


def resnet18() -> nn.Module:
    allow_timm()  # torchvision from .peers/ beside a CPU torch, as the tests load it
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


Factory = Callable[[nn.Module, torch.optim.Optimizer], Callable[[int], None]]


def contenders(every: int) -> dict[str, Factory]:
    """name -> factory(model, optimizer) -> per-step hook(step)."""

    def none(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        return lambda step: None

    def emakit_ema(**kw: object) -> Factory:
        def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
            hooked = kw.pop("hooked", False)
            ema = emakit.EMA(model, beta=0.999, update_after_step=0, update_every=every, **kw)
            if hooked:  # updates from the optimizer's post-step hook, zero-copy
                ema.add_to_optimizer_post_step_hook(opt)
                return lambda step: None
            return lambda step: ema.update()

        return make

    def flattened(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        emakit.flatten_parameters(model)  # keeps Parameter identity: opt still works
        ema = emakit.EMA(model, beta=0.999, update_after_step=0, update_every=every)
        return lambda step: ema.update()

    def ema_pytorch(foreach: bool) -> Factory:
        def make(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
            from ema_pytorch import EMA

            ema = EMA(
                model,
                beta=0.999,
                update_after_step=0,
                update_every=every,
                use_foreach=foreach,
                include_online_model=False,
            )
            return lambda step: ema.update()

        return make

    def timm_v3(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        allow_timm()
        from timm.utils.model_ema import ModelEmaV3

        ema = ModelEmaV3(model, decay=0.999)

        def hook(step: int) -> None:
            if step % every == 0:
                ema.update(model, step=step)

        return hook

    def averaged(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[int], None]:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)

        def hook(step: int) -> None:
            if step % every == 0:
                avg.update_parameters(model)

        return hook

    return {
        "no EMA": none,
        "emakit default": emakit_ema(),
        "emakit flattened": flattened,
        "emakit async (thread)": emakit_ema(async_update=True),
        "emakit async, opt hook": emakit_ema(async_update=True, hooked=True),
        "ema-pytorch loop": ema_pytorch(False),
        "ema-pytorch foreach": ema_pytorch(True),
        "timm ModelEmaV3": timm_v3,
        "AveragedModel": averaged,
    }


def run(
    every: int, rounds: int, steps: int, batch: int, size: int
) -> dict[str, tuple[float, float]]:
    base = resnet18()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    setups = {}
    for name, factory in contenders(every).items():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        hook = factory(model, opt)
        setups[name] = (model, opt, hook, [0])
    times: dict[str, list[float]] = {n: [] for n in setups}
    hook_times: dict[str, list[float]] = {n: [] for n in setups}
    loss_fn = nn.CrossEntropyLoss()
    for r in range(rounds + 1):
        for name, (model, opt, hook, counter) in setups.items():
            spent = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                loss_fn(model(x), y).backward()
                h0 = time.perf_counter()  # optimizer step + EMA (a hooked EMA runs inside step)
                opt.step()
                hook(counter[0])
                spent += time.perf_counter() - h0
                opt.zero_grad(set_to_none=True)
                counter[0] += 1
            if r:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) / steps)
                hook_times[name].append(spent / steps)
    # The EMA call's time is averaged over all steps: with update_every=10 most calls are
    # skips, so a median over rounds would hide the averaging ones.
    return {n: (statistics.median(times[n]), statistics.fmean(hook_times[n])) for n in times}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), ResNet-18, "
        f"batch {args.batch} x 3 x {args.size} x {args.size}, SGD; median of {args.rounds} rounds "
        f"x {args.steps} steps"
    )
    print("columns: median step time; EMA cost = mean time of optimizer.step() + the EMA call,")
    print("minus the same without EMA, as % of the no-EMA step (what the training thread waits")
    print("for); step delta = whole step vs no EMA (includes background work and noise)")
    for every in (1, 10):
        res = run(every, args.rounds, args.steps, args.batch, args.size)
        base, base_opt = res["no EMA"]
        print(f"\nupdate_every={every}")
        print(f"{'contender':<24}{'ms/step':>10}{'EMA cost':>10}{'step delta':>12}")
        for name, (t, opt_ema) in res.items():
            cost = (opt_ema - base_opt) / base * 100
            print(f"{name:<24}{t * 1e3:>10.1f}{cost:>9.2f}%{(t / base - 1) * 100:>11.1f}%")


if __name__ == "__main__":
    main()
