"""The extras the README names keep an installed torch: a CPU wheel stays a CPU wheel.

pip keeps an installed torch only while every package it resolves accepts that torch. One
requirement on the newest torch anywhere in the closure (timm pulls the newest
torchvision, which requires the torch released with it, ``torch>=2.14.0``) makes pip
replace a CPU torch with the newest CUDA build, nvidia libraries and triton included. This
walks each extra's dependency closure from the installed packages' metadata (offline, a
fraction of a second) and checks that every requirement on torch in it admits the
installed torch and the minor release before it. Whatever is in an extra when this runs
is covered: the extras are read from pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path

import pytest

packaging_requirements = pytest.importorskip("packaging.requirements")
packaging_version = pytest.importorskip("packaging.version")
tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else None

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# the extras a user is told to install (`pip install -e ".[name]"` or `emakit[name]`)
README_EXTRAS = sorted(set(re.findall(r'(?:-e "\.|emakit)\[([a-z-]+)\]', README)))
# the extra that brings in the peers that pin torch, on purpose, and says so
PEER_EXTRA = "test-peers"
# torch's own dependencies (nvidia-*, triton) are torch's business: the walk stops at torch
STOP = {"torch"}


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(extra: str) -> tuple[dict[str, list[str]], set[str]]:
    """Every requirement reachable from ``emakit[extra]``: {package: [requirement strings
    naming it, each with who asked]}, and the packages not installed here."""
    project = _pyproject()["project"]
    optional = project["optional-dependencies"]
    todo = [(r, "emakit") for r in project["dependencies"]]
    todo += [(r, f"emakit[{extra}]") for r in optional[extra]]
    seen: set[tuple[str, str]] = set()
    found: dict[str, list[str]] = {}
    missing: set[str] = set()
    while todo:
        text, who = todo.pop()
        req = packaging_requirements.Requirement(text)
        name = _norm(req.name)
        if name == "emakit":  # a self-reference: expand from pyproject, not the installed copy
            todo += [(r, f"emakit[{e}]") for e in req.extras for r in optional[e]]
            continue
        found.setdefault(name, []).append(f"{req} (from {who})")
        for wanted in sorted(req.extras) or [""]:
            if (name, wanted) in seen or name in STOP:
                continue
            seen.add((name, wanted))
            try:
                requires = metadata.requires(req.name) or []
            except metadata.PackageNotFoundError:
                missing.add(req.name)
                continue
            for sub in requires:
                sub_req = packaging_requirements.Requirement(sub)
                if sub_req.marker is None or sub_req.marker.evaluate({"extra": wanted}):
                    todo.append((sub, req.name + (f"[{wanted}]" if wanted else "")))
    return found, missing


def _torch_versions() -> list[str]:
    """The installed torch and the minor release before it (the CPU wheel a user installed
    a month ago), as plain versions."""
    installed = packaging_version.Version(metadata.version("torch"))
    major, minor = installed.release[:2]
    return [installed.base_version, f"{major}.{max(minor - 1, 0)}.0"]


def _supported(versions: list[str]) -> list[str]:
    """Those of ``versions`` that emakit's own torch requirement accepts: on the torch
    floor, the release before it is not one an extra must keep."""
    (floor,) = (
        packaging_requirements.Requirement(r).specifier
        for r in _pyproject()["project"]["dependencies"]
        if _norm(packaging_requirements.Requirement(r).name) == "torch"
    )
    return [v for v in versions if floor.contains(v)]


def _refusing_torch(found: dict[str, list[str]], versions: list[str]) -> list[str]:
    """The requirements on torch in a closure that refuse one of ``versions``."""
    return sorted(
        {
            text
            for text in found.get("torch", [])
            for version in versions
            if not packaging_requirements.Requirement(text.split(" (from ")[0]).specifier.contains(
                version, prereleases=True
            )
        }
    )


def test_the_readme_names_the_extras_it_installs():
    assert {"demo", "test", "docs"} <= set(README_EXTRAS), README_EXTRAS
    assert set(README_EXTRAS) <= set(_pyproject()["project"]["optional-dependencies"])


@pytest.mark.parametrize("extra", [e for e in README_EXTRAS if e != PEER_EXTRA])
def test_extra_keeps_an_installed_torch(extra):
    found, missing = _closure(extra)
    if missing:
        pytest.skip(
            f"emakit[{extra}] needs {sorted(missing)}, not installed here, so their "
            f'requirements cannot be read offline: pip install -e ".[{extra}]" first'
        )
    versions = _supported(_torch_versions())
    bad = _refusing_torch(found, versions)
    assert not bad, f"emakit[{extra}] would replace torch {versions}: {bad}"
    assert "torchvision" not in found, found["torchvision"]  # it requires the newest torch


def test_the_peer_extra_is_what_pins_torch():
    """The check above can fail: the peers' extra pulls in torchvision, whose release
    requires the torch of its own release (``torch>=2.14.0`` or ``torch==2.14.1``), which is
    why it is a separate extra and the README says so."""
    found, missing = _closure(PEER_EXTRA)
    if missing:
        pytest.skip(f"{sorted(missing)} not installed here: cannot read their requirements")
    assert "torchvision" in found
    refusing = _refusing_torch(found, _torch_versions())
    assert any("(from torchvision)" in text for text in refusing), found["torch"]
    assert f'".[{PEER_EXTRA}]"' in README


# -- the runtime dependencies ------------------------------------------------------------------

#: Modules the library imports only on a path that needs an extra: the extra that brings
#: each, and the distribution that provides it.
OPTIONAL_IMPORTS = {
    "accelerate": ("accelerate", "accelerate"),
    "lightning": ("lightning", "lightning"),
    "pytorch_lightning": ("lightning", "lightning"),
    "matplotlib": ("demo", "matplotlib"),
    "mmengine": ("test", "mmengine-lite"),
    "rich": ("demo", "rich"),
    "sklearn": ("demo", "scikit-learn"),
    "torchvision": ("bench", "torchvision"),
    "transformers": ("transformers", "transformers"),
}


def _runtime_imports() -> dict[str, set[str]]:
    """Third-party top-level modules imported anywhere in src/emakit (inside functions
    too, not under ``if TYPE_CHECKING:``): {module: files}."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src" / "emakit").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "emakit" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(path.name)
    return found


@pytest.mark.skipif(sys.version_info < (3, 10), reason="needs sys.stdlib_module_names")
def test_every_runtime_import_is_declared():
    """What the library imports is in ``[project] dependencies``, or, on a path that needs
    an extra, in that extra; numpy is declared too: ``Tensor.numpy()`` (the safetensors
    writer) needs it without an import."""
    project = _pyproject()["project"]
    declared = {_norm(packaging_requirements.Requirement(r).name) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    undeclared = {}
    for module, files in _runtime_imports().items():
        if module in OPTIONAL_IMPORTS:
            extra, dist = OPTIONAL_IMPORTS[module]
            names = {_norm(packaging_requirements.Requirement(r).name) for r in extras[extra]}
            assert _norm(dist) in names, f"{module} ({sorted(files)}) is not in emakit[{extra}]"
        elif _norm(module) not in declared:
            undeclared[module] = sorted(files)
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"
    uses_numpy = any(
        ".numpy()" in p.read_text(encoding="utf-8") for p in (ROOT / "src" / "emakit").rglob("*.py")
    )
    assert not uses_numpy or "numpy" in declared, "Tensor.numpy() needs numpy declared"
