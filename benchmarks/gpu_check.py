"""GPU checks for emakit: one short run measures everything that matters, the first time.

Usage::

    python benchmarks/gpu_check.py --out gpu_check_out        # on a CUDA machine, < 5 min
    python benchmarks/gpu_check.py --cpu-dry-run --out DIR    # no GPU: every check's logic

Writes ``DIR/gpu_check.json`` (every number, every verdict) and ``DIR/gpu_check.md`` (one
Markdown table, plus the rows for BENCHMARKS.md's "GPU" section, ready to paste). Each check
runs on its own; one that fails is reported as failed and the others still run.

1. **sync_debug**: ``update()`` (warm-up copies, averaging, skipped calls) under
   ``torch.cuda.set_sync_debug_mode("error")`` for every path, ``ema_dtype``,
   ``stream=True``, ``device="cpu"`` and ``skip_nonfinite=True`` (alone and with
   ``stream=True``). Target: no error.
2. **profiler_syncs**: a profiler trace of N updates per config, counting the calls
   ``set_sync_debug_mode`` does not see: ``cudaStreamSynchronize``,
   ``cudaEventSynchronize``, ``cudaDeviceSynchronize`` (and pinned allocations,
   ``cudaHostAlloc``, which synchronize too). Target: 0 of each.
3. **kernel_counts**: CUDA kernels of one averaging update against the expected count per
   path: the flat path one launch per (device, dtype) group, foreach
   ``ceil(tensors / 110)`` per group (torch's multi-tensor launch holds at most 110
   tensors for two lists), the loop one per tensor.
4. **cuda_graph**: ``update()`` captured in a CUDA graph and replayed K times against K
   eager updates from the same start: bit-identical shadows, and the time per update of
   each.
5. **offload**: ``device="cpu"`` against an on-GPU EMA over the same N training steps:
   updates applied (steps, and the shadows compared at the end), and in a trace the
   device-to-host copies counted and the share of their time overlapped by compute kernels.
6. **peers**: one averaging update of the 1200-tiny-tensor model, timed with CUDA events:
   emakit default and flattened, ema-pytorch (``use_foreach=True``), timm ``ModelEmaV3``,
   ``AveragedModel`` with ``get_ema_multi_avg_fn``, torch_ema, diffusers ``EMAModel``, and
   the floor (one ``lerp_`` over a flat tensor). Issue 2's target: emakit 10x ema-pytorch.
7. **bandwidth**: the update of a large model (6 x Linear(4096)) as bytes moved (read
   shadow, read weights, write shadow) per second, against the device's peak HBM bandwidth.
8. **step_overhead**: ResNet-50 in bf16, training step time with CUDA events: no EMA,
   emakit on-GPU, ``stream=True``, ``device="cpu"``, ema-pytorch. Targets: on-GPU under 1%,
   offload within 5% of no EMA.
9. **forward_cast**: ``ema(x)`` on a bf16 model with an fp32 shadow, on the GPU and
   offloaded: bf16 in, bf16 out on the model's device, equal to the shadow's computation.
10. **mixed_precision** (issue 32): GPT-2 124M's parameter shapes in bf16 with an fp32
    shadow (``ema_dtype=torch.float32``), every path: the time of one update against one
    flat fp32 ``lerp_`` of as many elements on the same device (12 bytes per element), so
    the bytes of HBM moved per element (``12 x time / floor time``; a fused update needs
    10) and the share of the peak bandwidth; the memory the EMA holds beyond its shadow
    and the peak allocated during one update (``torch.cuda.max_memory_allocated``).
    ``compile_update=True`` too (opt-in), with its first averaging update's time (the
    compile), and whether it is bit-identical to the eager update on the device (a small
    model of the same layer kinds, eight updates through the warm-up's large weights).
    Also the compiled update with Inductor's ``combo_kernels`` (one launch for many
    tensors' kernels on a GPU, where one launch per tensor may cost more than the memory
    traffic), and the eager default with cast windows of 4, 8, 32 and 64 MiB (16 by
    default on an accelerator: which size the device wants). Targets: at most 1.25x the
    10-byte floor (1.05x compiled), compiled bit for bit;
    no shadow-sized staging (at most 64 MiB or
    1% of the shadow, whichever is larger, held or allocated).
11. **bema**: one ``BEMA.update()`` (``update_freq=1``) of GPT-2's shapes in fp32 against
    one flat ``lerp_`` over the same elements, and its peak memory during an update.
12. **lora**: an EMA of 12 LoRA adapters with GPT-2's shapes (``r=8`` on ``c_attn`` of 6
    blocks, 147,456 values, frozen base weights shared) against a bare
    ``torch._foreach_lerp_`` over the adapters: device time per call, and the host time
    per call (what a GPU user pays per update on a small model). Target: at most 1.2x.

``--cpu-dry-run`` runs every check's logic on the CPU with tiny sizes, so a GPU session
meets no surprise: the models are meta tensors, whose values cannot be read on the host at
all, in place of the sync debug mode (1), the
profiler is real but CPU-only and its counting is also fed a stub trace with known syncs
(2), operator calls stand in for kernels (3), a stub graph replays the captured callable
(4), times come from ``perf_counter`` (5-8, 10-12), and memory from the profiler's CPU
allocation events (10-11). Its numbers mean nothing.
``tests/test_bench.py`` runs the dry run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import bench_mixed_precision
import emakit
from emakit._engine import compiled as compiled_update
from emakit._engine import paths as cast_paths
from emakit._engine.compiled import refusal as compile_refusal
from peers import allow_timm

DEVICE = "cuda"
DRY = False
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
PINNED_ALLOC = "cudaHostAlloc"
FOREACH_MAX_TENSORS = 110  # torch's depth_to_max_tensors for two tensor lists
KW = {"beta": 0.999, "update_after_step": 0, "update_every": 1}
# peak HBM bandwidth (GB/s) by device name, where torch does not report the memory clock
PEAK_GBPS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
}
PEAK_GBPS.update({"A100": 1555, "L40S": 864, "L4": 300, "A10": 600, "V100": 900, "T4": 320})


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def many_small(n_blocks: int | None = None, device: str | None = None) -> nn.Module:
    """``n_blocks`` x (Linear(64, 64) + LayerNorm(64)): 300 blocks are 1200 tensors (6 in
    the dry run)."""
    n_blocks = (6 if DRY else 300) if n_blocks is None else (min(n_blocks, 6) if DRY else n_blocks)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)) for _ in range(n_blocks)]
    return nn.Sequential(*blocks).to(device or DEVICE)


def perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def time_per_call(fn: Callable[[], object], repeats: int, calls: int = 10) -> float:
    """Median seconds per call over ``repeats`` batches of ``calls``; CUDA events on a GPU."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def configs() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "loop": {"use_foreach": False},
        "foreach": {"use_foreach": True},
        "flat (default)": {},
        "ema_dtype=float32 (bf16 model)": {"ema_dtype": torch.float32},
        "device='cpu' (offload)": {"device": "cpu"},
        "skip_nonfinite=True": {"skip_nonfinite": True},
    }
    if DEVICE == "cuda":
        out["stream=True"] = {"stream": True}
        out["skip_nonfinite=True, stream=True"] = {"skip_nonfinite": True, "stream": True}
    return out


