"""``emakit synthesize`` and ``emakit inspect``, invoked through click's test runner."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from _models import bn_mlp
from emakit.posthoc import PostHocEMA, plan_synthesis
from emakit.posthoc.commands import inspect_cmd, sweep_cmd, synthesize


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


make_net = partial(bn_mlp, 4, 8, 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[PostHocEMA, Path]:
    folder = tmp_path_factory.mktemp("snapshots")
    net = make_net()
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=2,
        checkpoint_every_num_steps=20,
        checkpoint_folder=folder,
        checkpoint_dtype=torch.float32,
    )
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(200):
        net(torch.randn(16, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
    (folder / "notes.txt").write_text("unrelated")
    return ema, folder


def test_synthesize_writes_a_file_that_loads_into_the_model(trained, tmp_path: Path):
    ema, folder = trained
    out = tmp_path / "ema.safetensors"
    result = CliRunner().invoke(
        synthesize, [str(folder), "--sigma-rel", "0.1", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "sigma_rel=0.1" in result.output
    net = make_net()
    net.load_state_dict(load_file(str(out)))  # strict: every key of the model
    expected = ema.synthesize_ema_model(sigma_rel=0.1).ema_model
    assert torch.equal(net[0].weight, expected[0].weight)
    assert int(net[1].num_batches_tracked) == 200
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "emakit.posthoc.synthesized"
    assert (meta["sigma_rel"], meta["step"]) == ("0.1", "200")


def test_several_sigma_rels_give_several_clearly_named_files(trained, tmp_path: Path):
    _, folder = trained
    out = tmp_path / "out" / "ema.safetensors"
    result = CliRunner().invoke(
        synthesize,
        [str(folder), "--sigma-rel", "0.05, 0.1,0.15", "--step", "120", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == [
        "ema.sigma_rel-0.05.safetensors",
        "ema.sigma_rel-0.1.safetensors",
        "ema.sigma_rel-0.15.safetensors",
    ]
    for name in names:
        with safe_open(str(out.parent / name), framework="pt") as f:
            assert f.metadata()["step"] == "120"
    # --gamma works too and matches the same sigma_rel
    gamma = plan_synthesis(folder, sigma_rel=0.1).gamma
    by_gamma = tmp_path / "g.safetensors"
    result = CliRunner().invoke(
        synthesize, [str(folder), "--gamma", repr(gamma), "--step", "120", "--out", str(by_gamma)]
    )
    assert result.exit_code == 0, result.output
    a, b = load_file(str(by_gamma)), load_file(str(out.parent / "ema.sigma_rel-0.1.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sigma-rel", "0.5"], "sigma_rel must be a finite number in (0, 0.300283]"),
        (["--sigma-rel", "nan"], "sigma_rel must be a finite number in"),
        (["--sigma-rel", "0.1", "--step", "5"], "step=5 is before the first snapshot (step 20)"),
        (["--sigma-rel", "abc"], "expected comma-separated numbers"),
        ([], "give exactly one of --sigma-rel and --gamma"),
        (["--sigma-rel", "0.1", "--gamma", "3"], "give exactly one"),
    ],
)
def test_synthesize_bad_input_gives_clear_errors(trained, tmp_path: Path, args, message):
    _, folder = trained
    result = CliRunner().invoke(
        synthesize, [str(folder), *args, "--out", str(tmp_path / "x.safetensors")]
    )
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "x.safetensors").exists()


def test_synthesize_missing_or_empty_folder(tmp_path: Path):
    runner = CliRunner()
    result = runner.invoke(
        synthesize,
        [str(tmp_path / "nope"), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.safetensors")],
    )
    assert result.exit_code == 1 and "does not exist" in result.output
    result = runner.invoke(
        synthesize, [str(tmp_path), "--sigma-rel", "0.1", "--out", str(tmp_path / "x.safetensors")]
    )
    assert result.exit_code == 1 and "no post-hoc EMA snapshots" in result.output


def test_inspect_folder_lists_profiles(trained):
    _, folder = trained
    result = CliRunner().invoke(inspect_cmd, [str(folder)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "sigma_rel" in out and "gamma" in out
    assert "0.05" in out and "16.9722" in out and "0.28" in out and "0.169344" in out
    assert "20..200" in out and "F32" in out
    assert "20 snapshots at 10 steps" in out
    assert "1 other file(s) in the folder ignored" in out


def test_inspect_files(trained, tmp_path: Path):
    ema, folder = trained
    runner = CliRunner()
    snap = sorted(folder.glob("step-*.safetensors"))[0]
    result = runner.invoke(inspect_cmd, [str(snap)])
    assert result.exit_code == 0, result.output
    assert "post-hoc EMA snapshot" in result.output and "step 20" in result.output
    assert "gamma=" in result.output and "copied" in result.output

    out = tmp_path / "ema.safetensors"
    runner.invoke(synthesize, [str(folder), "--sigma-rel", "0.1", "--out", str(out)])
    result = runner.invoke(inspect_cmd, [str(out)])
    assert result.exit_code == 0 and "emakit.posthoc.synthesized" in result.output

    state = tmp_path / "state.pt"
    torch.save(ema.state_dict(), state)
    result = runner.invoke(inspect_cmd, [str(state)])
    assert result.exit_code == 0, result.output
    assert "gammas" in result.output and "torch checkpoint" in result.output

    result = runner.invoke(inspect_cmd, [str(tmp_path / "missing")])
    assert result.exit_code == 1 and "does not exist" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(inspect_cmd, [str(empty)])
    assert result.exit_code == 1 and "no emakit post-hoc snapshots" in result.output


def test_inspect_finds_an_ema_nested_in_a_training_checkpoint(tmp_path: Path):
    """A plain training checkpoint holds the EMA's state under a key of its own: inspect
    finds it, says where, and lists the EMA's tensors (issue 31: it counted the rng state)."""
    from emakit import EMA

    net = make_net()
    ema = EMA(net, update_after_step=0)
    ema.update()
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "model": net.state_dict(),
            "optim": {"state": {}, "param_groups": []},
            "train": {"ema": ema.state_dict(), "epoch": 3},
            "rng": torch.get_rng_state(),
        },
        path,
    )
    result = CliRunner().invoke(inspect_cmd, [str(path)])
    assert result.exit_code == 0, result.output
    assert "EMA state_dict at ['train']['ema'] of a checkpoint dict" in result.output
    assert "step: 1" in result.output and "EMA: " in result.output
    assert "uint8" not in result.output  # the rng state is not taken for the EMA

    torch.save({"ema": ema.state_dict(), "ema_slow": ema.state_dict()}, path)
    result = CliRunner().invoke(inspect_cmd, [str(path)])
    assert "EMA state_dict at ['ema'] of a checkpoint dict (more at ['ema_slow'])" in (
        result.output
    )


def test_sweep_without_eval_needs_an_emakit_eval_file(trained, tmp_path: Path):
    """Without --eval, sweep scores with the function a folder's emakit-eval.json names
    (the demo writes one), and only one of emakit's: a folder from elsewhere does not
    choose the code that runs."""
    _, folder = trained
    runner = CliRunner()
    result = runner.invoke(sweep_cmd, [str(folder), "--sigma-rel", "0.1"])
    assert result.exit_code == 2 and "Missing option '--eval'" in result.output
    assert "emakit-eval.json" in result.output
    spec = folder / "emakit-eval.json"
    try:
        spec.write_text('{"eval": "os:getcwd"}')
        result = runner.invoke(sweep_cmd, [str(folder), "--sigma-rel", "0.1"])
        assert result.exit_code == 2 and "not one of emakit's evaluations" in result.output
        spec.write_text('{"eval": "emakit.posthoc.math:missing"}')  # tests/test_eval_file.py
        result = runner.invoke(sweep_cmd, [str(folder), "--sigma-rel", "0.1"])
        assert result.exit_code == 2 and "not one of emakit's evaluations" in result.output
    finally:
        spec.unlink()
