"""Update cost of each `emakit.compat` drop-in against its peer, on one small model.

    python benchmarks/bench_compat.py [--layers 24] [--width 256] [--iters 300]

For each pair (timm ``ModelEmaV3``, torch_ema ``ExponentialMovingAverage``, torch's
``AveragedModel`` with ``get_ema_multi_avg_fn``, diffusers ``EMAModel`` with its default
``foreach=False`` and with ``foreach=True``, Lightning ``EMAWeightAveraging``'s update,
which is ``AveragedModel.update_parameters`` with ``get_ema_avg_fn`` and
``use_buffers=True``): the median of 7 runs of ``--iters``
updates (interleaved), in microseconds per update, and the peer's time over the drop-in's. A peer that
is not installed is left out (timm: ``python tools/install_peers.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from peers import allow_timm


def model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*blocks)


def per_update_us(updates: tuple[Callable[[], None], ...], iters: int) -> list[float]:
    """Microseconds per call of each of ``updates``: the median of 7 runs, the runs of
    the functions interleaved so that a busy machine slows them alike."""
    for update in updates:
        for _ in range(10):
            update()
    runs: list[list[float]] = [[] for _ in updates]
    for _ in range(7):
        for update, times in zip(updates, runs, strict=True):
            start = time.perf_counter()
            for _ in range(iters):
                update()
            times.append((time.perf_counter() - start) / iters * 1e6)
    return [statistics.median(times) for times in runs]


def pairs(net: nn.Module) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    import torch.optim.swa_utils as swa

    from emakit import EMA, schedules
    from emakit.compat import swa_utils, torch_ema

    found = {}
    try:
        allow_timm()
        from timm.utils.model_ema import ModelEmaV3

        from emakit.compat.timm import ModelEmaV3 as Ours

        theirs, ours = ModelEmaV3(net, decay=0.999), Ours(net, decay=0.999)
        found["timm ModelEmaV3"] = (
            lambda: theirs.update(net, step=1000),
            lambda: ours.update(net, step=1000),
        )
    except Exception as e:  # timm absent, or torchvision that does not import
        print(f"(timm left out: {type(e).__name__}: {e})")
    try:
        import torch_ema as peer

        te = peer.ExponentialMovingAverage(net.parameters(), decay=0.999)
        oe = torch_ema.ExponentialMovingAverage(net.parameters(), decay=0.999)
        found["torch_ema ExponentialMovingAverage"] = (te.update, oe.update)
    except ImportError:
        print("(torch_ema left out: not installed)")
    ta = swa.AveragedModel(net, multi_avg_fn=swa.get_ema_multi_avg_fn(0.999))
    oa = swa_utils.AveragedModel(net, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.999))
    found["AveragedModel (EMA)"] = (
        lambda: ta.update_parameters(net),
        lambda: oa.update_parameters(net),
    )
    try:
        from diffusers.training_utils import EMAModel

        from emakit.compat.diffusers import EMAModel as CompatEMAModel

        oc = CompatEMAModel(net.parameters())
        for foreach in (False, True):
            dm = EMAModel(net.parameters(), foreach=foreach)
            found[f"diffusers EMAModel (foreach={foreach})"] = (
                lambda dm=dm: dm.step(net.parameters()),
                lambda: oc.step(net.parameters()),
            )
    except ImportError:
        print("(diffusers left out: not installed)")
    la = swa.AveragedModel(net, avg_fn=swa.get_ema_avg_fn(0.999), use_buffers=True)
    lo = EMA(net, update_after_step=0, update_every=1, schedule=schedules.constant(0.999),
             include_online_model=False)  # fmt: skip
    found["Lightning EMAWeightAveraging (its update)"] = (
        lambda: la.update_parameters(net),
        lo.update,  # what emakit.compat.lightning.EMAWeightAveraging calls
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = model(args.layers, args.width)
    n = sum(1 for _ in net.parameters())
    print(f"model: {args.layers} x (Linear {args.width} + LayerNorm), {n} tensors, CPU, 1 thread")
    print(f"{'pair':38s} {'peer us':>9s} {'emakit us':>10s} {'peer/emakit':>12s}")
    for name, (theirs, ours) in pairs(net).items():
        t, o = per_update_us((theirs, ours), args.iters)
        print(f"{name:38s} {t:9.1f} {o:10.1f} {t / o:11.2f}x")


if __name__ == "__main__":
    main()
