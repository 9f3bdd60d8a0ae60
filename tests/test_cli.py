"""The ``emakit`` command line: help texts, --version, bad options (list options with an empty
item included), ``python -m emakit``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import _peers
import emakit
from emakit.cli import main

DEMO_OPTIONS = ("--out", "--steps", "--seed", "--beta", "--no-plot")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="emakit")


def test_main_help_lists_commands_and_options() -> None:
    result = invoke("--help")
    assert result.exit_code == 0, result.output
    for text in ("Usage: emakit", "demo", "--version", "--help"):
        assert text in result.output


def test_short_help_flag() -> None:
    assert invoke("-h").output == invoke("--help").output


def test_demo_help_mentions_every_option_and_default() -> None:
    result = invoke("demo", "--help")
    assert result.exit_code == 0, result.output
    for option in DEMO_OPTIONS:
        assert option in result.output
    assert 'pip install -e ".[demo]"' in result.output
    assert "default: 1500" in result.output


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    result = invoke(flag)
    assert result.exit_code == 0
    assert result.output.strip() == f"emakit, version {emakit.__version__}"


@pytest.mark.parametrize(
    ("args", "option", "detail"),
    [
        (["--steps", "0"], "--steps", "0 is not in the range x>=1"),
        (["--steps", "-5"], "--steps", "x>=1"),
        (["--steps", "many"], "--steps", "'many' is not a valid integer"),
        (["--beta", "1.5"], "--beta", "0.0<=x<=1.0"),
        (["--beta", "-0.1"], "--beta", "0.0<=x<=1.0"),
        (["--beta", "nan"], "--beta", "nan is not a finite number"),
        (["--seed", "-1"], "--seed", "x<=4294967295"),
    ],
)
def test_bad_demo_options_name_the_option(args: list[str], option: str, detail: str) -> None:
    result = invoke("demo", *args)
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output
    assert detail in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_out_pointing_at_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "not-a-folder"
    target.write_text("keep me")
    result = invoke("demo", "--out", str(target), "--steps", "1")
    assert result.exit_code == 2
    assert "Invalid value for '--out'" in result.output
    assert "is a file" in result.output
    assert target.read_text() == "keep me"


def test_unknown_command_and_option() -> None:
    assert invoke("nope").exit_code == 2
    result = invoke("demo", "--stepz", "3")
    assert result.exit_code == 2
    assert "--stepz" in result.output


@pytest.mark.parametrize("blocked", ["sklearn", "rich", "matplotlib"])
def test_missing_demo_extra_is_a_clean_error(
    blocked: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # `import blocked` now raises
    result = invoke("demo", "--out", str(tmp_path / "run"), "--steps", "1")
    assert result.exit_code == 1
    assert "pip install scikit-learn matplotlib rich" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not (tmp_path / "run").exists()


def test_no_plot_does_not_need_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from emakit.demo import check_dependencies

    for needed in ("sklearn", "rich"):  # the rest of the demo extra: without it, skip
        pytest.importorskip(needed)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    check_dependencies(plot=False)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _peers.child_pythonpath()}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_python_dash_m_emakit() -> None:
    proc = _run("-m", "emakit", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: emakit" in proc.stdout
    assert "demo" in proc.stdout


def test_import_emakit_loads_no_cli_or_demo_dependency() -> None:
    code = (
        "import sys, emakit\n"
        "heavy = [m for m in ('click', 'sklearn', 'matplotlib', 'rich') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_bench_command_runs_and_reports_the_floor():
    from click.testing import CliRunner

    from emakit.cli import main

    result = CliRunner().invoke(
        main, ["bench", "--model", "mlp", "--repeats", "1", "--threads", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "floor" in result.output
    assert "default after flatten_parameters" in result.output
    bad = CliRunner().invoke(main, ["bench", "--model", "nope"])
    assert bad.exit_code != 0
    assert "--model" in bad.output


def test_posthoc_commands_are_registered():
    from click.testing import CliRunner

    from emakit.cli import main

    result = CliRunner().invoke(main, ["--help"])
    assert "synthesize" in result.output
    assert "inspect" in result.output


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["demo", "--help"], ["bench", "-h"]])
def test_help_and_version_do_not_import_torch(args: list[str]) -> None:
    """`emakit --help` answers in about the time Python and click take to start."""
    code = (
        "import sys\n"
        "from emakit.cli import main\n"
        "try:\n"
        f"    main({args!r}, prog_name='emakit')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "heavy = [m for m in ('torch', 'safetensors', 'sklearn', 'matplotlib', 'rich') "
        "if m in sys.modules]\n"
        "print('loaded:', ','.join(heavy))\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("loaded:"), proc.stdout


def test_lazy_commands_list_their_own_short_help() -> None:
    """`emakit --help` lists the lazy commands from a static table: it must match them."""
    from emakit import cli

    listing = " ".join(invoke("--help").output.split())
    for name, (_, _, short_help) in cli._LAZY_COMMANDS.items():
        command = cli.lazy_command(name)
        assert command.name == name
        assert command.get_short_help_str(limit=200) == short_help
        assert f"{name} {short_help}" in listing


def test_import_emakit_is_lazy_and_every_export_resolves() -> None:
    code = (
        "import sys, emakit\n"
        "print('torch' in sys.modules)\n"
        "names = [n for n in emakit.__all__ if getattr(emakit, n) is None]\n"
        "print(names, set(emakit.__all__) <= set(dir(emakit)))\n"
        "print(emakit._engine.__name__, emakit.posthoc.PostHocEMA is emakit.PostHocEMA)\n"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == [
        "False",
        "[] True",
        "emakit._engine True",
    ]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        emakit.nope  # noqa: B018


def test_cli_warnings_are_one_plain_line(tmp_path: Path) -> None:
    """A warning raised while a command runs is one `Warning: ...` line: no file path, no
    source line (Python's default shows both)."""
    import warnings

    import torch

    from emakit import PostHocEMA

    net = torch.nn.Linear(3, 3)
    posthoc = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        update_every=1,
        checkpoint_every_num_steps=10,
        checkpoint_folder=tmp_path / "snaps",
    )
    for _ in range(10):
        posthoc.update()
    before = warnings.showwarning
    result = invoke(
        "synthesize",
        str(tmp_path / "snaps"),
        "--sigma-rel",
        "0.1",
        "--out",
        str(tmp_path / "x.safetensors"),
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "post-hoc EMA:" in line]
    assert len(lines) == 1
    assert lines[0].startswith("Warning: post-hoc EMA:")
    assert "too few" in lines[0]
    assert ".py:" not in result.output
    assert "warnings.warn" not in result.output
    assert warnings.showwarning is before  # restored when the command ends


