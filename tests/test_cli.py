"""The ``emakit`` command line: help texts, --version, bad options, ``python -m emakit``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

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
    assert "emakit[demo]" in result.output
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
    assert 'pip install "emakit[demo]"' in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not (tmp_path / "run").exists()


def test_no_plot_does_not_need_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    from emakit.demo import check_dependencies

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    check_dependencies(plot=False)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
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
