"""The README's speed table, measured on this machine and printed as Markdown.

Usage::

    python benchmarks/readme_table.py [--runs N] [--quick] [--no-bf16] [--no-compiled] [--json OUT]

One command for every number in the README's "Speed" section. It prints, as Markdown:
the machine (CPU model from ``/proc/cpuinfo``, logical CPUs, torch version and threads,
Python, emakit's commit), the load average before and after, and one table:

* one averaging ``update()`` of three models (``bench_update.MODELS``: 1,200 small
  tensors, a TransformerEncoder, 6 x Linear(2048)) for emakit's default path, the default
  after ``flatten_parameters``, ema-pytorch 0.8.3 ``use_foreach=True`` and torch's
  ``AveragedModel`` with ``get_ema_multi_avg_fn``, beside the floor (one ``lerp_`` over a
  flat tensor of as many elements), contenders interleaved in one process
  (``bench_update.time_side_by_side``);
* a skipped call (``update_every=10``; ``bench_update.bench_skipped``);
* an fp32 shadow of a bf16 GPT-2 124M (``bench_mixed_precision.bench_speed``): emakit's
  default and ``compile_update=True`` against ema-pytorch's ``coerce_dtype=True``, as
  ratios to the 10 bytes per element a fused update must move, with the compile time of
  the compiled update's first averaging call.

The whole measurement runs ``--runs`` times (3 by default), one run after the other: the
table gives each ratio as its range over the runs and each time as the median of the
runs' medians. Times are the benchmarking thread's CPU time (``time.thread_time``, median per call),
torch on one thread: on a shared machine that is the measure the other processes disturb
least; the ratios (each contender over emakit's, timed side by side) are what carries
from one machine to another. The wall-clock ratios are printed beneath, for comparison.
What depends on the machine: the flattened update is one ``lerp_``, so it sits at this
machine's memory floor (its ratio to ema-pytorch is a property of the memory, not of
emakit); the fp32-shadow ratios depend on the cache and memory bandwidth.

This file is a script, not part of the test suite; it asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import bench_mixed_precision as mp  # beside this file: the script's folder is on sys.path
import bench_update as bu

COMMAND = "python benchmarks/readme_table.py"
AVERAGED = "torch AveragedModel + get_ema_multi_avg_fn"
CONTENDERS = (bu.EMAKIT_DEFAULT, bu.EMAKIT_FLAT, bu.EMAPT_FOREACH, AVERAGED, bu.FLOOR)
SHORT = {
    "1200 tiny tensors (300 x Linear(64,64)+LayerNorm(64))": "1,200 small tensors",
    "TransformerEncoder 12 x d384 (144 tensors)": "TransformerEncoder, 144 tensors",
    "6 x Linear(2048, 2048) (12 tensors)": "6 x Linear(2048, 2048), 12 tensors",
}


def update_rows(repeats: int, sample_ms: float, warmup: int) -> list[dict[str, Any]]:
    """Per model: CPU and wall medians of each contender, and the ratios that matter."""
    out = []
    for model_name, build in bu.MODELS.items():
        torch.manual_seed(0)
        model = build()
        tensors, elements = bu.describe(model)
        fns = {name: bu.CONTENDERS[name](model) for name in CONTENDERS}
        timings = bu.time_side_by_side(
            fns, repeats=repeats, sample_s=sample_ms / 1e3, warmup=warmup
        )
        stats = {name: t.summary() for name, t in timings.items()}
        out.append(
            {
                "model": model_name,
                "tensors": tensors,
                "elements": elements,
                "stats": stats,
                "emapt_over_default": bu._ratio(stats, bu.EMAPT_FOREACH, bu.EMAKIT_DEFAULT),
                "emapt_over_flat": bu._ratio(stats, bu.EMAPT_FOREACH, bu.EMAKIT_FLAT),
                "averaged_over_default": bu._ratio(stats, AVERAGED, bu.EMAKIT_DEFAULT),
                "flat_over_floor": bu._ratio(stats, bu.EMAKIT_FLAT, bu.FLOOR),
            }
        )
        del fns, timings, model
    return out


def skipped_rows(repeats: int) -> dict[str, dict[str, float]]:
    rows = bu.bench_skipped(argparse.Namespace(repeats=repeats), None)
    return {r["contender"]: r for r in rows}


def _shown(argv: list[str]) -> list[str]:
    """The arguments that change what is measured (``--json OUT`` does not)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            out.append(arg)
    return out


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


