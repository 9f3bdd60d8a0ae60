"""One command line (issue 41, item 3): every command that takes a run folder takes an
``emakit demo`` output folder (snapshots in its ``posthoc-snapshots/``) and a snapshot
folder alike, and every long-running command takes ``--progress/--no-progress``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from emakit import PostHocEMA
from emakit.cli import main

LONG_COMMANDS = ("synthesize", "sweep", "demo", "bench")


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out as the demo lays out its output."""
    run = tmp_path_factory.mktemp("run")
    net = torch.nn.Linear(4, 2)
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps=5,
        checkpoint_folder=run / "posthoc-snapshots",
    )
    for _ in range(40):
        with torch.no_grad():
            net.weight.add_(0.01)
        ema.update()
    return run


def invoke(*args: str) -> object:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.mark.parametrize("which", ["run folder", "snapshot folder"])
@pytest.mark.filterwarnings("ignore::emakit.posthoc.math.PostHocWarning")  # a short run
def test_every_folder_command_takes_the_run_folder_and_the_snapshot_folder(
    run_folder: Path, tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = run_folder if which == "run folder" else run_folder / "posthoc-snapshots"
    note = "holds no snapshots itself; using"
    (tmp_path / "score_probe.py").write_text("def score(state):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    runs = {
        "inspect": invoke("inspect", str(folder)),
        "synthesize": invoke(
            "synthesize", str(folder), "--sigma-rel", "0.1", "--out", str(tmp_path / "e.pt"),
            "--no-progress",
        ),
        "sweep": invoke(
            "sweep", str(folder), "--sigma-rel", "0.1,0.2", "--eval", "score_probe:score",
            "--no-progress",
        ),
        "convert": invoke("convert", "--to", "ema-pytorch", str(folder), str(tmp_path / "c")),
    }  # fmt: skip
    for name, result in runs.items():
        assert result.exit_code == 0, (name, result.output)
        assert (note in result.output) is (which == "run folder"), (name, result.output)
    assert (tmp_path / "e.pt").is_file() and any((tmp_path / "c").iterdir())
    assert "best: sigma_rel=" in runs["sweep"].output


@pytest.mark.parametrize("name", LONG_COMMANDS)
def test_every_long_command_takes_no_progress(name: str) -> None:
    command = main.get_command(None, name)  # type: ignore[arg-type]
    if name not in ("demo", "bench"):  # the lazy commands: their module's object
        from emakit.cli import lazy_command

        command = lazy_command(name)
    flags = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    assert {"--progress", "--no-progress"} <= flags, name
    assert "--no-progress" in invoke(name, "--help").output


@pytest.mark.filterwarnings("ignore::emakit.posthoc.math.PostHocWarning")  # a short run
def test_sweep_shows_a_bar_of_lengths_unless_told_not_to(
    run_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "score_probe2.py").write_text("def score(state):\n    return 2.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = ["sweep", str(run_folder), "--sigma-rel", "0.1,0.2,0.25", "--eval", "score_probe2:score"]
    shown = CliRunner().invoke(main, args)
    quiet = CliRunner().invoke(main, [*args, "--no-progress"])
    assert shown.exit_code == quiet.exit_code == 0
    assert "lengths" in shown.output and "lengths" not in quiet.output
    assert shown.output.count("0.2") >= 1 and "best: sigma_rel=" in quiet.output


def test_demo_without_a_bar_still_reports(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("rich")
    result = invoke(
        "demo", "--out", str(tmp_path / "d"), "--steps", "3", "--no-plot", "--no-progress"
    )
    assert result.exit_code == 0, result.output
    assert "training" not in result.output  # the bar's label
    assert "wrote" in result.output and (tmp_path / "d" / "summary.json").is_file()


def test_inspect_shows_the_checkpoints_own_step_beside_the_emas(tmp_path: Path) -> None:
    """docs/resume.md compares a checkpoint's ``"step"`` with its EMA's: both are shown."""
    from emakit import EMA

    net = torch.nn.Linear(2, 2)
    ema = EMA(net, update_after_step=0, update_every=1)
    for _ in range(3):
        ema.update()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": net.state_dict(), "ema": ema.state_dict(), "step": 120}, path)
    result = invoke("inspect", str(path))
    assert result.exit_code == 0, result.output
    assert "EMA state_dict at ['ema'] of a checkpoint dict; the checkpoint's own step 120" in (
        result.output
    )
    assert "  step: 3" in result.output
    torch.save({"ema": ema.state_dict(), "epoch": torch.tensor(4), "step": 1.5}, path)
    assert "the checkpoint's own epoch 4:" in invoke("inspect", str(path)).output


def test_inspect_invents_no_version_for_an_ema_pytorch_state(tmp_path: Path) -> None:
    import ema_pytorch

    from emakit import EMA

    net = torch.nn.Linear(2, 2)
    peer = ema_pytorch.EMA(net, update_after_step=0, update_every=1)
    peer.update()
    torch.save(peer.state_dict(), tmp_path / "peer.pt")
    shown = invoke("inspect", str(tmp_path / "peer.pt")).output
    assert "version" not in shown and "  step: 1" in shown
    torch.save(EMA(net).state_dict(), tmp_path / "ours.pt")  # emakit's layout version
    assert "  version: 2" in invoke("inspect", str(tmp_path / "ours.pt")).output