def make_ema(
    kw: dict[str, Any], device: str | None = None, **extra: Any
) -> tuple[nn.Module, emakit.EMA]:
    model = many_small(extra.pop("blocks", None), device)
    if "ema_dtype" in kw:
        model = model.to(torch.bfloat16)
    settings = {"beta": 0.999, "update_after_step": 3, "update_every": 2, **extra}
    return model, emakit.EMA(model, **settings, **kw)


# -- 1 and 2: syncs -------------------------------------------------------------------------


def check_sync_debug(n: int) -> list[dict[str, Any]]:
    """On a GPU under ``set_sync_debug_mode("error")``; in the dry run on meta tensors,
    whose values cannot be read on the host at all (``.item()``, ``bool()`` raise)."""
    rows = []
    for name, kw in configs().items():
        if DRY and ("device" in kw or "skip_nonfinite" in kw):
            why = "has nothing to offload" if "device" in kw else "cannot give its first flag"
            rows.append({"config": name, "ok": True, "verdict": f"dry run: a meta model {why}"})
            continue
        model, ema = make_ema(kw, device="meta" if DRY else None)
        ema.update()  # the first call may allocate and pin: sync-free afterwards is the claim
        sync()
        verdict = "ok: no host sync"
        try:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            for _ in range(n):
                perturb(model)
                ema.update()
        except RuntimeError as e:
            verdict = f"SYNC: {str(e).splitlines()[0][:100]}"
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        sync()
        rows.append(
            {"config": name, "updates": n, "ok": verdict.startswith("ok"), "verdict": verdict}
        )
    return rows


def count_sync_events(names: list[str]) -> dict[str, int]:
    """How many of ``names`` (profiler event names) are sync calls or pinned allocations."""
    counts = dict.fromkeys((*SYNC_CALLS, PINNED_ALLOC), 0)
    for name in names:
        for call in counts:
            if name == call or name.startswith(call + "_"):  # e.g. cudaStreamSynchronize_v2
                counts[call] += 1
    return counts


