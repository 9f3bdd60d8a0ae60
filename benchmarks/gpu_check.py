"""GPU checks for emakit (needs CUDA; exits with a message without it).

1. No host sync: ``update()`` (warm-up copies, averaging, skipped calls) under
   ``torch.cuda.set_sync_debug_mode("error")``, for every engine path, ``stream=True``,
   ``device="cpu"`` (offload) and ``ema_dtype``.
2. Kernel counts per averaging update of the foreach and flat paths (torch.profiler), on a
   model with many small tensors, before and after ``flatten_parameters``.
3. Training-step overhead on ResNet-50 in bf16 (torchvision), median step time, side by
   side: no EMA, emakit on-GPU (default), emakit ``stream=True``, emakit offloaded to pinned
   CPU memory (``device="cpu"``, background thread), ema-pytorch foreach.
   Targets: offload within 5% of no EMA; on-GPU under 1% of the step.
4. Issue 2's speed target on CUDA: one averaging update of the 1200-tiny-tensor model,
   emakit default (and after ``flatten_parameters``) against ema-pytorch 0.8.3
   ``use_foreach=True`` and the floor (one ``lerp_`` over a flat tensor); target: emakit's
   default at least 10x faster than ema-pytorch.
5. ``ema(x)`` on a bf16 model with an fp32 shadow, on the model's device and offloaded to
   the CPU (``device="cpu"``): the model's inputs are accepted, the output comes back on
   the model's device in bf16 and equals the shadow's fp32 computation cast (issue 16).

Usage: python benchmarks/gpu_check.py [--steps N] [--batch B]
       python benchmarks/gpu_check.py --cpu-dry-run    # no GPU: runs what can run on CPU

``--cpu-dry-run`` exercises the code of checks 3, 4 and 5 on the CPU with tiny sizes (checks
1 and 2 need CUDA and are skipped), so that a short GPU session meets no surprise; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import emakit

DEVICE = "cuda"


def sync() -> None:
    """Wait for the device (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def many_small(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(300)]
    ).to(device)


def check_no_sync() -> list[tuple[str, str]]:
    rows = []
    configs = {
        "loop": dict(use_foreach=False),
        "foreach": dict(use_foreach=True),
        "flat (default)": dict(),
        "ema_dtype=float32 (bf16 model)": dict(ema_dtype=torch.float32),
        "stream=True": dict(stream=True),
        "device='cpu' (offload)": dict(device="cpu"),
    }
    for name, kw in configs.items():
        model = many_small("cuda")
        if "ema_dtype" in kw:
            model = model.to(torch.bfloat16)
        ema = emakit.EMA(model, beta=0.999, update_after_step=3, update_every=2, **kw)
        ema.update()  # first call may allocate/pin; sync-free afterwards is what matters
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for _ in range(12):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                ema.update()
            verdict = "ok: no host sync"
        except RuntimeError as e:
            verdict = f"SYNC: {str(e).splitlines()[0][:80]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        rows.append((name, verdict))
    return rows


def count_kernels() -> list[tuple[str, int]]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for flatten in (False, True):
        for name, kw in (("foreach", dict(use_foreach=True)), ("flat", dict(use_foreach=None))):
            model = many_small("cuda")
            if flatten:
                emakit.flatten_parameters(model)
            ema = emakit.EMA(model, update_after_step=0, update_every=1, **kw)
            ema.update()
            ema.update()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                ema.update()
                torch.cuda.synchronize()
            n = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
            rows.append((f"{name}{' after flatten_parameters' if flatten else ''}", n))
    return rows


