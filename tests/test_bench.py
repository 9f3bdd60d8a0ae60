"""``emakit bench``: side-by-side timing, median and spread, and honest warnings.

No timing is asserted: only the shape of the result and that the warnings fire on the
conditions they name (fed with made-up rows)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import _peers
from emakit import EMAValueError, bench
from emakit.bench import FLOOR, BenchRow, bench_update
from emakit.cli import main


def row(path: str, median: float, spread: float = 0.0, cpu: float | None = None) -> BenchRow:
    half = spread * median / 2
    return BenchRow(path, median, median - half, median + half, median if cpu is None else cpu, 1)


def test_result_has_the_floor_first_every_path_and_restores_threads():
    threads = torch.get_num_threads()
    result = bench_update("mlp", repeats=3, sample_ms=1)
    assert torch.get_num_threads() == threads
    assert result.threads == 1  # the default
    assert [r.path for r in result.rows] == [
        FLOOR,
        "loop (use_foreach=False)",
        "foreach (use_foreach=True)",
        "default (use_foreach=None)",
        "default after flatten_parameters",
    ]
    assert result.rows[0].ratio == 1.0
    for r in result.rows:
        assert 0 < r.q1_s <= r.median_s <= r.q3_s
        assert r.spread >= 0
        assert r.ratio == pytest.approx(r.median_s / result.rows[0].median_s)


def test_rounds_alternate_the_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = bench._time_side_by_side(fns, torch.device("cpu"), 2, sample_s=0.0)
    assert all(len(wall) == 2 for wall, _ in samples.values())
    timed = calls[3 * 4 :]  # after each contender's warm-up and three single calls
    assert timed == ["a", "b", "c", "c", "b", "a"]


def test_warnings_name_a_busy_machine_a_wide_spread_and_a_disturbed_floor():
    calm = [row(FLOOR, 1.0), row("x", 2.0)]
    assert bench._diagnose(calm, 0.1, 2, 1, cpu_clock=True) == []
    busy = bench._diagnose(calm, 1.9, 2, 1, cpu_clock=True)
    assert len(busy) == 1
    assert "busy" in busy[0]
    assert "1.90" in busy[0]
    waited = bench._diagnose([row(FLOOR, 1.0, cpu=0.5), row("x", 2.0)], None, 2, 1, True)
    assert "kept waiting" in waited[0]
    assert "2.0x" in waited[0]
    wide = bench._diagnose([row(FLOOR, 1.0, spread=0.8), row("x", 2.0)], None, 2, 1, True)
    assert "wide spread" in wide[0]
    assert "80%" in wide[0]
    faster = bench._diagnose([row(FLOOR, 10.0), row("x", 2.0)], None, 2, 1, False)
    assert "faster than the floor" in faster[0]


def test_cli_reports_median_spread_and_threads():
    result = CliRunner().invoke(main, ["bench", "--model", "mlp", "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert "1 CPU thread(s)" in result.output
    header = next(line for line in result.output.splitlines() if line.startswith("path"))
    assert header.split() == ["path", "median", "spread", "x", "floor"]
    assert "side by side" in result.output


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"repeats": 0}, "repeats"), ({"threads": 0}, "threads"), ({"sample_ms": -1}, "sample_ms")],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(EMAValueError, match=name):
        bench_update("mlp", **kwargs)


def test_progress_is_reported_after_every_round():
    calls: list[tuple[int, int]] = []
    result = bench_update("mlp", repeats=3, sample_ms=1, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert len(result.rows) == 5


def test_cli_draws_a_progress_bar_unless_asked_not_to():
    shown = CliRunner().invoke(main, ["bench", "--model", "mlp", "--repeats", "2"])
    assert shown.exit_code == 0, shown.output
    assert "timing 5 paths on mlp" in shown.output and "2/2" in shown.output
    quiet = CliRunner().invoke(main, ["bench", "--model", "mlp", "--repeats", "2", "--no-progress"])
    assert quiet.exit_code == 0, quiet.output
    assert "timing 5 paths" not in quiet.output


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_check(tmp_path):
    """benchmarks/gpu_check.py --cpu-dry-run: every check's logic runs on the CPU (meta
    tensors for the sync check, a stub trace for the sync counting, a stub graph), and the
    JSON and the Markdown table come out, so a short GPU session meets no surprise."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": _peers.child_pythonpath(str(root / "src"))}
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "gpu_check.py"), "--cpu-dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert list(checks) == [
        "sync_debug", "profiler_syncs", "kernel_counts", "cuda_graph", "offload", "peers",
        "bandwidth", "step_overhead", "forward_cast", "mixed_precision", "bema", "lora",
    ]  # fmt: skip
    for name, entry in checks.items():
        assert entry["error"] is None and entry["rows"], (name, entry)
        assert entry["ok"], (name, entry["rows"])
    stub = checks["profiler_syncs"]["rows"][0]
    assert stub["config"].startswith("stub trace") and stub["cudaStreamSynchronize"] == 2
    assert all(r["kernels"] == r["expected"] for r in checks["kernel_counts"]["rows"])
    assert all(r["bit_identical"] for r in checks["cuda_graph"]["rows"])
    offload = checks["offload"]["rows"][0]
    assert offload["updates_offloaded"] == offload["updates_on_device"] == offload["steps"]
    peers = {r["contender"] for r in checks["peers"]["rows"]}
    assert {"emakit default", "AveragedModel + get_ema_multi_avg_fn"} <= peers
    assert any("diffusers" in p for p in peers) and any("timm" in p for p in peers)
    # issue 32: the mixed-precision update holds no shadow-sized staging buffer and
    # allocates nothing per update; BEMA and the LoRA EMA are timed against their kernels
    mixed = checks["mixed_precision"]["rows"]
    paths = {r["contender"] for r in mixed}
    assert {f"emakit {p}, ema_dtype=float32" for p in ("default", "use_foreach=True")} <= paths
    assert "emakit compile_update=True, ema_dtype=float32" in paths
    assert {f"emakit default, ema_dtype=float32, cast window {m} MiB" for m in (4, 64)} <= paths
    if not any("refused" in r for r in mixed):
        assert any("bit for bit" in c for c in paths)
    for r in mixed[1:]:
        assert "error" not in r, r
        if "refused" in r:  # compile_update=True on a torch emakit refuses it on (< 2.9)
            assert "compile_update" in r["contender"] and "torch >= 2.9" in r["refused"]
            continue
        if "bit for bit" in r["contender"]:  # the compiled update against the eager one
            assert r["tensors"] > 0 and r["tensors_that_differ"] == 0 and r["ok"]
            continue
        if "cast window" in r["contender"]:  # the eager default with other buffer sizes
            assert r["bytes_per_element"] > 0 and r["x_10B_floor"] > 0
            continue
        fused = "compile_update" in r["contender"]  # no cast buffer at all
        assert r["held_beyond_shadow_MiB"] <= r["limit_MiB"] and r["bytes_per_element"] > 0
        assert (r["held_beyond_shadow_MiB"] == 0) == fused
        assert r["peak_during_update_MiB"] == 0.0
    assert checks["bema"]["rows"][1]["x_floor"] > 0
    lora = checks["lora"]["rows"]
    assert lora[0]["tensors"] == 12 and lora[-1]["ratio"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| check | result |" in md and "## Rows for BENCHMARKS.md (GPU section)" in md
