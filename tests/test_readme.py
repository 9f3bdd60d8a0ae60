"""Every ```python block of the README and of the manual's recipe and migration pages
runs, so the documentation cannot rot. (```py blocks are fragments and are not run.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "recipes.md", ROOT / "docs" / "migration.md"]
BLOCKS = [
    (page, i, code)
    for page in PAGES
    for i, code in enumerate(
        re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    )
]
# needs a framework that may not be installed: (package to import, pattern in the block)
NEEDS = [
    ("lightning", "import lightning"),
    ("accelerate", "from accelerate"),
    ("transformers", "from transformers"),
]


def _id(block: tuple[Path, int, str]) -> str:
    return f"{block[0].relative_to(ROOT)}:{block[1]}"


def test_pages_have_code_blocks():
    per_page = {page: sum(1 for p, _, _ in BLOCKS if p == page) for page in PAGES}
    assert per_page[README] >= 1  # the quickstart
    assert per_page[ROOT / "docs" / "recipes.md"] >= 8
    assert per_page[ROOT / "docs" / "migration.md"] >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=_id)
@pytest.mark.filterwarnings("error::emakit.posthoc.PostHocWarning")  # examples must fit well
def test_block_runs(block, tmp_path, monkeypatch):
    page, index, code = block
    for package, pattern in NEEDS:
        if pattern in code:
            pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    code = code.replace("/tmp/", f"{tmp_path}/")
    name = f"{page.relative_to(ROOT)} block {index}"
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})


def test_readme_commands_present():
    text = README.read_text(encoding="utf-8")
    assert 'pip install -e ".[demo]" && emakit demo' in text
    assert "pip install emakit" in text  # a release, not only a clone
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_cmd = 'pip install -e ".[test]" && python -m pytest'
    assert test_cmd in text
    assert test_cmd in ci


def test_readme_is_a_front_door():
    """The README says what emakit is, how to install and start, what it costs, and where
    the manual is; the manual (docs/) carries the rest."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 160
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).is_file(), page
    for section in ("## Install", "## Quickstart", "## Speed", "## The manual"):
        assert section in text