def profile_events(fn: Callable[[], None]) -> list[Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if DEVICE == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        fn()
        sync()
    return list(prof.events())


def check_profiler_syncs(n: int) -> list[dict[str, Any]]:
    rows = []
    if DRY:  # the counting itself, on a stub trace with known answers
        stub = ["cudaLaunchKernel", "cudaStreamSynchronize", "cudaEventSynchronize_v2"]
        stub += ["cudaDeviceSynchronize", "cudaHostAlloc", "cudaStreamSynchronize"]
        counts = count_sync_events(stub)
        expected = {SYNC_CALLS[0]: 2, SYNC_CALLS[1]: 1, SYNC_CALLS[2]: 1, PINNED_ALLOC: 1}
        rows.append(
            {"config": "stub trace (counting self-test)", **counts, "ok": counts == expected}
        )
    for name, kw in configs().items():
        model, ema = make_ema(kw)
        ema.update()
        sync()

        def run(model: nn.Module = model, ema: emakit.EMA = ema) -> None:
            for _ in range(n):
                perturb(model)
                ema.update()

        events = profile_events(run)
        counts = count_sync_events([e.name for e in events])
        rows.append({"config": name, "updates": n, **counts, "ok": not any(counts.values())})
    return rows


# -- 3 and 4: kernels and CUDA graphs --------------------------------------------------------


def expected_launches(path: str, tensors_per_group: list[int]) -> int:
    """Kernels per averaging update on a GPU (operator calls on the CPU: one foreach call
    per group)."""
    if path == "flat":
        return len(tensors_per_group)
    if path == "foreach":
        if DEVICE != "cuda":
            return len(tensors_per_group)
        return sum(math.ceil(n / FOREACH_MAX_TENSORS) for n in tensors_per_group)
    return sum(tensors_per_group)  # loop


def check_kernel_counts() -> list[dict[str, Any]]:
    rows = []
    for flatten in (False, True):
        for path, kw in (
            ("loop", {"use_foreach": False}),
            ("foreach", {"use_foreach": True}),
            ("flat", {}),
        ):
            model = many_small(40 if path == "loop" else None)
            if flatten:
                emakit.flatten_parameters(model)
            ema = emakit.EMA(model, **KW, **kw)
            ema.update()
            ema.update()
            sync()
            events = profile_events(ema.update)
            if DEVICE == "cuda":
                kernels = [
                    e for e in events if e.device_type.name == "CUDA" and "emcpy" not in e.name
                ]
                got = len(kernels)
            else:  # operator calls stand in for launches (a CPU foreach calls lerp_ inside)
                foreach = sum(e.name == "aten::_foreach_lerp_" for e in events)
                got = foreach or sum(e.name == "aten::lerp_" for e in events)
            tensors = sum(
                1 for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()
            )
            # the default path is foreach over the model's tensors, one flat span per group
            # once flatten_parameters has laid them out contiguously
            flat = flatten and path == "flat"
            want = expected_launches(
                "flat" if flat else ("foreach" if path == "flat" else path), [tensors]
            )
            name = "default (use_foreach=None)" if path == "flat" else path
            label = f"{name}{' after flatten_parameters' if flatten else ''}"
            rows.append(
                {
                    "path": label,
                    "tensors": tensors,
                    "kernels": got,
                    "expected": want,
                    "ok": got == want,
                }
            )
    return rows


class StubGraph:
    """The dry run's CUDA graph: capture records the callable, replay calls it."""

    def __init__(self) -> None:
        self.fn: Callable[[], object] | None = None

    def replay(self) -> None:
        assert self.fn is not None
        self.fn()


def capture(fn: Callable[[], object]) -> Any:
    if DEVICE != "cuda":
        graph = StubGraph()
        graph.fn = fn
        return graph
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on a side stream, as torch's docs ask
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def check_cuda_graph(k: int) -> list[dict[str, Any]]:
    rows = []
    for path, kw in (("foreach", {"use_foreach": True}), ("flat (default)", {})):
        schedule = emakit.schedules.constant(0.999)  # a graph replays one fixed decay
        pair = []
        for _ in range(2):
            torch.manual_seed(0)
            model = many_small()
            ema = emakit.EMA(model, schedule=schedule, update_after_step=0, update_every=1, **kw)
            ema.update()
            pair.append((model, ema))
        (_, eager), (_, graphed) = pair
        try:
            graph = capture(graphed.update)  # warm-up calls happen in capture(): match them
            for _ in range(3 if DEVICE == "cuda" else 0):
                eager.update()
            sync()
            for _ in range(k):
                eager.update()
                graph.replay()
            sync()
            a, b = eager.ema_model.state_dict(), graphed.ema_model.state_dict()
            same = all(torch.equal(a[n], b[n]) for n in a)
            t_eager = time_per_call(eager.update, 5)
            t_graph = time_per_call(graph.replay, 5)
            verdict = "ok" if same else "DIFFERENT shadows"
        except Exception as e:  # capture can refuse (a host sync, an allocation)
            same, t_eager, t_graph = False, float("nan"), float("nan")
            verdict = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"
        rows.append({"path": path, "replays": k, "bit_identical": same, "eager_us": t_eager * 1e6})
        rows[-1].update({"graph_us": t_graph * 1e6, "ok": same, "verdict": verdict})
    return rows


# -- 5: offload -----------------------------------------------------------------------------


def check_offload(steps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = many_small(100)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    offloaded = emakit.EMA(model, **KW, device="cpu")
    on_device = emakit.EMA(model, **KW)
    x = torch.randn(256, 64, device=DEVICE)

    def train() -> None:
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            offloaded.update()
            on_device.update()

    events = profile_events(train)
    a = offloaded.ema_model.state_dict()
    b = on_device.ema_model.state_dict()
    diff = max(float((a[n].to(b[n].device) - b[n]).abs().max()) for n in a)
    if DEVICE == "cuda":
        copies = [e for e in events if e.device_type.name == "CUDA" and "DtoH" in e.name]
        kernels = [e for e in events if e.device_type.name == "CUDA" and "emcpy" not in e.name]
        overlapped = sum(_overlap(c, kernels) for c in copies)
        copy_time = sum(c.time_range.elapsed_us() for c in copies) or 1
        share = overlapped / copy_time
    else:
        copies = [e for e in events if e.name == "aten::copy_"]
        share = float("nan")
    return [
        {
            "steps": steps,
            "updates_offloaded": int(offloaded.step),
            "updates_on_device": int(on_device.step),
            "max_abs_diff": diff,
            "device_to_host_copies": len(copies),
            "copy_time_overlapped": share,
            "ok": int(offloaded.step) == int(on_device.step) == steps + 0 and diff < 1e-6,
        }
    ]


def _overlap(copy: Any, kernels: list[Any]) -> float:
    a0, a1 = copy.time_range.start, copy.time_range.end
    return sum(max(0, min(a1, k.time_range.end) - max(a0, k.time_range.start)) for k in kernels)


# -- 6 and 7: peers and bandwidth ------------------------------------------------------------


def peer_contenders(model: nn.Module) -> dict[str, Callable[[], object] | str]:
    """name -> update callable, or the reason it is missing."""
    out: dict[str, Callable[[], object] | str] = {}
    out["emakit default"] = emakit.EMA(model, **KW).update
    flat = many_small()
    emakit.flatten_parameters(flat)
    out["emakit after flatten_parameters"] = emakit.EMA(flat, **KW).update
    try:
        import ema_pytorch

        out["ema-pytorch 0.8.3 use_foreach=True"] = ema_pytorch.EMA(
            model, use_foreach=True, **KW
        ).update
    except ImportError:
        out["ema-pytorch 0.8.3 use_foreach=True"] = "not installed (pip install ema-pytorch==0.8.3)"
    try:
        allow_timm()
        from timm.utils.model_ema import ModelEmaV3

        timm_ema = ModelEmaV3(model, decay=0.999)
        out["timm ModelEmaV3"] = lambda: timm_ema.update(model)
    except ImportError:
        out["timm ModelEmaV3"] = 'not installed (pip install -e ".[test-peers]")'
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    out["AveragedModel + get_ema_multi_avg_fn"] = lambda: averaged.update_parameters(model)
    try:
        from torch_ema import ExponentialMovingAverage

        tema = ExponentialMovingAverage(model.parameters(), decay=0.999)
        out["torch_ema ExponentialMovingAverage"] = tema.update
    except ImportError:
        out["torch_ema ExponentialMovingAverage"] = "not installed (pip install torch-ema)"
    try:
        from diffusers.training_utils import EMAModel

        dema = EMAModel(model.parameters(), decay=0.999, foreach=True)
        out["diffusers EMAModel (foreach)"] = lambda: dema.step(model.parameters())
    except ImportError:
        out["diffusers EMAModel (foreach)"] = "not installed (pip install diffusers)"
    except Exception as e:  # installed beside a torch it does not support (0.4x needs 2.6)
        out["diffusers EMAModel (foreach)"] = (
            f"does not work with torch {torch.__version__}: {type(e).__name__}: {e}"
        )
    return out


def check_peers(repeats: int) -> list[dict[str, Any]]:
    model = many_small()
    n = sum(p.numel() for p in model.parameters())
    a, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    floor = time_per_call(lambda: a.lerp_(b, 1e-3), repeats)
    rows = [{"contender": "floor: one lerp_ over a flat tensor", "us": floor * 1e6, "x_floor": 1.0}]
    times = {}
    for name, fn in peer_contenders(model).items():
        if isinstance(fn, str):
            rows.append({"contender": name, "us": None, "x_floor": None, "skipped": fn})
            continue
        times[name] = time_per_call(fn, repeats)
        rows.append({"contender": name, "us": times[name] * 1e6, "x_floor": times[name] / floor})
    ref = times.get("ema-pytorch 0.8.3 use_foreach=True")
    for row in rows:
        if ref and row.get("us"):
            row["ema_pytorch_over_this"] = ref / (row["us"] / 1e6)
    mine = times["emakit default"]
    target: dict[str, Any] = {"contender": "target: emakit default >= 10x ema-pytorch"}
    target["ratio"] = ref / mine if ref else None
    if not DRY:  # a dry run's times mean nothing: its targets are not judged
        target["ok"] = bool(ref and ref / mine >= 10)
    rows.append(target)
    return rows


def peak_bandwidth_gbps() -> tuple[float | None, str]:
    if DEVICE != "cuda":
        return None, "CPU dry run: no peak"
    props = torch.cuda.get_device_properties(0)
    clock, bus = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock and bus:  # kHz and bits; double data rate
        return 2 * clock * 1e3 * bus / 8 / 1e9, "from the device's memory clock and bus width"
    for key, gbps in PEAK_GBPS.items():
        if key in props.name:
            return float(gbps), f"datasheet value for {key}"
    return None, f"unknown for {props.name}"


def check_bandwidth(repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    width = 4096 if DEVICE == "cuda" else 64
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]).to(DEVICE)
    numel = sum(p.numel() for p in model.parameters())
    peak, source = peak_bandwidth_gbps()
    rows = []
    for name, kw in (("emakit default", {}), ("emakit foreach", {"use_foreach": True})):
        ema = emakit.EMA(model, **KW, **kw)
        t = time_per_call(ema.update, repeats)
        moved = 3 * numel * 4  # read the shadow and the weights, write the shadow (float32)
        gbps = moved / t / 1e9
        rows.append({"contender": name, "bytes": moved, "us": t * 1e6, "GB_per_s": gbps})
        rows[-1].update(
            {"peak_GB_per_s": peak, "of_peak": gbps / peak if peak else None, "peak_source": source}
        )
    return rows


# -- 8 and 9: the training step, ema(x) --------------------------------------------------------


def check_step_overhead(steps: int, batch: int, rounds: int) -> list[dict[str, Any]]:
    try:
        if DRY:
            raise ImportError("the dry run times a small convnet: ResNet-50 on a CPU takes minutes")
        import torchvision

        def make() -> nn.Module:
            torch.manual_seed(0)
            return torchvision.models.resnet50().to(DEVICE).to(torch.bfloat16)

        size, classes = (224 if DEVICE == "cuda" else 32), 1000
    except ImportError:  # the dry run, or no torchvision: a small convnet stands in

        def make() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10)).to(
                DEVICE, torch.bfloat16
            )

        size, classes = 16, 10
    x = torch.randn(batch, 3, size, size, device=DEVICE, dtype=torch.bfloat16)
    y = torch.randint(0, classes, (batch,), device=DEVICE)
    names = ["no EMA", "emakit on-GPU", "emakit device='cpu'", "ema-pytorch foreach"]
    if DEVICE == "cuda":
        names.insert(2, "emakit stream=True")
    setups = {}
    for name in names:
        model = make()
        model(x)  # materialize lazy layers
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        if name == "no EMA":
            hook = None
        elif name == "ema-pytorch foreach":
            try:
                from ema_pytorch import EMA
            except ImportError:
                continue
            hook = EMA(model, use_foreach=True, **KW)
        else:
            extra = {
                "emakit stream=True": {"stream": True},
                "emakit device='cpu'": {"device": "cpu"},
            }
            hook = emakit.EMA(model, **KW, ema_dtype=torch.float32, **extra.get(name, {}))
        setups[name] = (model, opt, hook)
    loss_fn = nn.CrossEntropyLoss()

    def step(model: nn.Module, opt: Any, hook: Any) -> None:
        loss_fn(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if hook is not None:
            hook.update()

    times: dict[str, list[float]] = {n: [] for n in setups}
    for r in range(rounds + 1):  # round 0 warms up
        for name, parts in setups.items():
            t = time_per_call(lambda parts=parts: step(*parts), 1, calls=steps)
            if r:
                times[name].append(t)
    base = statistics.median(times["no EMA"])
    rows = []
    for name, t in times.items():
        med = statistics.median(t)
        rows.append({"contender": name, "ms_per_step": med * 1e3, "overhead": med / base - 1})
    target = {"emakit on-GPU": 0.01, "emakit device='cpu'": 0.05}
    for row in rows:
        if row["contender"] in target:
            row["target"] = target[row["contender"]]
            if not DRY:  # a dry run's times mean nothing: its targets are not judged
                row["ok"] = row["overhead"] <= target[row["contender"]]
    return rows


def check_forward_cast() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(DEVICE, torch.bfloat16)
    x = torch.randn(4, 64, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for label, kwargs in (("fp32 shadow", {}), ("fp32 shadow, device='cpu'", {"device": "cpu"})):
        ema = emakit.EMA(net, ema_dtype=torch.float32, **KW, **kwargs)
        ema.update()
        y = ema(x)
        where = next(ema.ema_model.parameters()).device
        with torch.no_grad():
            expected = ema.ema_model(x.to(where, torch.float32)).to(x.device, torch.bfloat16)
        ok = y.device == x.device and y.dtype == torch.bfloat16 and torch.equal(y, expected)
        rows.append({"config": label, "out": f"{y.dtype} on {y.device}", "ok": ok})
    return rows


# -- 10, 11 and 12: mixed precision, BEMA, LoRA (issue 32) ------------------------------------


def gpt2_shapes(dtype: torch.dtype) -> nn.Module:
    """GPT-2 124M's parameter tensors as plain layers (``bench_mixed_precision.gpt2_shapes``);
    2 blocks of width 64 and a 4096-word vocabulary in the dry run."""
    if DRY:
        return bench_mixed_precision.gpt2_shapes(2, 4096, width=64, dtype=dtype, device=DEVICE)
    return bench_mixed_precision.gpt2_shapes(dtype=dtype, device=DEVICE)


def floor_lerp(n: int, repeats: int) -> float:
    """Seconds of one ``lerp_`` over a flat float32 tensor of ``n`` elements (12 bytes per
    element moved: two read, one written)."""
    a, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    return time_per_call(lambda: a.lerp_(b, 1e-3), repeats)


def allocated() -> int:
    """Bytes the caching allocator holds for tensors now (0 on the CPU)."""
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def peak_during(fn: Callable[[], object]) -> int:
    """Bytes allocated by ``fn`` above what was allocated before it: the CUDA allocator's
    peak, or on the CPU the sum of the profiler's allocation events (an upper bound)."""
    if DEVICE == "cuda":
        sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def held_bytes(build: Callable[[], object], shadow_bytes: int) -> tuple[object, float]:
    """``build()`` and the bytes it keeps allocated beyond ``shadow_bytes`` (CUDA; on the
    CPU, where torch keeps no count, the storages of the EMA's state it can see)."""
    sync()
    before = allocated()
    obj = build()
    sync()
    return obj, float(allocated() - before - shadow_bytes)


def check_mixed_precision(repeats: int) -> list[dict[str, Any]]:
    model = gpt2_shapes(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    floor12 = floor_lerp(n, repeats)
    peak, source = peak_bandwidth_gbps()
    rows: list[dict[str, Any]] = [
        {
            "contender": "floor: one fp32 lerp_ (12 B/element)",
            "elements": n,
            "us": floor12 * 1e6,
            "GB_per_s": 12 * n / floor12 / 1e9,
            "peak_GB_per_s": peak,
            "peak_source": source,
        }
    ]
    paths: dict[str, dict[str, Any]] = {
        "default": {},
        "use_foreach=True": {"use_foreach": True},
        "use_foreach=False": {"use_foreach": False},
        "compile_update=True": {"compile_update": True},  # opt-in
        # the same, with Inductor's combo kernels: on a GPU, one launch for many tensors'
        # pointwise kernels instead of one each (148 here); on a CPU the option does nothing
        "compile_update=True, combo_kernels": {"compile_update": True, "combo": True},
    }
    for name, kw in paths.items():
        combo = kw.pop("combo", False)
        if "compile_update" in kw and (why := compile_refusal()) is not None:
            rows.append(
                {"contender": f"emakit {name}, ema_dtype=float32", "refused": why, "ok": True}
            )
            continue
        try:  # a contender that fails is a row saying why; the others still run
            rows.append(mixed_row(model, name, kw, combo, floor12, repeats))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            rows.append(
                {"contender": f"emakit {name}, ema_dtype=float32", "error": error, "ok": False}
            )
    rows += cast_windows(model, floor12, repeats)
    if compile_refusal() is None:
        rows.append(compiled_bits())
    return rows


def mixed_row(
    model: nn.Module, name: str, kw: dict[str, Any], combo: bool, floor12: float, repeats: int
) -> dict[str, Any]:
    """One contender of check 10: its time against the floor, its memory, its compile."""
    shadow = sum(p.numel() for p in model.parameters()) * 4
    limit = max(64 * 2**20, shadow // 100)
    with inductor_options({"combo_kernels": True} if combo else {}):
        ema, extra = held_bytes(
            lambda kw=kw: emakit.EMA(model, ema_dtype=torch.float32, **KW, **kw), shadow
        )
        ema.update()  # type: ignore[attr-defined]  # builds the plan: torch.compile here
    started = time.perf_counter()
    ema.update()  # type: ignore[attr-defined]  # compile_update: compiles here
    sync()
    first = time.perf_counter() - started
    t = time_per_call(ema.update, repeats)  # type: ignore[attr-defined]
    during = peak_during(ema.update)  # type: ignore[attr-defined]
    if DEVICE != "cuda":
        extra = float(staging_bytes(ema))
    target = 1.05 if "compile_update" in kw else 1.25
    row = {
        "contender": f"emakit {name}, ema_dtype=float32",
        "us": t * 1e6,
        "first_averaging_update_s": first,
        "x_10B_floor": t / (floor12 * 10 / 12),
        "target_x_floor": target,
        "bytes_per_element": 12 * t / floor12,
        "held_beyond_shadow_MiB": extra / 2**20,
        "peak_during_update_MiB": during / 2**20,
        "limit_MiB": limit / 2**20,
    }
    memory_ok = extra <= limit and during <= limit
    row["ok"] = memory_ok if DRY else memory_ok and row["x_10B_floor"] <= target
    return row


def cast_windows(model: nn.Module, floor12: float, repeats: int) -> list[dict[str, Any]]:
    """The eager default update with other sizes of its cast buffer
    (``emakit._engine.paths.CAST_CHUNK_BYTES``; 16 MiB on an accelerator): small windows pay
    two launches each, large ones spill out of the cache. Which size the device wants."""
    rows = []
    saved = dict(cast_paths.CAST_CHUNK_BYTES)
    try:
        for mib in (4, 8, 32, 64):
            cast_paths.CAST_CHUNK_BYTES[DEVICE] = mib << 20
            ema = emakit.EMA(model, ema_dtype=torch.float32, **KW)
            ema.update()
            t = time_per_call(ema.update, repeats)
            rows.append(
                {
                    "contender": f"emakit default, ema_dtype=float32, cast window {mib} MiB",
                    "us": t * 1e6,
                    "x_10B_floor": t / (floor12 * 10 / 12),
                    "bytes_per_element": 12 * t / floor12,
                    "ok": True,  # a measurement, no target: the default is 16 MiB
                }
            )
            del ema
    finally:
        cast_paths.CAST_CHUNK_BYTES.clear()
        cast_paths.CAST_CHUNK_BYTES.update(saved)
    return rows


@contextlib.contextmanager
def inductor_options(extra: dict[str, Any]) -> Iterator[None]:
    """Add ``extra`` to the Inductor options of the compiled update built inside."""
    saved = compiled_update.FMA_OPTIONS
    compiled_update.FMA_OPTIONS = {**saved, **extra}
    try:
        yield
    finally:
        compiled_update.FMA_OPTIONS = saved


def compiled_bits() -> dict[str, Any]:
    """``compile_update=True`` against the eager update on the device, bit for bit: a small
    bf16 model of GPT-2's layer kinds, eight updates from the first (weights 1, 0.63, then
    below 0.5, so both branches of ``lerp_``)."""
    model = bench_mixed_precision.gpt2_shapes(
        2, 4096, width=64, dtype=torch.bfloat16, device=DEVICE
    )
    kw = {**KW, "beta": 0.99, "ema_dtype": torch.float32}
    eager = emakit.EMA(model, **kw)
    compiled = emakit.EMA(model, compile_update=True, **kw)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for _ in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device=DEVICE).to(p.dtype) * 0.05)
        eager.update()
        compiled.update()
    a, b = eager.ema_model.state_dict(), compiled.ema_model.state_dict()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    worst = max(((a[k] - b[k]).abs().max().item() for k in differ), default=0.0)
    return {
        "contender": "emakit compile_update=True against the eager update, bit for bit",
        "tensors": len(a),
        "tensors_that_differ": len(differ),
        "max_abs_difference": worst,
        "ok": not differ,
    }


def staging_bytes(ema: Any) -> int:
    """The bytes of the buffers an EMA's plan stages the weights through (on the CPU, where
    torch keeps no allocation count, what stands in for the held memory)."""
    plan = ema.tracker.plan()
    views = [v for g in plan.groups for r in g.lerp.rounds for v in r[0]]
    views += [v for g in plan.groups for t in (g.lerp, g.copy) for v in t.stage_dst]
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in views}
    return sum(storages.values())


def check_bema(repeats: int) -> list[dict[str, Any]]:
    model = gpt2_shapes(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    floor = floor_lerp(n, repeats)
    bema, extra = held_bytes(lambda: emakit.BEMA(model, update_freq=1), 0)
    for _ in range(3):
        bema.update()  # type: ignore[attr-defined]
    t = time_per_call(bema.update, repeats)  # type: ignore[attr-defined]
    during = peak_during(bema.update)  # type: ignore[attr-defined]
    return [
        {
            "contender": "floor: one fp32 lerp_ over the same elements",
            "elements": n,
            "us": floor * 1e6,
        },
        {
            "contender": "emakit BEMA(update_freq=1).update()",
            "us": t * 1e6,
            "x_floor": t / floor,
            "copies_of_weights_held": extra / (n * 4) if DEVICE == "cuda" else None,
            "peak_during_update_MiB": during / 2**20,
            "target_x_floor": 1.3,
        },
    ]


class LoRA(nn.Module):
    """12 adapters with GPT-2's LoRA shapes (``r=8`` on ``c_attn``, 6 blocks) beside
    frozen base weights, without peft."""

    def __init__(self, blocks: int = 6, d: int = 768, r: int = 8) -> None:
        super().__init__()
        self.base = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(blocks)])
        self.base.requires_grad_(False)
        self.lora_A = nn.ParameterList([nn.Parameter(torch.randn(r, d)) for _ in range(blocks)])
        self.lora_B = nn.ParameterList([nn.Parameter(torch.randn(3 * d, r)) for _ in range(blocks)])


