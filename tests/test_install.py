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


def _refusing_torch(found: dict[str, list[str]]) -> list[str]:
    """The requirements on torch in a closure that refuse the installed torch or the
    release before it."""
    versions = _torch_versions()
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
    bad = _refusing_torch(found)
    assert not bad, f"emakit[{extra}] would replace torch {_torch_versions()}: {bad}"
    assert "torchvision" not in found, found["torchvision"]  # it requires the newest torch


def test_the_peer_extra_is_what_pins_torch():
    """The check above can fail: the peers' extra pulls in torchvision, whose release
    requires the torch of its own release (``torch>=2.14.0`` or ``torch==2.14.1``), which is
    why it is a separate extra and the README says so."""
    found, missing = _closure(PEER_EXTRA)
    if missing:
        pytest.skip(f"{sorted(missing)} not installed here: cannot read their requirements")
    assert "torchvision" in found
    assert any("(from torchvision)" in text for text in _refusing_torch(found)), found["torch"]
    assert f'".[{PEER_EXTRA}]"' in README
