"""``tools/install_peers.py`` says plainly what it installed and what does not work: a
torchvision that loads only with the tests' operator shim is reported as such (issue 41,
item 4), and a failure names what skips."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "install_peers", ROOT / "tools" / "install_peers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fails: set[str]
) -> tuple[int, str]:
    """``main()`` with pip stubbed and each check run as ``fails`` says."""
    tool = load_tool()
    monkeypatch.setattr(tool, "pip_target", lambda *args: True)
    monkeypatch.setattr(tool.shutil, "rmtree", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", ["install_peers.py"])
    names = {tool.CHECK: "timm", tool.PLAIN_CHECK: "plain", tool.ULTRALYTICS_CHECK: "ultra"}

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        which = names[cmd[-1]]
        if which in fails:
            err = "RuntimeError: operator torchvision::nms does not exist"
            return subprocess.CompletedProcess(cmd, 1, "", f"Traceback\n{err}\n")
        return subprocess.CompletedProcess(cmd, 0, "1.0.0\n", "")

    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    code = tool.main()
    return code, capsys.readouterr().out


def test_a_torchvision_that_needs_the_tests_shim_is_reported(monkeypatch, capsys) -> None:
    code, out = run_tool(monkeypatch, capsys, {"plain"})
    assert code == 0
    assert "timm 1.0.0 with torchvision" in out
    assert "does not load on its own" in out and "torchvision::nms does not exist" in out
    assert "tests/_peers.py" in out and "none skip" in out


def test_a_torchvision_that_loads_gets_no_note(monkeypatch, capsys) -> None:
    code, out = run_tool(monkeypatch, capsys, set())
    assert code == 0 and "does not load" not in out and "ultralytics 1.0.0" in out


def test_failures_say_what_skips(monkeypatch, capsys) -> None:
    code, out = run_tool(monkeypatch, capsys, {"timm"})
    assert code == 0 and "timm not installed" in out and "the timm tests skip" in out
    code, out = run_tool(monkeypatch, capsys, {"ultra"})
    assert code == 0 and "ultralytics not usable" in out and "its tests skip" in out
