"""The post-hoc sweep (issue 23, item 3): many lengths in one pass over the snapshots,
checked against one ``synthesize_ema_model`` per length; the folder API and the
``emakit sweep`` command; scores that are all NaN or not numbers (issue 30, item 8)."""

from __future__ import annotations

import collections
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from _models import seeded
from emakit import EMATypeError, EMAValueError, PostHocEMA
from emakit.cli import main
from emakit.posthoc import (
    PostHocWarning,
    SweepResult,
    list_snapshots,
    sweep,
    sweep_lengths,
    synthesize,
    synthesize_state_dict,
)
from emakit.posthoc.commands import sweep_cmd
from emakit.posthoc.snapshots import format as reading_module

LENGTHS = [0.07, 0.1, 0.15, 0.2, 0.25]
X = torch.randn(32, 6, generator=torch.Generator().manual_seed(7))
Y = torch.randn(32, 2, generator=torch.Generator().manual_seed(8))


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


def loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float((model.eval()(X) - Y).pow(2).mean())


def state_loss(state: dict[str, torch.Tensor]) -> float:
    """``--eval`` for the command line: the folder API passes state dicts."""
    model = net()
    model.load_state_dict(state)
    return loss(model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> PostHocEMA:
    folder = tmp_path_factory.mktemp("sweep")
    model = seeded(net, 0)
    ema = PostHocEMA(model, update_every=1, checkpoint_every_num_steps=5, checkpoint_folder=folder)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(16, 6, generator=g)
        (model(x) - x[:, :2]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    return ema


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        yield


def test_sweep_equals_one_synthesis_per_length(trained: PostHocEMA) -> None:
    result = trained.sweep(loss, sigma_rels=LENGTHS, lengths_per_pass=2)
    assert isinstance(result, SweepResult) and result.step == 40
    want = [(s, loss(trained.synthesize_ema_model(sigma_rel=s).ema_model)) for s in LENGTHS]
    assert list(result) == want  # same sums in the same order: the same bits
    assert dict(result) == dict(want)
    assert result.best == min(want, key=lambda p: p[1])
    assert result.tracked == (0.05, 0.28)
    best = max(want, key=lambda p: p[1])
    assert trained.sweep(loss, sigma_rels=LENGTHS, mode="max").best == best


def test_sweep_reads_each_snapshot_once_per_pass(
    trained: PostHocEMA, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: collections.Counter[str] = collections.Counter()
    real = reading_module.SafetensorsFile

    def counting(path, *args, **kwargs):
        opened[Path(path).name] += 1
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reading_module, "SafetensorsFile", counting)
    monkeypatch.setattr(reading_module, "open_snapshot", reading_module.open_snapshot)
    sweep(trained.checkpoint_folder, state_loss, LENGTHS, lengths_per_pass=8)
    snaps = list_snapshots(trained.checkpoint_folder)
    early = [s.path.name for s in snaps if s.step < 40]
    assert early and all(opened[n] == 1 for n in early), opened  # one pass: once each
    opened.clear()
    sweep(trained.checkpoint_folder, state_loss, LENGTHS, lengths_per_pass=2)
    assert all(opened[n] == 3 for n in early), opened  # 5 lengths, 2 per pass: 3 passes


def test_sweep_from_a_folder_matches_synthesize_state_dict(trained: PostHocEMA) -> None:
    seen: list[dict[str, torch.Tensor]] = []

    def keep(state: dict[str, torch.Tensor]) -> float:
        seen.append(state)
        return state_loss(state)

    result = sweep(trained.checkpoint_folder, keep, LENGTHS[:3], step=30)
    assert result.step == 30
    for (s, _), state in zip(result, seen, strict=True):
        want = synthesize_state_dict(trained.checkpoint_folder, sigma_rel=s, step=30)
        assert state.keys() == want.keys()
        assert all(torch.equal(state[n], want[n]) for n in want)


def test_one_verb_per_job_and_a_spec_for_the_lengths(trained: PostHocEMA) -> None:
    """``synthesize()`` is the folder's synthesis (``synthesize_state_dict`` its old name,
    the same result); both sweeps take the lengths as a list or as an ``A:B:N`` / ``A,B``
    spec, with the same scores."""
    folder = trained.checkpoint_folder
    new, old = synthesize(folder, sigma_rel=0.15), synthesize_state_dict(folder, sigma_rel=0.15)
    assert new.keys() == old.keys() and all(torch.equal(new[n], old[n]) for n in new)
    lengths = sweep_lengths("0.1:0.2:3")
    assert list(sweep(folder, state_loss, "0.1:0.2:3")) == list(sweep(folder, state_loss, lengths))
    assert list(trained.sweep(loss, "0.1,0.2")) == list(trained.sweep(loss, [0.1, 0.2]))
    with pytest.raises(EMAValueError, match="A:B:N"):
        trained.sweep(loss, "0.1:0.2")


def test_sweep_plot_and_table(trained: PostHocEMA, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = trained.sweep(loss, sigma_rels=LENGTHS, plot=tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    table = result.table()
    assert table.count("\n") == len(LENGTHS) and table.count("<- best") == 1


def test_sweep_lengths_and_bad_input(trained: PostHocEMA) -> None:
    assert sweep_lengths("0.05:0.25:5") == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.25])
    assert sweep_lengths("0.1,0.2") == [0.1, 0.2]
    for bad in ("0.05:0.25", "a:b:3", "0.05:0.3:0", "0.05:0.5:3"):
        with pytest.raises(EMAValueError, match="sigma_rel"):
            sweep_lengths(bad)
    with pytest.raises(EMAValueError, match="mode must be 'min'"):
        trained.sweep(loss, sigma_rels=[0.1], mode="best")  # type: ignore[arg-type]
    with pytest.raises(EMAValueError, match="at least one length"):
        trained.sweep(loss, sigma_rels=[])
    with pytest.raises(EMAValueError, match="lengths_per_pass"):
        trained.sweep(loss, sigma_rels=[0.1], lengths_per_pass=0)


def test_sweep_command(
    trained: PostHocEMA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")  # --plot: the demo extra
    (tmp_path / "sweep_eval.py").write_text(
        "import torch\nfrom test_posthoc_sweep import state_loss\n"
    )
    monkeypatch.chdir(tmp_path)
    args = ["sweep", str(trained.checkpoint_folder), "--sigma-rel", "0.07:0.25:4"]
    got = CliRunner().invoke(main, [*args, "--eval", "sweep_eval:state_loss", "--plot", "s.png"])
    assert got.exit_code == 0, got.output
    want = sweep(trained.checkpoint_folder, state_loss, sweep_lengths("0.07:0.25:4"))
    best, score = want.best
    assert f"best: sigma_rel={best:.6g} (score {score:.6g}, step 40)" in got.output
    assert got.output.count("<- best") == 1 and (tmp_path / "s.png").exists()
    bad = CliRunner().invoke(main, [*args, "--eval", "sweep_eval:nothing"])
    assert bad.exit_code == 2 and "has no function 'nothing'" in bad.output


# -- the scores: all NaN, or not numbers (issue 30, item 8) -----------------------------------


def test_a_sweep_whose_scores_are_all_nan_says_so(tiny_lora_folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        result = sweep(tiny_lora_folder, lambda state: float("nan"), [0.1, 0.2])
    with pytest.raises(EMAValueError, match="every score of the sweep is NaN"):
        _ = result.best
    assert "<- best" not in result.table()
    partial = type(result)(((0.1, math.nan), (0.2, 3.0)), 16, (0.05,), "min")
    assert partial.best == (0.2, 3.0)  # a NaN never wins over a number


def write_eval(tmp_path: Path, body: str) -> None:
    (tmp_path / "scores_eval.py").write_text(f"def score(state):\n    return {body}\n")
    sys.modules.pop("scores_eval", None)


def test_the_sweep_command_with_nan_scores_is_a_clear_error(
    tiny_lora_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --eval appends the current folder
    write_eval(tmp_path, "float('nan')")
    got = CliRunner().invoke(
        sweep_cmd, [str(tiny_lora_folder), "--sigma-rel", "0.1,0.2", "--eval", "scores_eval:score"]
    )
    assert got.exit_code == 1 and "every score of the sweep is NaN" in got.output, got.output
    assert "best: sigma_rel" not in got.output and "Traceback" not in got.output


@pytest.mark.parametrize(
    ("body", "shown"),
    [("'0.5'", "'0.5'"), ("None", "None"), ("[1.0]", "[1.0]"), ("1j", "1j"), ("True", "True")],
)
def test_an_eval_returning_a_non_number_names_the_function_and_the_value(
    tiny_lora_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, shown: str
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # --eval appends the current folder
    write_eval(tmp_path, body)
    got = CliRunner().invoke(
        sweep_cmd, [str(tiny_lora_folder), "--sigma-rel", "0.1", "--eval", "scores_eval:score"]
    )
    assert got.exit_code == 1, got.output
    assert "scores_eval.score must return a number" in got.output and shown in got.output
    assert "Traceback" not in got.output


def test_an_eval_may_return_numbers_of_any_kind(tiny_lora_folder: Path):
    import numpy as np

    for value, want in ((np.float32(2.5), 2.5), (torch.tensor([1.5]), 1.5), (3, 3.0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PostHocWarning)
            result = sweep(tiny_lora_folder, lambda state, v=value: v, [0.1])
        assert result.pairs == ((0.1, want),)
    with pytest.raises(EMATypeError, match=r"must return a number.*tensor"):
        sweep(tiny_lora_folder, lambda state: torch.ones(2), [0.1])
