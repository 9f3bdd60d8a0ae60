"""Project hygiene: lint, types, public names documented, import stays light."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import emakit

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_has_a_docstring_and_is_in_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in emakit.__all__:
        obj = getattr(emakit, name)
        if name.startswith("__") or name == "STATE_VERSION":
            continue
        assert (obj.__doc__ or "").strip(), f"emakit.{name} has no docstring"
        assert f"`{name}" in readme or f"{name}(" in readme, f"emakit.{name} is not in the README"


def test_import_emakit_loads_no_optional_framework():
    code = (
        "import sys, emakit\n"
        "heavy = [m for m in ('click', 'rich', 'matplotlib', 'sklearn', 'lightning', 'accelerate',"
        " 'transformers', 'safetensors', 'timm') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_is_clean():
    result = subprocess.run(
        ["ruff", "check", "--output-format", "concise", str(ROOT)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean_on_src():
    pytest.importorskip("mypy")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            str(ROOT / "src" / "emakit"),
            "--ignore-missing-imports",
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