def step_overhead(steps: int, batch: int) -> dict[str, float]:
    import torchvision

    size = 224 if DEVICE == "cuda" else 32

    def make() -> nn.Module:
        torch.manual_seed(0)
        return torchvision.models.resnet50().to(DEVICE).to(torch.bfloat16)

    x = torch.randn(batch, 3, size, size, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randint(0, 1000, (batch,), device=DEVICE)
    setups = {}
    names = ["no EMA", "emakit on-GPU", "emakit stream=True", "emakit device='cpu'"]
    if DEVICE != "cuda":
        names.remove("emakit stream=True")  # CUDA only
    for name in [*names, "ema-pytorch foreach"]:
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "no EMA":
            hook = None
        elif name == "ema-pytorch foreach":
            from ema_pytorch import EMA

            hook = EMA(model, beta=0.999, update_after_step=0, update_every=1, use_foreach=True)
        else:
            kw = {
                "emakit stream=True": dict(stream=True),
                "emakit device='cpu'": dict(device="cpu"),
            }.get(name, {})
            hook = emakit.EMA(
                model,
                beta=0.999,
                update_after_step=0,
                update_every=1,
                ema_dtype=torch.float32,
                **kw,
            )
        setups[name] = (model, opt, hook)
    times: dict[str, list[float]] = {n: [] for n in setups}
    loss_fn = nn.CrossEntropyLoss()
    for r in range(6 if DEVICE == "cuda" else 2):
        for name, (model, opt, hook) in setups.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss_fn(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if hook is not None:
                    hook.update()
            sync()
            if r:
                times[name].append((time.perf_counter() - t0) / steps)
    return {n: statistics.median(t) for n, t in times.items()}


def update_vs_ema_pytorch(repeats: int = 50) -> list[tuple[str, float]]:
    import ema_pytorch

    def timed(fn) -> float:  # median seconds per call, device-synchronized
        fn()
        sync()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    model = many_small(DEVICE)
    flat_model = many_small(DEVICE)
    emakit.flatten_parameters(flat_model)
    kw = dict(beta=0.999, update_after_step=0, update_every=1)
    contenders = {
        "emakit default": emakit.EMA(model, **kw),
        "emakit after flatten_parameters": emakit.EMA(flat_model, **kw),
        "ema-pytorch use_foreach=True": ema_pytorch.EMA(model, use_foreach=True, **kw),
    }
    n = sum(p.numel() for p in model.parameters())
    a, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    rows = [("floor: one lerp_ over a flat tensor", timed(lambda: a.lerp_(b, 1e-3)))]
    for name, ema in contenders.items():
        ema.update()
        rows.append((name, timed(ema.update)))
    return rows


def forward_cast() -> list[tuple[str, str]]:
    """Check 5: ``ema(x)`` takes the bf16 model's inputs and answers on its device."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(DEVICE, torch.bfloat16)
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    out = []
    for label, kwargs in (("fp32 shadow", {}), ("fp32 shadow, device='cpu'", {"device": "cpu"})):
        ema = emakit.EMA(
            net, ema_dtype=torch.float32, update_after_step=0, update_every=1, **kwargs
        )
        ema.update()
        y = ema(x)
        shadow = ema.ema_model
        where = next(shadow.parameters()).device
        with torch.no_grad():
            expected = shadow(x.to(where, torch.float32)).to(x.device, torch.bfloat16)
        ok = y.device == x.device and y.dtype == torch.bfloat16 and torch.equal(y, expected)
        out.append((label, f"{'ok' if ok else 'FAILED'} (out {y.dtype} on {y.device})"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="run checks 3-5 on the CPU, tiny sizes"
    )
    args = parser.parse_args()
    global DEVICE
    if args.cpu_dry_run:
        DEVICE = "cpu"
        args.steps, args.batch = 1, 2
        print(f"torch {torch.__version__}, CPU dry run: checks 1-2 need CUDA, skipped")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --cpu-dry-run runs what can", file=sys.stderr)
        raise SystemExit(2)
    else:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        print("\n1. host syncs inside update()")
        for name, verdict in check_no_sync():
            print(f"  {name:<34}{verdict}")
        print("\n2. CUDA kernels per averaging update, 1200 tiny tensors")
        for name, n in count_kernels():
            print(f"  {name:<34}{n}")
    print(
        f"\n3. ResNet-50 bf16 training step, batch {args.batch}, median of 5 rounds x {args.steps} steps"
    )
    res = step_overhead(args.steps, args.batch)
    base = res["no EMA"]
    for name, t in res.items():
        print(f"  {name:<34}{t * 1e3:8.2f} ms  {(t / base - 1) * 100:+6.2f}%")
    print("\n4. one averaging update, 1200 tiny tensors (issue 2's 10x target)")
    rows = update_vs_ema_pytorch()
    floor = rows[0][1]
    ref = dict(rows)["ema-pytorch use_foreach=True"]
    for name, t in rows:
        print(
            f"  {name:<34}{t * 1e6:9.1f} us  {t / floor:6.2f}x floor  ema-pytorch/this {ref / t:6.2f}x"
        )
    print("\n5. ema(x) on a bf16 model with an fp32 shadow")
    for name, verdict in forward_cast():
        print(f"  {name:<34}{verdict}")


if __name__ == "__main__":
    main()
