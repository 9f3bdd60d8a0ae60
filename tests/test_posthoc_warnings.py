"""A poor post-hoc fit warns with its real cause: a target step after the last snapshot
at or before it, a length outside the tracked ones, or too few snapshots; a target step
after the folder's last snapshot is refused."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _models import TINY_LORA_POSTHOC, TINY_LORA_SGD, TinyLora, train
from emakit import EMAValueError, PostHocEMA, PostHocWarning
from emakit.posthoc import plan_synthesis, sweep
from emakit.posthoc.commands import synthesize as synthesize_cmd


def run(folder, steps: int, every: int) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 3)
    posthoc = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps=every,
        checkpoint_folder=folder,
    )
    for _ in range(steps):
        with torch.no_grad():
            net.weight.add_(0.01)
        posthoc.update()


def message(folder, **target) -> str:
    """The poor-fit warning's text (other post-hoc warnings may come with it)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan_synthesis(folder, **target)
    texts = [str(w.message) for w in record if issubclass(w.category, PostHocWarning)]
    poor = [t for t in texts if "only roughly" in t]
    assert len(poor) == 1, texts
    return poor[0]


def test_target_step_after_the_last_snapshot_is_refused(tmp_path):
    """After the last snapshot the EMA was never recorded: one rule, an error naming the
    last snapshot's step, however close the step (issue 30, item 20; a step between two
    snapshots warns as below, see test_posthoc.py::test_buffers_come_from_the_latest_snapshot)."""
    run(tmp_path, 1000, 50)
    for step in (1001, 1300, 10**6):
        with pytest.raises(EMAValueError, match=rf"step={step} is after the last snapshot"):
            plan_synthesis(tmp_path, sigma_rel=0.1, step=step)
    with pytest.raises(
        EMAValueError, match=r"after the last snapshot \(step 1000\).* \[50, 1000\]"
    ):
        plan_synthesis(tmp_path, sigma_rel=0.1, step=1300)


def test_target_outside_the_tracked_lengths(tmp_path):
    run(tmp_path, 1000, 50)
    text = message(tmp_path, sigma_rel=0.02)
    assert "outside the tracked profiles (0.05, 0.28)" in text
    assert "extrapolates" in text
    assert "too few" not in text
    assert "before the target" not in text


def test_too_few_snapshots(tmp_path):
    run(tmp_path, 200, 50)
    text = message(tmp_path, sigma_rel=0.15)
    assert "8 snapshot(s) at 4 step(s) (50..200) are too few" in text
    assert "checkpoint_every_num_steps" in text
    assert "pick a step" not in text
    assert "outside" not in text


def test_a_good_fit_does_not_warn(tmp_path):
    """The README's post-hoc example: 200 steps, a snapshot every 20, sigma_rel 0.15."""
    run(tmp_path, 200, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PostHocWarning)
        plan = plan_synthesis(tmp_path, sigma_rel=0.15)
    assert plan.solution.residual < 0.05


@pytest.mark.parametrize("step", [17, 3000, 99999])
def test_a_step_after_the_last_snapshot_is_refused_naming_it(tiny_lora_folder: Path, step: int):
    with pytest.raises(EMAValueError, match=rf"step={step} is after the last snapshot \(step 16\)"):
        plan_synthesis(tiny_lora_folder, sigma_rel=0.1, step=step)
    got = CliRunner().invoke(
        synthesize_cmd,
        [
            str(tiny_lora_folder),
            "--sigma-rel",
            "0.1",
            "--step",
            str(step),
            "--out",
            str(tiny_lora_folder / "o.pt"),
        ],
    )
    assert got.exit_code == 1 and "after the last snapshot" in got.output, got.output
    assert (
        "(step 16)" in got.output
        and "[4, 16]" in got.output
        and not (tiny_lora_folder / "o.pt").exists()
    )
    with pytest.raises(EMAValueError, match="after the last snapshot"):
        sweep(tiny_lora_folder, lambda state: 0.0, [0.1], step=step)


def test_a_step_between_snapshots_or_at_the_last_is_used(tiny_lora_folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PostHocWarning)
        assert plan_synthesis(tiny_lora_folder, sigma_rel=0.1, step=16).step == 16
        between = plan_synthesis(tiny_lora_folder, sigma_rel=0.1, step=14)
    assert between.step == 14 and max(s.step for s in between.snapshots) == 12


def test_posthoc_ema_synthesis_follows_the_same_rule(tmp_path: Path):
    torch.manual_seed(0)
    net = TinyLora()
    ema = PostHocEMA(net, checkpoint_folder=tmp_path / "s", **TINY_LORA_POSTHOC)
    train(net, [ema], range(18), **TINY_LORA_SGD)  # snapshots at 4..16; the EMA is at step 18
    with pytest.raises(EMAValueError, match=r"after the last snapshot \(step 16\)"):
        ema.synthesize_ema_model(sigma_rel=0.1, step=18)