def _us(value: float) -> str:
    return f"{value / 1e3:.2f} ms" if value >= 1000 else f"{value:.0f} µs"


def _span(values: list[float], digits: int | None = 2) -> str:
    """``a-b`` over the runs (one value when they agree to the digits shown); ``digits``
    None: one decimal below 10, none above."""
    if digits is None:
        digits = 1 if max(values) < 10 else 0
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def markdown(report: dict[str, Any]) -> str:
    """The table and its conditions: ratios as their range over the runs, times as the
    median over the runs of each run's median."""
    m = report["machine"]
    runs = report["runs"]
    n = len(runs)
    lines = [
        f"Command: `{report['command']}`, {report['date']}, {n} run{'s' * (n != 1)} in "
        f"{report['seconds']:.0f} s.",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} on "
        f"{m['torch_threads']} thread, Python {m['python']}, emakit {m['emakit']} at "
        f"`{m['emakit_source']['commit']}`"
        + (" (with uncommitted changes)" if m["emakit_source"]["uncommitted_changes"] else "")
        + ".",
        f"Load average (1, 5, 15 min): {_load(report['load_before'])} before, "
        f"{_load(report['load_after'])} after.",
        "",
        "| one averaging `update()`, CPU time | emakit default | after "
        "`flatten_parameters` | ema-pytorch `use_foreach=True` | ema-pytorch ÷ emakit |",
        "|---|---:|---:|---:|---:|",
    ]
    for i, first in enumerate(runs[0]["update"]):
        per_run = [run["update"][i] for run in runs]

        def cpu_time(name: str, per_run: list[dict[str, Any]] = per_run) -> str:
            return _us(statistics.median(r["stats"][name]["cpu_median_us"] for r in per_run))

        gain = [r["emapt_over_default"]["cpu_median_us"] for r in per_run]
        flat_gain = [r["emapt_over_flat"]["cpu_median_us"] for r in per_run]
        lines.append(
            f"| {SHORT[first['model']]} ({first['elements'] / 1e6:.1f}M elements) | "
            f"{cpu_time(bu.EMAKIT_DEFAULT)} | {cpu_time(bu.EMAKIT_FLAT)} | {cpu_time(bu.EMAPT_FOREACH)} | "
            f"**{_span(gain, None)}x** ({_span(flat_gain, None)}x flattened) |"
        )
    ours = [r["skipped"]["emakit EMA (default), Linear(4, 4)"]["cpu_median_us"] for r in runs]
    theirs = [r["skipped"]["ema-pytorch 0.8.3 EMA, Linear(4, 4)"]["cpu_median_us"] for r in runs]
    lines.append(
        f"| a skipped call (`update_every=10`), Linear(4, 4) | "
        f"{statistics.median(ours):.2f} µs | | {statistics.median(theirs):.2f} µs | "
        f"**{_span([t / o for t, o in zip(theirs, ours, strict=True)], None)}x** |"
    )
    if all("bf16" in r for r in runs):
        rows = [{row["contender"]: row for row in r["bf16"]["rows"]} for r in runs]
        ours = [r["emakit default"]["x_10B_floor_cpu"] for r in rows]
        theirs = [r["ema-pytorch 0.8.3 coerce_dtype=True"]["x_10B_floor_cpu"] for r in rows]
        cell = f"{_span(ours)}x the 10 B floor"
        gain = f"**{_span([t / o for t, o in zip(theirs, ours, strict=True)], 1)}x**"
        if all("emakit compile_update=True" in r for r in rows):
            comp = [r["emakit compile_update=True"]["x_10B_floor_cpu"] for r in rows]
            cell += f"; {_span(comp)}x with `compile_update=True`"
            gain += f"; {_span([t / c for t, c in zip(theirs, comp, strict=True)], 1)}x compiled"
        lines.append(
            f"| an fp32 shadow of a bf16 GPT-2 124M | {cell} | | {_span(theirs)}x the floor "
            f"(`coerce_dtype=True`) | {gain} |"
        )
    lines += ["", "Details (ranges over the same runs):", ""]
    for i, first in enumerate(runs[0]["update"]):
        per_run = [run["update"][i] for run in runs]
        wall = [r["emapt_over_default"]["median_us"] for r in per_run]
        avg = [r["averaged_over_default"]["cpu_median_us"] for r in per_run]
        flat = [r["flat_over_floor"]["cpu_median_us"] for r in per_run]
        floor = statistics.median(r["stats"][bu.FLOOR]["cpu_median_us"] for r in per_run)
        lines.append(
            f"- {SHORT[first['model']]}: ema-pytorch ÷ emakit {_span(wall)}x by the wall "
            f"median; `AveragedModel` ÷ emakit {_span(avg)}x; flattened ÷ floor "
            f"{_span(flat)}x (floor {_us(floor)})."
        )
    cold = [r["skipped"]["emakit EMA (default), 1200-tensor model"]["cpu_median_us"] for r in runs]
    cold_pt = [
        r["skipped"]["ema-pytorch 0.8.3 EMA, 1200-tensor model"]["cpu_median_us"] for r in runs
    ]
    lines.append(
        f"- A skipped call right after an averaging call of the 1,200-tensor model: "
        f"{_span(cold)} µs against ema-pytorch's {_span(cold_pt)} µs."
    )
    if all("bf16" in r for r in runs):
        bfs = [r["bf16"] for r in runs]
        lines.append(
            f"- GPT-2 124M in bf16 ({bfs[0]['elements']:,} elements): the floor moves "
            f"{_span([b['bandwidth_GBps'] for b in bfs], 1)} GB/s here; x 10 B floor by the "
            "CPU median (wall median):"
        )
        for j, row in enumerate(bfs[0]["rows"]):
            cpu = [b["rows"][j]["x_10B_floor_cpu"] for b in bfs]
            wall = [b["rows"][j]["x_10B_floor"] for b in bfs]
            ms = statistics.median(b["rows"][j]["cpu_median_ms"] for b in bfs)
            lines.append(f"  {row['contender']} {_span(cpu)}x ({_span(wall)}x), {ms:.1f} ms;")
        compiles = [b["compile_seconds"] for b in bfs if b.get("compile_seconds") is not None]
        if compiles:
            lines.append(
                "  the compiled update's first averaging call (its compile) took "
                + ", ".join(f"{c:.1f}" for c in compiles)
                + " s (run by run; the first run may find Inductor's cache cold)."
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the GPT-2 bf16 row")
    parser.add_argument("--no-compiled", action="store_true", help="leave out compile_update=True")
    parser.add_argument("--runs", type=int, default=3, help="independent runs (default 3)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    repeats, sample_ms, warmup, rounds = (5, 5.0, 2, 5) if args.quick else (21, 20.0, 5, 15)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": " ".join([COMMAND, *_shown(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "uptime_before": _uptime(),
        "load_before": os.getloadavg(),
        "machine": bu.machine(None),
    }
    report["runs"] = []
    for _ in range(args.runs):
        run: dict[str, Any] = {
            "update": update_rows(repeats, sample_ms, warmup),
            "skipped": skipped_rows(repeats),
        }
        if not args.no_bf16:
            run["bf16"] = mp.bench_speed(
                rounds, mp.GPT2["layers"], mp.GPT2["vocab"], None, compiled=not args.no_compiled
            )
        report["runs"].append(run)
    report["load_after"] = os.getloadavg()
    report["uptime_after"] = _uptime()
    report["seconds"] = time.perf_counter() - started
    print(markdown(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
