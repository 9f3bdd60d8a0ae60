"""Precision and speed of an EMA of a bf16 model: emakit's fp32 shadow against its peers.

Usage::

    python benchmarks/bench_mixed_precision.py [--quick] [--json OUT] [--steps N]
    python benchmarks/bench_mixed_precision.py --speed [--rounds R] [--before DIR] [--json OUT]
    python benchmarks/bench_mixed_precision.py --passes [--rounds R]

``--speed``: the cost of one averaging update of GPT-2 124M's parameter shapes in bf16
with an fp32 shadow (``ema_dtype=torch.float32``; ema-pytorch: an fp32 ``ema_model`` with
``coerce_dtype=True``), beside the floor, measured in one process, contenders interleaved
over ``--rounds`` rounds (the order reversed every other round), torch on one thread. The
floor is one ``lerp_`` over a flat float32 tensor of as many elements (12 bytes moved per
element: read both, write one) scaled to the 10 bytes per element a fused mixed-precision
update must move (read 2 bytes of bf16 weight and 4 of fp32 shadow, write 4). Each row:
the median and minimum per call, the ratio to the 10 B floor, and the bytes moved per
element at the floor's measured bandwidth (``12 x time / floor time``). Then, each in a
fresh subprocess (RSS, ``/proc/self/status``): the memory an EMA retains beyond its shadow
after a few updates, and the peak above that during one update (allocation per update).
``--before DIR`` adds an older emakit (e.g. ``/tmp/before/src/emakit``) as a second
package, side by side.

``--passes``: where two eager passes stop. Over as many elements as GPT-2 124M, a bf16
source and an fp32 shadow, for windows of 256 KiB to 16 MiB: the cast of every window
into one reused buffer alone, the shadow's ``lerp_`` from that buffer alone, and both (what
the eager update does), each against the same floor, minimum and median of ``--rounds``
(torch alone, no emakit).

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
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from emakit import EMA
from peers import allow_timm

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
    fused = EMA(model, ema_dtype=torch.float32, compile_update=True, **kw)
    theirs = ema_pytorch.EMA(model, include_online_model=False, **kw)
    out = [
        Tracker(
            "emakit EMA(ema_dtype=torch.float32)",
            ours.update,
            ours.get_current_decay,
            lambda: dict(ours.ema_model.named_parameters()),
        ),
        Tracker(
            "emakit EMA(ema_dtype=torch.float32, compile_update=True)",
            fused.update,
            fused.get_current_decay,
            lambda: dict(fused.ema_model.named_parameters()),
        ),
        Tracker(
            "ema-pytorch 0.8.3 EMA (bf16 shadow)",
            theirs.update,
            theirs.get_current_decay,
            lambda: dict(theirs.ema_model.named_parameters()),
        ),
    ]
    if sched is CONSTANT:
        allow_timm()
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


# -- speed and memory: GPT-2 124M's shapes in bf16 ------------------------------------------

GPT2 = {"vocab": 50257, "positions": 1024, "width": 768, "layers": 12}


def gpt2_shapes(
    layers: int = GPT2["layers"],
    vocab: int = GPT2["vocab"],
    *,
    width: int = GPT2["width"],
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """GPT-2 124M's parameter tensors (``GPT2LMHeadModel``, tied head) in bf16: embeddings,
    per block two LayerNorms, ``c_attn``, ``c_proj``, ``c_fc``, ``c_proj`` as Linear
    layers, and the final LayerNorm; 124,439,808 values at the defaults. Nothing
    downloaded, no transformers needed."""
    d = width
    kw = {"dtype": dtype, "device": device}
    torch.manual_seed(0)
    blocks = [
        nn.ModuleList(
            [
                nn.LayerNorm(d, **kw),
                nn.Linear(d, 3 * d, **kw),
                nn.Linear(d, d, **kw),
                nn.LayerNorm(d, **kw),
                nn.Linear(d, 4 * d, **kw),
                nn.Linear(4 * d, d, **kw),
            ]
        )
        for _ in range(layers)
    ]
    embed = [nn.Embedding(vocab, d, **kw), nn.Embedding(GPT2["positions"], d, **kw)]
    return nn.ModuleList([*embed, *blocks, nn.LayerNorm(d, **kw)])


#: Seconds the compiled contender's first update took (its compile), when it ran.
COMPILE_SECONDS: list[float] = []


def speed_contenders(
    model: nn.Module, before: Any | None, *, compiled: bool = True
) -> dict[str, Callable[[], None]]:
    """name -> one averaging update (``update_after_step=0, update_every=1``)."""
    import copy

    import ema_pytorch

    kw = {"beta": 0.999, "update_after_step": 0, "update_every": 1}
    out: dict[str, Callable[[], None]] = {}
    for label, use_foreach in (("default", None), ("use_foreach=True", True)):
        out[f"emakit {label}"] = EMA(
            model, ema_dtype=torch.float32, use_foreach=use_foreach, **kw
        ).update
        if before is not None:
            out[f"emakit before {label}"] = before.EMA(
                model, ema_dtype=torch.float32, use_foreach=use_foreach, **kw
            ).update
    out["emakit use_foreach=False"] = EMA(
        model, ema_dtype=torch.float32, use_foreach=False, **kw
    ).update
    if compiled:
        fused = EMA(model, ema_dtype=torch.float32, compile_update=True, **kw)
        fused.update()  # the first call copies the model
        started = time.perf_counter()
        fused.update()  # the first averaging update compiles
        COMPILE_SECONDS.append(time.perf_counter() - started)
        out["emakit compile_update=True"] = fused.update
    fp32 = copy.deepcopy(model).float()
    out["ema-pytorch 0.8.3 coerce_dtype=True"] = ema_pytorch.EMA(
        model, ema_model=fp32, coerce_dtype=True, include_online_model=False, **kw
    ).update
    n = sum(p.numel() for p in model.parameters())
    shadow, online = torch.randn(n), torch.randn(n)
    out[FLOOR] = lambda: shadow.lerp_(online, 0.001)
    return out


FLOOR = "floor: one fp32 lerp_ over as many elements"


def bench_speed(
    rounds: int, layers: int, vocab: int, before: Any | None, *, compiled: bool = True
) -> dict[str, Any]:
    model = gpt2_shapes(layers, vocab)
    n = sum(p.numel() for p in model.parameters())
    fns = speed_contenders(model, before, compiled=compiled)
    for fn in fns.values():
        fn()
        fn()
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            w, c = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - w)
    floor12 = {"wall": statistics.median(wall[FLOOR]), "cpu": statistics.median(cpu[FLOOR])}
    floor_min = min(wall[FLOOR])
    rows = []
    for name in fns:
        med, low, c = statistics.median(wall[name]), min(wall[name]), statistics.median(cpu[name])
        rows.append(
            {
                "contender": name,
                "wall_median_ms": med * 1e3,
                "wall_min_ms": low * 1e3,
                "cpu_median_ms": c * 1e3,
                "x_10B_floor": med / (floor12["wall"] * 10 / 12),
                "x_10B_floor_min": low / (floor_min * 10 / 12),
                "x_10B_floor_cpu": c / (floor12["cpu"] * 10 / 12),
                "bytes_per_element": 12 * med / floor12["wall"],
            }
        )
    return {
        "elements": n,
        "shadow_mib": n * 4 / 2**20,
        "rounds": rounds,
        "floor_10B_ms": floor12["wall"] * 10 / 12 * 1e3,
        "bandwidth_GBps": 12 * n / floor12["wall"] / 1e9,
        "compile_seconds": COMPILE_SECONDS[-1] if COMPILE_SECONDS else None,
        "rows": rows,
    }


def _rss_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def memory_worker(case: str, layers: int, vocab: int, before_dir: str | None) -> dict[str, float]:
    """In a fresh process: RSS retained by an EMA beyond its shadow after 3 updates, and
    the peak above that during one more update."""
    import ema_pytorch

    torch.set_num_threads(1)
    model = gpt2_shapes(layers, vocab)
    shadow_mib = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    kw = {"beta": 0.999, "update_after_step": 0, "update_every": 1}
    gc.collect()
    compiler_kib = 0
    if case.endswith("compiled"):
        # The compiler's own memory (its modules, a compiled kernel library) comes once per
        # process, whatever the model: paid here by a tiny compile, reported apart.
        before_compiler = _rss_kib()["VmRSS"]
        torch.compile(lambda x: x.lerp(x, 0.5), fullgraph=True)(torch.ones(4))
        gc.collect()
        compiler_kib = _rss_kib()["VmRSS"] - before_compiler
    base = _rss_kib()["VmRSS"]
    if case == "ema-pytorch":
        import copy

        ema: Any = ema_pytorch.EMA(
            model,
            ema_model=copy.deepcopy(model).float(),
            coerce_dtype=True,
            include_online_model=False,
            **kw,
        )
    else:
        pkg: Any = emakit_module(before_dir) if case.startswith("before") else EMA
        last = case.split()[-1]
        if last == "compiled":
            kw["compile_update"] = True
        use_foreach = {"default": None, "foreach": True, "loop": False, "compiled": None}[last]
        ema = pkg(model, ema_dtype=torch.float32, use_foreach=use_foreach, **kw)
    for _ in range(3):
        ema.update()
    gc.collect()
    settled = _rss_kib()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    ema.update()
    peak = _rss_kib()["VmHWM"]
    return {
        "shadow_mib": shadow_mib,
        "retained_beyond_shadow_mib": (settled - base) / 1024 - shadow_mib,
        "peak_during_update_mib": (peak - settled) / 1024,
        "compiler_mib": compiler_kib / 1024,
    }


def emakit_module(before_dir: str | None) -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_update import load_before

    return load_before(before_dir).EMA  # type: ignore[arg-type]


MEMORY_CASES = ("default", "foreach", "loop")


def bench_memory(
    layers: int, vocab: int, before_dir: str | None, *, compiled: bool = True
) -> list[dict[str, Any]]:
    cases = [f"emakit {c}" for c in (*MEMORY_CASES, "compiled")[: 3 + compiled]]
    if before_dir:
        cases += [f"before {c}" for c in MEMORY_CASES[:2]]
    rows = []
    for case in [*cases, "ema-pytorch"]:
        cmd = [sys.executable, __file__, "--memory-worker", case]
        cmd += ["--layers", str(layers), "--vocab", str(vocab)]
        cmd += ["--before", before_dir] if before_dir else []
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            rows.append({"case": case, "error": proc.stderr.strip().splitlines()[-1:]})
        else:
            rows.append({"case": case, **json.loads(proc.stdout.strip().splitlines()[-1])})
    return rows


def print_speed(res: dict[str, Any], memory: list[dict[str, Any]]) -> None:
    print(
        f"\nGPT-2 124M shapes in bf16, fp32 shadow: {res['elements']:,} elements "
        f"({res['shadow_mib']:.0f} MiB shadow); floor at 10 B/element {res['floor_10B_ms']:.1f} "
        f"ms ({res['bandwidth_GBps']:.1f} GB/s measured); {res['rounds']} interleaved rounds; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    if res.get("compile_seconds") is not None:
        print(
            f"compile_update=True: the first update (its compile) took {res['compile_seconds']:.1f} s"
        )
    print(
        "\n| contender | wall median (ms) | wall min (ms) | CPU median (ms) | x 10 B floor "
        "(median / min / CPU) | bytes per element |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        print(
            f"| {r['contender']} | {r['wall_median_ms']:.1f} | {r['wall_min_ms']:.1f} | "
            f"{r['cpu_median_ms']:.1f} | {r['x_10B_floor']:.2f} / {r['x_10B_floor_min']:.2f} / "
            f"{r['x_10B_floor_cpu']:.2f} | {r['bytes_per_element']:.1f} |"
        )
    if memory:
        print(
            "\n| EMA (fresh process) | retained beyond the shadow (MiB) | peak during one update "
            "(MiB) | the compiler itself, once per process (MiB) |"
        )
        print("|---|---:|---:|---:|")
        for m in memory:
            if "error" in m:
                print(f"| {m['case']} | error: {m['error']} | |")
            else:
                print(
                    f"| {m['case']} | {m['retained_beyond_shadow_mib']:.1f} | "
                    f"{m['peak_during_update_mib']:.1f} | {m.get('compiler_mib', 0):.1f} |"
                )


def bench_passes(rounds: int, n: int) -> dict[str, Any]:
    """The eager update's two passes, timed apart and together (see the module docstring)."""
    shadow, online = torch.randn(n), torch.randn(n).to(torch.bfloat16)
    flat = torch.randn(n)

    def best(fn: Callable[[], Any]) -> tuple[float, float]:
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times), statistics.median(times)

    def windows(size: int, cast: bool, lerp: bool) -> Callable[[], None]:
        k = size // 4
        buffer = torch.empty(k)

        def run() -> None:
            for i in range(0, n, k):
                m = min(k, n - i)
                if cast:
                    buffer[:m].copy_(online[i : i + m])
                if lerp:
                    shadow[i : i + m].lerp_(buffer[:m], 0.001)

        return run

    floor = best(lambda: shadow.lerp_(flat, 0.001))[1] * 10 / 12
    rows = []
    for size in (256 << 10, 1 << 20, 4 << 20, 16 << 20):
        row: dict[str, Any] = {"window_kib": size >> 10}
        for name, cast, lerp in (
            ("cast", True, False),
            ("lerp", False, True),
            ("both", True, True),
        ):
            low, med = best(windows(size, cast, lerp))
            row[name] = {"min_ms": low * 1e3, "median_ms": med * 1e3, "x_floor": med / floor}
        rows.append(row)
    return {"elements": n, "floor_10B_ms": floor * 1e3, "rounds": rounds, "windows": rows}


