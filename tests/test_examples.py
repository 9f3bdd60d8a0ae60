"""Every script in examples/ runs (on CPU, with small settings) and does what it says."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _peers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# script -> (arguments for a fast run, the extra it needs, text its output must hold)
RUNS = {
    "plain_loop.py": (
        ["--steps", "200"],
        None,
        ["EMA bit-identical to the uninterrupted run: True"],
    ),
    "posthoc_sweep.py": (["--steps", "300", "--points", "4"], "matplotlib", ["<- best"]),
    "lightning_ema.py": (["--epochs", "1"], "lightning", ["EMA weights", "['emakit_ema']"]),
    "accelerate_ema.py": (
        ["--steps", "40"],
        "accelerate",
        ["10 EMA updates (one per optimizer step)", "restored by accelerator.load_state: True"],
    ),
}


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script: str, tmp_path: Path):
    args, extra, expected = RUNS[script]
    if extra is not None and importlib.util.find_spec(extra) is None:
        pytest.skip(f"{script} needs {extra}")
    if script == "posthoc_sweep.py":
        args = [*args, "--plot", str(tmp_path / "sweep.png")]
    env = {**os.environ, "PYTHONPATH": _peers.child_pythonpath()}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr
    if script == "posthoc_sweep.py":
        assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")
        # the sweep stays inside the tracked lengths: no poor-fit warning
        assert "PostHocWarning" not in proc.stderr


def test_posthoc_sweep_finds_a_better_length_than_the_online_weights():
    """The example's point: some synthesized EMA length beats the raw weights."""
    import torch

    spec = importlib.util.spec_from_file_location("posthoc_sweep", EXAMPLES / "posthoc_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        result = module.main(["--steps", "300", "--points", "3"])
    finally:
        torch.set_num_threads(threads)
    sweep = result["sweep"]
    assert len(sweep) == 3
    assert min(sweep.values()) < result["online"]
    assert sweep[result["best"]] == min(sweep.values())


def test_examples_load_checkpoints_safely():
    """The examples follow the Security section: torch files are loaded with
    ``weights_only=True`` (no pickled code runs), never ``weights_only=False``."""
    for path in sorted(EXAMPLES.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert "weights_only=False" not in text, path.name
        for call in text.split("torch.load(")[1:]:
            assert "weights_only=True" in call.split(")")[0], f"{path.name}: torch.load({call[:60]}"
