"""The README is a true front door: the commands it gives exist and are what CI runs, it
installs what exists today (a clone or a built wheel, no release yet), the Python and torch
range it states is the one pyproject.toml declares and noxfile.py tests, and the CHANGELOG
has the form a release cuts. (Its ```python blocks, and the docs', run in
tests/test_docs_blocks.py.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_commands_present():
    text = README.read_text(encoding="utf-8")
    assert 'pip install -e ".[demo]" && emakit demo' in text
    # no release is published: no line tells to install one from PyPI (issue 31)
    assert not re.search(r"pip install (-U )?\"?emakit\b", text), "emakit is not on PyPI"
    assert "not on PyPI yet" in text and "python -m build" in text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    test_cmd = 'pip install -e ".[test]" && python tools/install_peers.py && python -m pytest'
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


def test_supported_range_is_the_tested_range():
    """requires-python, the classifiers, the torch floor, the README and noxfile.py's
    oldest and newest sessions name the same Python and torch versions."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    nox = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    matrix = {
        name: (py, torch)
        for name, py, torch in re.findall(r'"(\w+)": \("(3\.\d+)", "([\d.]+)"', nox)
    }
    assert set(matrix) == {"oldest", "middle", "newest"}, matrix
    oldest_py, oldest_torch = matrix["oldest"]
    newest_py, newest_torch = matrix["newest"]
    assert project["requires-python"] == f">={oldest_py}"
    (torch_req,) = [r for r in project["dependencies"] if r.startswith("torch")]
    assert torch_req == f"torch>={'.'.join(oldest_torch.split('.')[:2])}"
    minors = range(int(oldest_py.split(".")[1]), int(newest_py.split(".")[1]) + 1)
    listed = {c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if re.search(r"3\.\d+$", c)}
    assert listed == {f"3.{m}" for m in minors}
    text = README.read_text(encoding="utf-8")
    assert f"Python {oldest_py}-{newest_py}" in text
    assert f"PyTorch {'.'.join(oldest_torch.split('.')[:2])}-" in text
    assert f"-{'.'.join(newest_torch.split('.')[:2])}" in text


def test_changelog_has_the_form_a_release_cuts():
    """Keep a Changelog: ``## [Unreleased]`` first, then ``## [X.Y.Z] - YYYY-MM-DD`` per
    release, newest first; a release renames the first and opens a new one."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## \[([^\]]+)\](.*)$", text, flags=re.M)
    assert versions and versions[0] == ("Unreleased", ""), versions[:2]
    released = versions[1:]
    for version, rest in released:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
        assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), (version, rest)
    numbers = [tuple(map(int, v.split("."))) for v, _ in released]
    assert numbers == sorted(numbers, reverse=True)
    assert "### Added" in text.split("## [Unreleased]", 1)[1]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")


#: An install command that asks a package index for emakit: `pip install emakit`,
#: `pip install "emakit[lightning]"`, `uv add emakit==0.1`, `pip install -U 'emakit'`...
INDEX_INSTALL = re.compile(
    r"""(?:pip3?|uv\s+pip|uv|poetry|pipx|conda)\s+(?:install|add)\b[^\n`(#;&|]*?"""
    r"""(?<![\w./-])['"]?emakit(?:\[[^\]]*\])?(?:[<>=!~][^\s'"]*)?['"]?(?![\w./-])"""
)


def _released() -> bool:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return any(v != "Unreleased" for v in re.findall(r"^## \[([^\]]+)\]", text, flags=re.M))


def test_every_install_line_installs_what_exists():
    """Until a release is published, no install line in the README, the docs, the examples
    or the package's own messages asks a package index for emakit (it is not there, and
    whoever registers the name would be installed instead): they install from a clone
    (``pip install -e ".[lightning]"``), a built wheel, or the extra's own packages."""
    assert INDEX_INSTALL.search('pip install "emakit[lightning]"')  # the pattern bites
    assert INDEX_INSTALL.search("run `pip install -U emakit==0.1` first")
    assert INDEX_INSTALL.search("uv add 'emakit'")
    assert not INDEX_INSTALL.search('pip install -e ".[lightning]"')
    assert not INDEX_INSTALL.search("pip install dist/emakit-0.1.0-py3-none-any.whl")
    assert not INDEX_INSTALL.search("pip install lightning (emakit's lightning extra)")
    assert not INDEX_INSTALL.search('pip install -e ".[demo]" && emakit demo')
    if _released():
        return
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "src").rglob("*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path in files
        for text in [path.read_text(encoding="utf-8")]
        for m in INDEX_INSTALL.finditer(text)
    ]
    assert not found, "install lines for a release that does not exist:\n" + "\n".join(found)
