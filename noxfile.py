"""The version matrix: emakit's supported range is what these sessions test.

    nox -s oldest     # Python 3.11 x torch 2.4.1, the floor pyproject.toml declares
    nox -s middle     # Python 3.12 x torch 2.9.1
    nox -s newest     # Python 3.13 x torch 2.14.1, the newest of both
    nox -s core-oldest  # the core tests only (torch, numpy, safetensors, click, ema-pytorch)

Each session makes a fresh virtualenv and installs that torch first, pinned for everything
after it (a test dependency must never move torch). It builds emakit's wheel, installs it
with its declared dependencies alone and uses it (`.ci/use_wheel.py`: import, `emakit
--version`, an export and post-hoc snapshots saved and loaded), then builds the sdist and
wheel with `python -m build` and checks both with `twine check --strict`. Last it installs
`emakit[test,test-peers]` (editable; timm and the torchvision made for that torch, which the
pin keeps) and runs the whole suite. `[test]` resolves on every pair, but on torch 2.4 some
frameworks it installs do not work: Transformers 5 (and so PEFT and TRL) and diffusers 0.4x
need torch >= 2.6, so their tests skip there, each naming the framework, both versions and
the error (``tests/_frameworks.py``); emakit's Transformers integration refuses that torch
with an ImportError saying so. Everything else runs on every pair. The ``core-*`` sessions
run the core tests instead (a quick check: `.ci/run` runs ``core-oldest``): emakit with its
declared dependencies plus pytest, hypothesis and ema-pytorch, and the test files that need
nothing more. Torch from PyPI is the CUDA build on Linux (a few GB); it runs on the CPU.
Interpreters are found on PATH or under pyenv (``~/.pyenv/versions``). Results and
timings: docs/development.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["oldest", "middle", "newest"]

#: session -> (Python, torch). `[test]` resolves on each (pip's resolver, torch pinned);
#: ``core-<session>`` runs the same pair with the core tests only.
MATRIX = {
    "oldest": ("3.11", "2.4.1"),
    "middle": ("3.12", "2.9.1"),
    "newest": ("3.13", "2.14.1"),
}

#: Test files that need more than torch, numpy, safetensors, click and ema-pytorch (a
#: framework, a linter, the docs toolchain or the demo extra); the core sessions leave them out.
NOT_CORE = [
    "test_bema_integrations.py",
    "test_bema_trl.py",
    "test_checkpoint.py",
    "test_deepspeed.py",
    "test_demo.py",
    "test_docs_blocks.py",
    "test_docs_site.py",
    "test_examples.py",
    "test_framework_floor.py",
    "test_inspect_frameworks.py",
    "test_install.py",
    "test_integration_accelerate.py",
    "test_integration_lightning.py",
    "test_integration_transformers.py",
    "test_migration_peers.py",
    "test_peft.py",
    "test_posthoc_deepspeed.py",
    "test_quality.py",
    "test_readme.py",
]
RELEASE_TOOLS = ["build>=1.2", "twine>=6.1"]
CORE_DEPS = ["pytest>=7.4", "pytest-timeout>=2.2", "hypothesis>=6.90", "ema-pytorch==0.8.3"]


def interpreter(version: str) -> str:
    """The newest pyenv build of ``version`` if there is one, else the name nox looks up on
    PATH (pyenv's shims hide the versions that are not selected)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    builds = [p for p in root.glob(f"{version}.*/bin/python{version}") if p.is_file()]
    if not builds:
        return version
    return str(max(builds, key=lambda p: [int(x) for x in p.parts[-3].split(".")[:3]]))


def _pin_torch(session: nox.Session, torch: str) -> str:
    """Install ``torch`` and return a constraints file that keeps it."""
    constraints = Path(session.create_tmp()) / "torch.txt"
    constraints.write_text(f"torch=={torch}\n")
    session.install("-c", str(constraints), f"torch=={torch}")
    return str(constraints)


def _release_checks(session: nox.Session, constraints: str) -> None:
    """The wheel with its declared dependencies alone, used; then the release artifacts."""
    tmp = Path(session.create_tmp())
    for name in ("wheel", "dist"):
        for old in (tmp / name).glob("*"):
            old.unlink()
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(tmp / "wheel"), ".")
    (wheel,) = (tmp / "wheel").glob("emakit-*.whl")
    session.install("-c", constraints, str(wheel))
    session.run("python", str(Path(".ci/use_wheel.py").resolve()))
    session.install("-c", constraints, *RELEASE_TOOLS)
    session.run("python", "-m", "build", "--outdir", str(tmp / "dist"), ".")
    session.run("python", "-m", "twine", "check", "--strict", *map(str, (tmp / "dist").glob("*")))


def _run(session: nox.Session, core: bool) -> None:
    ignore = [f"--ignore=tests/{name}" for name in NOT_CORE] if core else []
    session.run(
        "python",
        "-c",
        "import sys, torch; print('Python', sys.version.split()[0], 'torch', torch.__version__)",
    )
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *ignore, *session.posargs)


def _suite(torch: str, full: bool):
    def session(session: nox.Session) -> None:
        constraints = _pin_torch(session, torch)
        _release_checks(session, constraints)
        if full:
            session.install("-c", constraints, "-e", ".[test,test-peers]")
        else:
            session.install("-c", constraints, "-e", ".", *CORE_DEPS)
        _run(session, core=not full)

    return session


for _name, (_python, _torch) in MATRIX.items():
    nox.session(name=_name, python=interpreter(_python))(_suite(_torch, True))
    nox.session(name=f"core-{_name}", python=interpreter(_python))(_suite(_torch, False))