def test_a_folder_with_several_snapshot_subfolders_is_ambiguous(tmp_path: Path) -> None:
    import torch

    from emakit import EMAValueError, PostHocEMA
    from emakit.posthoc import find_snapshot_folder

    for name in ("a", "b"):
        posthoc = PostHocEMA(
            torch.nn.Linear(2, 2),
            sigma_rels=(0.05, 0.28),
            update_every=1,
            checkpoint_every_num_steps=5,
            checkpoint_folder=tmp_path / name,
        )
        for _ in range(5):
            posthoc.update()
    assert find_snapshot_folder(tmp_path / "a") == tmp_path / "a"
    with pytest.raises(EMAValueError, match="2 of its subfolders"):
        find_snapshot_folder(tmp_path)
    result = invoke("inspect", str(tmp_path))
    assert result.exit_code == 1
    assert str(tmp_path / "a") in result.output
    assert str(tmp_path / "b") in result.output
    (tmp_path / "b" / "nothing").mkdir()
    assert find_snapshot_folder(tmp_path / "b" / "nothing") == tmp_path / "b" / "nothing"


@pytest.mark.parametrize("value", ["0.1,,0.2", "0.1,", ",0.1", " , "])
@pytest.mark.parametrize("option", ["--sigma-rel", "--gamma", "--legacy-sigma-rels"])
def test_a_list_option_with_an_empty_item_is_refused(
    tiny_lora_folder: Path, tmp_path: Path, value: str, option: str
):
    from emakit.posthoc.commands import synthesize as synthesize_cmd

    args = [str(tiny_lora_folder), "--out", str(tmp_path / "o.safetensors"), option, value]
    if option == "--legacy-sigma-rels":
        args += ["--sigma-rel", "0.1", "--legacy-update-every", "1"]
    got = CliRunner().invoke(synthesize_cmd, args)
    assert got.exit_code == 2 and "is empty" in got.output, got.output
    assert not (tmp_path / "o.safetensors").exists()
