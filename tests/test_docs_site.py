"""The documentation site (mkdocs, material theme, mkdocstrings) builds with --strict:
no broken link, no docstring the API reference cannot parse, no page left out of the nav."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict(tmp_path: Path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    api = (tmp_path / "api" / "emakit" / "index.html").read_text(encoding="utf-8")
    # the reference is generated from the docstrings: a keyword only EMA's docstring has
    assert "ema_dtype" in api
    posthoc = (tmp_path / "api" / "posthoc" / "index.html").read_text(encoding="utf-8")
    for name in ("list_snapshots", "read_snapshot_info", "find_snapshot_folder"):
        assert name in posthoc
    for page in ("demo", "examples", "development", "posthoc", "architecture"):
        assert (tmp_path / page / "index.html").is_file()