def check_lora(repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = LoRA().to(DEVICE)
    ema = emakit.EMA(model, **KW)
    for _ in range(3):
        ema.update()
    adapters = [p.detach() for p in model.parameters() if p.requires_grad]
    shadows = [t.clone() for t in adapters]

    def bare() -> None:
        torch._foreach_lerp_(shadows, adapters, 1e-3)

    rows = []
    times = {}
    for name, fn in (
        ("bare torch._foreach_lerp_ over the adapters", bare),
        ("emakit EMA", ema.update),
    ):
        device_t = time_per_call(fn, repeats, calls=50)
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host = (time.perf_counter() - t0) / 200
        sync()
        times[name] = (device_t, host)
        rows.append({"contender": name, "tensors": len(adapters), "us": device_t * 1e6})
        rows[-1]["host_us"] = host * 1e6
    (bare_t, bare_host), (ema_t, ema_host) = times.values()
    target = {
        "contender": "emakit / bare",
        "ratio": ema_t / bare_t,
        "host_ratio": ema_host / bare_host,
    }
    target["fixed_host_us"] = (ema_host - bare_host) * 1e6
    if not DRY:
        target["ok"] = ema_t / bare_t <= 1.2
    rows.append(target)
    return rows


# -- the run --------------------------------------------------------------------------------


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    n = 12 if not DRY else 4
    checks: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "sync_debug": lambda: check_sync_debug(n),
        "profiler_syncs": lambda: check_profiler_syncs(n),
        "kernel_counts": check_kernel_counts,
        "cuda_graph": lambda: check_cuda_graph(20 if not DRY else 3),
        "offload": lambda: check_offload(args.steps),
        "peers": lambda: check_peers(30 if not DRY else 2),
        "bandwidth": lambda: check_bandwidth(30 if not DRY else 2),
        "step_overhead": lambda: check_step_overhead(args.steps, args.batch, 5 if not DRY else 1),
        "forward_cast": check_forward_cast,
        "mixed_precision": lambda: check_mixed_precision(20 if not DRY else 2),
        "bema": lambda: check_bema(20 if not DRY else 2),
        "lora": lambda: check_lora(30 if not DRY else 2),
    }
    report: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, "dry_run": DRY}
    report["emakit"] = emakit.__version__
    report["checks"] = {}
    started = time.perf_counter()
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            rows, error = fn(), None
        except Exception as e:  # one broken check must not cost the others
            rows, error = [], "".join(traceback.format_exception_only(type(e), e)).strip()
        entry = {"rows": rows, "seconds": time.perf_counter() - t0, "error": error}
        entry["ok"] = error is None and all(r.get("ok", True) for r in rows)
        report["checks"][name] = entry
        print(
            f"{name:<16}{'ok' if entry['ok'] else 'NOT OK'}  ({entry['seconds']:.1f} s)", flush=True
        )
    report["seconds"] = time.perf_counter() - started
    return report


