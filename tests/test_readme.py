"""Every ```python block of the README runs, so the documentation cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_code_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
@pytest.mark.filterwarnings("error::emakit.posthoc.PostHocWarning")  # examples must fit well
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = BLOCKS[index].replace("/tmp/", f"{tmp_path}/")
    exec(compile(code, f"README.md block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_commands_present():
    text = README.read_text(encoding="utf-8")
    assert 'pip install -e ".[demo]" && emakit demo' in text
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    test_cmd = 'pip install -e ".[test]" && python -m pytest'
    assert test_cmd in text
    assert test_cmd in ci