def print_passes(res: dict[str, Any]) -> None:
    print(
        f"\n{res['elements']:,} elements, bf16 source, fp32 shadow; 10 B floor "
        f"{res['floor_10B_ms']:.1f} ms; median of {res['rounds']} (x floor), min in brackets\n"
    )
    print("| window | cast alone | lerp_ from the buffer alone | both (the eager update) |")
    print("|---:|---:|---:|---:|")
    for row in res["windows"]:
        cells = [
            f"{row[k]['median_ms']:.1f} ms ({row[k]['min_ms']:.1f}), {row[k]['x_floor']:.2f}x"
            for k in ("cast", "lerp", "both")
        ]
        print(f"| {row['window_kib']} KiB | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 steps instead of 3000")
    parser.add_argument("--steps", type=int, default=None, help="override the number of updates")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    parser.add_argument("--speed", action="store_true", help="time and memory on GPT-2's shapes")
    parser.add_argument("--rounds", type=int, default=15, help="--speed: interleaved rounds")
    parser.add_argument("--layers", type=int, default=GPT2["layers"], help="--speed: blocks")
    parser.add_argument("--vocab", type=int, default=GPT2["vocab"], help="--speed: vocabulary")
    parser.add_argument("--no-memory", action="store_true", help="--speed: skip the RSS runs")
    parser.add_argument(
        "--no-compiled", action="store_true", help="--speed: leave out compile_update=True"
    )
    parser.add_argument("--before", metavar="DIR", help="--speed: an older emakit package too")
    parser.add_argument(
        "--passes", action="store_true", help="the eager update's two passes, timed apart"
    )
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.memory_worker:
        print(json.dumps(memory_worker(args.memory_worker, args.layers, args.vocab, args.before)))
        return
    if args.passes:
        n = sum(p.numel() for p in gpt2_shapes(args.layers, args.vocab).parameters())
        res = bench_passes(args.rounds, n)
        print_passes(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return
    if args.speed:
        before = None
        if args.before:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from bench_update import load_before

            before = load_before(args.before)
        load = os.getloadavg()
        compiled = not args.no_compiled
        res = bench_speed(args.rounds, args.layers, args.vocab, before, compiled=compiled)
        memory = (
            []
            if args.no_memory
            else bench_memory(args.layers, args.vocab, args.before, compiled=compiled)
        )
        res.update({"memory": memory, "loadavg_start": load, "loadavg_end": os.getloadavg()})
        print_speed(res, memory)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
        return
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
