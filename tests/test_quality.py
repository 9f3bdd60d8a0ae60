"""Project hygiene: lint, types, public names documented, import stays light."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import emakit

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_has_a_docstring_and_is_in_the_docs():
    """Each public name has a docstring and is in the manual: rendered in the API
    reference (``::: emakit.NAME``, or its module's page) and named in a prose page."""
    api = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "api").glob("*.md"))
    prose = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").rglob("*.md"))
    for name in emakit.__all__:
        obj = getattr(emakit, name)
        if name.startswith("__"):
            continue
        assert (obj.__doc__ or "").strip() or name == "STATE_VERSION", (
            f"emakit.{name}: no docstring"
        )
        module = getattr(obj, "__module__", None) or ""  # a page may render a whole module
        aliases = [n for n in emakit.__all__ if getattr(emakit, n) is obj]  # EMATensor
        rendered = f"::: {module}\n" in api or any(f"::: emakit.{n}\n" in api for n in aliases)
        assert rendered, f"emakit.{name} is not in the API reference (docs/api/)"
        if name == "STATE_VERSION":
            continue
        assert f"`{name}" in prose or f"{name}(" in prose, f"emakit.{name} is in no docs page"


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
    """The whole of src/emakit, every import followed. conftest.py starts this mypy run in
    the background when collection selects this test, so it overlaps the rest of the
    suite (tests/_mypy_run.py); here the result is collected."""
    pytest.importorskip("mypy")
    import _mypy_run

    code, output = _mypy_run.result()
    assert code == 0, output[-5000:]


def _import_graph() -> tuple[dict[str, set[str]], list[str], dict[str, int]]:
    """emakit's modules: who imports whom (relative imports, at any depth, including
    imports inside functions and ``if TYPE_CHECKING:`` blocks), private names imported
    across modules, and line counts."""
    import ast

    src = ROOT / "src"
    mods = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (src / "emakit").rglob("*.py")
    }
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private, sizes = [], {}
    for mod, path in mods.items():
        text = path.read_text(encoding="utf-8")
        sizes[mod] = text.count("\n") + 1
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                dest = sub if sub in mods else target
                if dest not in mods or dest == mod:
                    continue
                edges[mod].add(dest)
                name, leaf = alias.name, dest.rsplit(".", 1)[-1]
                if name.startswith("_") and not name.startswith("__") and not leaf.startswith("_"):
                    private.append(f"{mod} imports {name} from {dest}")
    return edges, private, sizes


def test_import_structure():
    """No import cycle, no private name used across modules, no module over 600 lines."""
    edges, private, sizes = _import_graph()
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(mod) :], mod]))
        if mod in done:
            return
        for dest in sorted(edges[mod]):
            visit(dest, [*path, mod])
        done.add(mod)

    for mod in sorted(edges):
        visit(mod, [])
    assert not private, private
    big = {m: n for m, n in sizes.items() if n > 600}
    assert not big, big
