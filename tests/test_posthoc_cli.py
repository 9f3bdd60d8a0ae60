"""``emakit synthesize``, ``emakit sweep`` and ``emakit inspect``, invoked through click's
test runner: their results, the options they share (the folder, ema-pytorch's profiles,
lists of numbers) and what they say where (stdout, stderr, the exit code)."""

from __future__ import annotations

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from _models import bn_mlp, train
from emakit.errors import EMAValueError
from emakit.inspection import inspect_cmd
from emakit.posthoc import PostHocEMA, plan_synthesis
from emakit.posthoc.command_line import fail
from emakit.posthoc.commands import sweep_cmd, synthesize
from emakit.posthoc.snapshots.legacy import legacy_filename, legacy_state

pytestmark = pytest.mark.usefixtures("one_thread")


make_net = partial(bn_mlp, 4, 8, 2)


def runner() -> CliRunner:
    """A runner keeping stderr apart from stdout (click >= 8.2 always does; before it,
    ``mix_stderr=False``, which click 8.2 removed, asks for it)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


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
    train(net, [ema], 200, batch=(16, 4), lr=0.05, seed=0)
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


# -- the folder: a demo run's snapshot subfolder ------------------------------------------------


def test_a_folder_holding_one_snapshot_folder_is_read_there_said_on_stderr(trained, tmp_path: Path):
    """A demo run's folder holds its snapshots in a subfolder: the commands use it and say
    so on stderr (stdout keeps the results); given the snapshot folder itself, nothing is
    said."""
    _, folder = trained
    run = tmp_path / "emakit-demo-run"
    snapshots = run / "posthoc-snapshots"
    shutil.copytree(folder, snapshots)
    out = tmp_path / "ema.safetensors"
    args = ["--sigma-rel", "0.1", "--out", str(out), "--no-progress", "--force"]
    result = runner().invoke(synthesize, [str(run), *args])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"Note: {run} holds no snapshots itself; using {snapshots}\n"
    assert result.stdout.startswith(f"wrote {out}  (sigma_rel=0.1,")
    result = runner().invoke(synthesize, [str(snapshots), *args])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


@pytest.mark.parametrize(
    "legacy", [[], ["--legacy-sigma-rels", "0.05", "--legacy-update-every", "1"]]
)
def test_sweep_of_a_folder_that_does_not_exist_says_so(tmp_path: Path, legacy: list[str]):
    """As synthesize and inspect do, and as sweep does with --eval: a mistyped folder is
    named as missing, not taken for a folder without an emakit-eval.json."""
    missing = tmp_path / "typo"
    result = runner().invoke(sweep_cmd, [str(missing), "--sigma-rel", "0.1:0.2:2", *legacy])
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"Error: snapshot folder {str(missing)!r} does not exist; pass the checkpoint_folder "
        f"that PostHocEMA wrote its snapshots to\n"
    )


# -- ema-pytorch's profiles: --legacy-sigma-rels / --legacy-gammas, --legacy-update-every ----

NEEDS_UPDATE_EVERY = (
    "--legacy-sigma-rels / --legacy-gammas need --legacy-update-every N too: the "
    "update_every of the ema-pytorch run (its default: 100); it sets where each file's "
    "averaging ends"
)


@pytest.mark.parametrize(
    ("legacy", "message"),
    [
        (
            ["--legacy-sigma-rels", "0.05", "--legacy-gammas", "16.97"],
            "give at most one of --legacy-sigma-rels and --legacy-gammas",
        ),
        (["--legacy-sigma-rels", "0.05,0.28"], NEEDS_UPDATE_EVERY),
        (["--legacy-gammas", "16.97,0.17"], NEEDS_UPDATE_EVERY),
    ],
)
@pytest.mark.parametrize("command", ["synthesize", "sweep", "inspect"])
def test_legacy_profile_options_that_do_not_fit_together_are_a_usage_error(
    trained, tmp_path: Path, command: str, legacy: list[str], message: str
):
    _, folder = trained
    out = tmp_path / "ema.safetensors"
    cmd, args = {
        "synthesize": (synthesize, ["--sigma-rel", "0.1", "--out", str(out)]),
        "sweep": (sweep_cmd, ["--sigma-rel", "0.1:0.2:2"]),
        "inspect": (inspect_cmd, []),
    }[command]
    result = runner().invoke(cmd, [str(folder), *args, *legacy])
    assert result.exit_code == 2, result.output
    assert result.stderr.endswith(f"\nError: {message}\n") and result.stdout == ""
    assert not out.exists()


def write_ema_pytorch_folder(folder: Path, names: list[str], profiles: int, steps: range) -> None:
    """ema-pytorch's snapshot files ``<profile index>.<step>.pt`` holding the tensors
    ``names`` (in float16, as ema-pytorch stores them; its counters too)."""
    folder.mkdir()
    tensors = {n: torch.full((2,), float(i), dtype=torch.float16) for i, n in enumerate(names)}
    for step in steps:
        for profile in range(profiles):
            torch.save(legacy_state(tensors, step), folder / legacy_filename(profile, step))


@pytest.mark.parametrize(
    ("names", "taken", "averaged"),
    [
        pytest.param(
            ["0.weight", "0.bias"], "0 norm-layer buffer(s) from the latest snapshot (none)", 2,
            id="none",
        ),
        pytest.param(
            ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"],
            "3 norm-layer buffer(s) from the latest snapshot (num_batches_tracked, running_mean, "
            "running_var)",
            2,
            id="a BatchNorm alone",
        ),
        pytest.param(
            ["net.norm.running_mean", "net.norm.running_var", "net.norm.num_batches_tracked",
             "stats.running_mean", "net.head.weight"],
            "4 norm-layer buffer(s) from the latest snapshot (net.norm.num_batches_tracked, "
            "net.norm.running_mean, net.norm.running_var, stats.running_mean)",
            1,
            id="4 nested",
        ),
        pytest.param(
            ["body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked",
             "body.2.running_mean", "body.2.running_var", "body.0.weight"],
            "5 norm-layer buffer(s) from the latest snapshot (body.1.num_batches_tracked, "
            "body.1.running_mean, body.1.running_var, body.2.running_mean, ...)",
            1,
            id="5 nested",
        ),
    ],
)  # fmt: skip
@pytest.mark.parametrize(
    ("sigma_rels", "steps"),
    [("0.05", range(10, 11)), ("0.05,0.28", range(10, 21, 10))],
    ids=["one file", "four files"],
)
def test_the_buffers_taken_from_ema_pytorch_files_are_said_on_stderr(
    tmp_path: Path, names: list[str], taken: str, averaged: int, sigma_rels: str, steps: range
):
    """ema-pytorch's files do not say which tensors are buffers: the norm layers' buffers
    (named ``running_mean``, ``running_var``, ``num_batches_tracked`` at any depth, or at
    the top of a bare BatchNorm) are taken from the latest file, and the note on stderr
    names the first four of them and counts the averaged rest."""
    folder = tmp_path / "ema-pytorch"
    write_ema_pytorch_folder(folder, names, len(sigma_rels.split(",")), steps)
    legacy = ["--legacy-sigma-rels", sigma_rels, "--legacy-update-every", "10"]
    result = runner().invoke(inspect_cmd, [str(folder), *legacy])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"Note: ema-pytorch's files do not say which tensors are buffers; taking {taken} and "
        f"averaging the other {averaged} tensors\n"
    )
    copied = len(names) - averaged
    assert f"each snapshot: {len(names)} tensors ({averaged} averaged, {copied} copied)" in (
        result.stdout
    )


@pytest.mark.parametrize(
    "profiles",
    [["--legacy-sigma-rels", "0.05,0.28"], ["--legacy-gammas", "16.9722,0.169344"]],
    ids=["sigma_rels", "gammas"],
)
def test_legacy_update_every_applies_to_either_kind_of_profiles(
    tmp_path: Path, profiles: list[str]
):
    folder = tmp_path / "ema-pytorch"
    write_ema_pytorch_folder(folder, ["0.weight"], 2, range(10, 21, 10))
    result = runner().invoke(inspect_cmd, [str(folder), *profiles, "--legacy-update-every", "7"])
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(
        "\n4 of them ema-pytorch snapshot files (<profile index>.<step>.pt), read as the "
        "given profiles with update_every=7\n"
    )


# -- lists of numbers: --sigma-rel, --gamma, --legacy-sigma-rels, --legacy-gammas -------------


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0.1,,0.2", "; item 2 is empty"),
        ("0.1,", "; item 2 is empty"),
        (",0.1", "; item 1 is empty"),
        ("0.1, ,0.2", "; item 2 is empty"),
        ("abc", ""),
        ("0.1;0.2", ""),
    ],
)
@pytest.mark.parametrize("option", ["--sigma-rel", "--gamma", "--legacy-gammas"])
def test_a_list_of_numbers_with_an_empty_or_bad_item_is_refused(
    trained, tmp_path: Path, option: str, text: str, why: str
):
    """An empty item is refused, not dropped, and named by its position (from 1)."""
    _, folder = trained
    out = tmp_path / "ema.safetensors"
    length = [] if option == "--gamma" else ["--sigma-rel", "0.1"]
    result = runner().invoke(synthesize, [str(folder), *length, "--out", str(out), option, text])
    assert result.exit_code == 2, result.output
    assert result.stderr.endswith(
        f"\nError: Invalid value for '{option}': expected comma-separated numbers such as "
        f"0.05,0.1, got {text!r}{why}\n"
    )
    assert not out.exists()


MALFORMED_SPEC = "sigma_rel sweep must be A:B:N (N >= 1 lengths from A to B) or A,B,C; got "


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0.3:0.1", MALFORMED_SPEC + "'0.3:0.1'"),
        ("0.1:0.2:0", MALFORMED_SPEC + "'0.1:0.2:0'"),
        ("0.1:0.2:x", MALFORMED_SPEC + "'0.1:0.2:x'"),
        ("0.1,,0.2", MALFORMED_SPEC + "'0.1,,0.2'"),
        ("0.1:0.5:3", "sigma_rel must be a finite number in (0, 0.300283], got sigma_rel=0.5; "),
    ],
)
def test_sweep_refuses_a_bad_sigma_rel_spec_as_a_usage_error(trained, spec: str, message: str):
    """``--sigma-rel A:B:N`` or ``A,B,C``: anything else, or a length out of range, is
    refused before anything is read: exit code 2, the usage, and the option named."""
    _, folder = trained
    result = runner().invoke(sweep_cmd, [str(folder), "--sigma-rel", spec])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    usage, error = result.stderr.split("\n\n")
    assert usage == "Usage: sweep [OPTIONS] FOLDER\nTry 'sweep --help' for help."
    assert error.startswith(f"Error: Invalid value for '--sigma-rel': {message}")


# -- errors: one line ------------------------------------------------------------------------


def test_an_error_is_shown_on_one_line_or_by_its_type():
    """An error of several lines is joined into one (blank lines dropped, each stripped);
    one without a message is named by its type."""
    error = EMAValueError("snapshot s.safetensors is damaged:\n  its header\n\n   is cut  \n")
    assert fail(error).message == "snapshot s.safetensors is damaged: its header is cut"
    assert fail(OSError()).message == "OSError"
    assert fail(EMAValueError(" \n")).message == "EMAValueError"