def device_name() -> str:
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    return "CPU (dry run)"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return "" if v is None else str(v)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU check: {report['device']}, torch {report['torch']}, emakit {report['emakit']}"]
    lines += [f"\n{'CPU dry run: the numbers mean nothing.' if report['dry_run'] else ''}"]
    lines += ["| check | result | what | seconds |", "|---|---|---|---:|"]
    for name, entry in report["checks"].items():
        what = entry["error"] or "; ".join(
            ", ".join(f"{k}={_cell(v)}" for k, v in row.items() if k != "ok")
            for row in entry["rows"]
        )
        lines.append(
            f"| {name} | {'ok' if entry['ok'] else 'NOT OK'} | {what} | {entry['seconds']:.1f} |"
        )
    lines += ["", "## Rows for BENCHMARKS.md (GPU section)", ""]
    for name, entry in report["checks"].items():
        if not entry["rows"]:
            continue
        keys = list(dict.fromkeys(k for row in entry["rows"] for k in row))
        lines += [f"### {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += [
            "| " + " | ".join(_cell(row.get(k)) for k in keys) + " |" for row in entry["rows"]
        ]
        lines.append("")
    lines.append(
        f"Command: `python benchmarks/gpu_check.py{' --cpu-dry-run' if report['dry_run'] else ''}`; {report['seconds']:.0f} s."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--batch", type=int, default=64, help="ResNet-50 batch")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="output folder")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every check's logic on CPU")
    args = parser.parse_args(argv)
    global DEVICE, DRY
    if args.cpu_dry_run:
        DEVICE, DRY = "cpu", True
        args.steps, args.batch = 2, 2
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; --cpu-dry-run runs every check's logic",
            file=sys.stderr,
        )
        return 2
    report = run_checks(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out / "gpu_check.md").write_text(markdown(report))
    print(
        f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'} ({report['seconds']:.0f} s)"
    )
    return 0 if all(e["ok"] for e in report["checks"].values()) or DRY else 1


if __name__ == "__main__":
    sys.exit(main())
