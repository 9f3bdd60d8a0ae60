"""``emakit demo`` end to end (a few steps) and its plain-function building blocks."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import emakit
from emakit import demo
from emakit.cli import main
from emakit.posthoc import synthesize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEPS = 40


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    # Signature, then the IHDR chunk first, and the IEND chunk last.
    return data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"


def leftover_temps(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo")
    summary = demo.run_demo(out, steps=STEPS, seed=3, progress=False, eval_every=20)
    return out, summary


def test_summary_has_sane_numbers(small_run: tuple[Path, dict]) -> None:
    out, summary = small_run
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("online", "ema"):
        assert 0.0 <= on_disk[f"{key}_accuracy"] <= 1.0
        assert math.isfinite(on_disk[f"{key}_loss"])
        assert on_disk[f"{key}_loss"] > 0
        assert on_disk["results"][key]["accuracy"] == on_disk[f"{key}_accuracy"]
    # 40 noisy steps already learn something: far above the 10% of chance.
    assert on_disk["online_accuracy"] > 0.3
    settings = on_disk["settings"]
    assert settings["steps"] == STEPS
    assert settings["seed"] == 3
    assert settings["beta"] == demo.DEFAULTS.beta
    assert settings["n_train"] + settings["n_test"] == 1797
    assert on_disk["versions"]["emakit"] == emakit.__version__
    assert on_disk["versions"]["torch"] == torch.__version__
    assert on_disk["files"] == {
        "summary": "summary.json",
        "plot": "demo.png",
        "posthoc_snapshots": "posthoc-snapshots",
        "sweep_eval": "emakit-eval.json",
    }
    # the post-hoc settings: what was tracked and what was synthesized from it
    assert on_disk["posthoc"] == {
        "sigma_rels_tracked": [0.05, 0.28],
        "sigma_rel_synthesized": 0.1,
        "synthesized_at_step": STEPS,
        "update_every": 1,
        "checkpoint_every_num_steps": demo.DEFAULTS.posthoc_every,
        "snapshot_folder": "posthoc-snapshots",
    }
    assert "posthoc_accuracy" in on_disk


def test_history_is_consistent(small_run: tuple[Path, dict]) -> None:
    _, summary = small_run
    history = summary["history"]
    assert history["step"] == [20, 40]
    assert len(history["decay"]) == STEPS
    assert all(0.0 <= d <= demo.DEFAULTS.beta for d in history["decay"])
    assert history["ema_accuracy"][-1] == summary["ema_accuracy"]
    # Within update_after_step the EMA is a copy of the model: same predictions.
    assert summary["ema_accuracy"] == summary["online_accuracy"]


def test_plot_is_a_png_and_no_temp_file_is_left(small_run: tuple[Path, dict]) -> None:
    out, _ = small_run
    assert is_png(out / "demo.png")
    assert leftover_temps(out) == []


def test_torch_threads_are_restored(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    demo.run_demo(tmp_path, steps=2, plot=False, progress=False, threads=1)
    assert torch.get_num_threads() == before


def test_same_seed_same_numbers(tmp_path: Path) -> None:
    a = demo.run_demo(tmp_path / "a", steps=15, seed=1, plot=False, progress=False)
    b = demo.run_demo(tmp_path / "b", steps=15, seed=1, plot=False, progress=False)
    assert a["history"] == b["history"]


def test_ema_beats_jitter_after_warmup(tmp_path: Path) -> None:
    # Not a quality gate (see docs/demo.md for real numbers): the EMA must differ from the
    # model once averaging starts, and its decay must follow the warm-up schedule.
    summary = demo.run_demo(
        tmp_path, steps=120, plot=False, progress=False, update_after_step=20, eval_every=60
    )
    decays = summary["history"]["decay"]
    assert decays[:21] == [0.0] * 21
    assert all(a <= b for a, b in itertools.pairwise(decays[21:]))
    assert 0 < decays[-1] <= demo.DEFAULTS.beta


def test_cli_end_to_end_and_rerun_into_the_same_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    runner = CliRunner()
    args = ["demo", "--out", str(out), "--steps", "30", "--seed", "2", "--beta", "0.99"]
    first = runner.invoke(main, args, prog_name="emakit")
    assert first.exit_code == 0, first.output
    for text in ("online", "EMA", "accuracy", "loss", "summary.json"):
        assert text in first.output
    assert is_png(out / "demo.png")
    assert json.loads((out / "summary.json").read_text())["settings"]["beta"] == 0.99

    # Documented: an existing --out folder is reused; the demo's two files are replaced
    # and everything else in it is left alone.
    (out / "notes.txt").write_text("mine")
    old_png = (out / "demo.png").read_bytes()
    second = runner.invoke(
        main, ["demo", "--out", str(out), "--steps", "30", "--seed", "4"], prog_name="emakit"
    )
    assert second.exit_code == 0, second.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["seed"] == 4
    assert summary["settings"]["beta"] == demo.DEFAULTS.beta
    assert (out / "notes.txt").read_text() == "mine"
    assert is_png(out / "demo.png")
    assert (out / "demo.png").read_bytes() != old_png
    assert sorted(p.name for p in out.iterdir()) == [
        "demo.png",
        "emakit-eval.json",
        "notes.txt",
        "posthoc-snapshots",
        "summary.json",
    ]
    # the post-hoc snapshots are the second run's own, not a mix of both runs
    snaps = sorted((out / "posthoc-snapshots").iterdir())
    assert snaps
    assert all("step-000000030" in p.name for p in snaps)


def test_cli_without_out_makes_a_new_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["demo", "--steps", "3", "--no-plot"]
    first = runner.invoke(main, args, prog_name="emakit")
    second = runner.invoke(main, args, prog_name="emakit")
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    folders = sorted(tmp_path.iterdir())
    assert len(folders) == 2  # the second run did not reuse the first one's folder
    for folder in folders:
        assert folder.name.startswith("emakit-demo-")
        assert sorted(p.name for p in folder.iterdir()) == [
            "emakit-eval.json",
            "posthoc-snapshots",
            "summary.json",
        ]


def test_new_output_dir_never_reuses_a_folder(tmp_path: Path) -> None:
    now = dt.datetime(2024, 5, 6, 7, 8, 9)
    first = demo.new_output_dir(tmp_path, now=now)
    second = demo.new_output_dir(tmp_path, now=now)
    third = demo.new_output_dir(tmp_path, now=now)
    assert first.name == "emakit-demo-20240506-070809"
    assert second.name == "emakit-demo-20240506-070809-2"
    assert third.name == "emakit-demo-20240506-070809-3"
    assert all(p.is_dir() for p in (first, second, third))


def test_failed_write_keeps_the_previous_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo.run_demo(tmp_path, steps=2, plot=False, progress=False)
    before = (tmp_path / "summary.json").read_bytes()

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        demo.run_demo(tmp_path, steps=2, seed=5, plot=False, progress=False)
    monkeypatch.undo()
    assert (tmp_path / "summary.json").read_bytes() == before
    assert leftover_temps(tmp_path) == []


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"steps": 0}, "steps"),
        ({"beta": 1.5}, "beta"),
        ({"seed": -1}, "seed"),
        ({"lr": 0.0}, "lr"),
        ({"batch_size": 0}, "batch_size"),
        ({"label_noise": 2.0}, "label_noise"),
        ({"test_fraction": 1.0}, "test_fraction"),
    ],
)
def test_run_demo_rejects_bad_settings(tmp_path: Path, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be .*got {name}="):
        demo.run_demo(tmp_path / "x", progress=False, **kwargs)
    assert not (tmp_path / "x").exists()


def test_run_demo_rejects_unknown_settings_and_file_out(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown settings \\['momentum'\\]"):
        demo.run_demo(tmp_path, progress=False, momentum=0.9)
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="out="):
        demo.run_demo(tmp_path / "f", progress=False)


def test_label_noise_touches_training_labels_only() -> None:
    clean = demo.load_digits_split(0, label_noise=0.0)
    noisy = demo.load_digits_split(0, label_noise=0.5)
    assert torch.equal(clean[0], noisy[0])
    assert torch.equal(clean[2], noisy[2])
    assert torch.equal(clean[3], noisy[3])
    changed = (clean[1] != noisy[1]).float().mean().item()
    assert 0.35 < changed < 0.55  # 50% replaced, 1/10 of those by the true class


def test_results_table_has_a_column_per_model_and_tolerates_missing_metrics() -> None:
    from rich.console import Console

    final = {
        "online": {"accuracy": 0.9, "loss": 0.3, "accuracy_late_mean": 0.9},
        "ema": {"accuracy": 0.95, "loss": 0.2},
    }
    console = Console(width=120, record=True)
    console.print(demo.results_table(final))
    text = console.export_text()
    assert "online" in text
    assert "EMA" in text
    assert "95.00%" in text
    assert "0.2000" in text
    assert demo.summary_metrics(final)["ema_loss"] == 0.2


def test_rerun_with_no_plot_removes_the_stale_plot(tmp_path: Path) -> None:
    out = tmp_path / "run"
    runner = CliRunner()
    first = runner.invoke(main, ["demo", "--out", str(out), "--steps", "5"], prog_name="emakit")
    assert first.exit_code == 0, first.output
    assert is_png(out / "demo.png")
    second = runner.invoke(
        main, ["demo", "--out", str(out), "--steps", "5", "--no-plot"], prog_name="emakit"
    )
    assert second.exit_code == 0, second.output
    assert not (out / "demo.png").exists()
    assert json.loads((out / "summary.json").read_text())["files"]["plot"] is None


def test_demo_prints_the_snapshot_folder_and_the_cli_finds_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    runner = CliRunner()
    args = ["demo", "--out", str(out), "--steps", "200", "--no-plot"]
    result = runner.invoke(main, args, prog_name="emakit")
    assert result.exit_code == 0, result.output
    snapshots = out / "posthoc-snapshots"
    assert f"post-hoc EMA snapshots: {snapshots}" in " ".join(result.output.split())
    # the folder the demo printed works for inspect and synthesize: they find the subfolder
    inspected = runner.invoke(main, ["inspect", str(out)], prog_name="emakit")
    assert inspected.exit_code == 0, inspected.output
    assert f"using {snapshots}" in inspected.output
    assert "sigma_rel" in inspected.output
    target = tmp_path / "ema.safetensors"
    synthesized = runner.invoke(
        main,
        ["synthesize", str(out), "--sigma-rel", "0.15", "--out", str(target), "--no-progress"],
        prog_name="emakit",
    )
    assert synthesized.exit_code == 0, synthesized.output
    assert target.is_file()
    # sweep needs no --eval on the demo's folder: its emakit-eval.json names the scoring,
    # the held-out loss of this run's split (issue 31)
    swept = runner.invoke(
        main, ["sweep", str(out), "--sigma-rel", "0.05,0.15,0.25"], prog_name="emakit"
    )
    assert swept.exit_code == 0, swept.output
    assert "scoring with emakit.demo.training:held_out_loss" in swept.output
    best = re.search(r"best: sigma_rel=([\d.]+) \(score ([\d.]+)", swept.output)
    assert best is not None, swept.output
    state = synthesize(snapshots, sigma_rel=float(best.group(1)))
    assert demo.held_out_loss(state, seed=0) == pytest.approx(float(best.group(2)), rel=1e-5)


def test_demo_help_says_what_out_holds() -> None:
    result = CliRunner().invoke(main, ["demo", "--help"], prog_name="emakit")
    text = " ".join(result.output.split())
    assert "posthoc-snapshots" in text
    assert "emptied and rewritten" in text
    assert "removed with --no-plot" in text
