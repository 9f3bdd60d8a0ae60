"""Install timm for the comparison tests without replacing the installed torch.

timm needs torchvision, and every torchvision wheel pins one torch release exactly
(torchvision 0.28.0 requires ``torch==2.13.0``). ``pip install timm`` resolves the newest
torchvision, which pins a newer torch, and so replaces the installed one (on Linux with a
CUDA build and its nvidia-* packages, even over a CPU wheel). This script installs:

1. the torchvision release made for the installed torch (torch ``2.X.Y`` ->
   torchvision ``0.(X+15).Y``) with ``--no-deps``. For a local build of torch
   (``2.13.0+cpu``, ``+cu126``) it takes the same build of torchvision
   (``0.28.0+cpu``) from the PyTorch index of that build
   (``https://download.pytorch.org/whl/cpu``; ``--index-url`` to change it): PyPI's
   torchvision wheel for Linux is a CUDA build, whose C++ extension does not load beside
   a CPU torch. Where that index cannot be reached, it takes PyPI's wheel of the same
   release: the test process then defines the two operator schemas torchvision expects
   from its extension (``tests/_peers.py``), so that its Python code, and timm, import;
2. timm, with a constraints file that pins torch and torchvision to the installed
   versions, so pip can change neither.

Then it checks ``import timm.utils`` in a fresh interpreter, as the tests import it. When no matching torchvision
can be installed, or timm does not import, it uninstalls what it installed and exits 0
(``--strict``: 1) saying why: the timm tests then skip.

Usage::

    python tools/install_peers.py              # install (what the test command runs)
    python tools/install_peers.py --dry-run    # show what pip would install; fail if it
                                               # would replace torch or add nvidia-* packages
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PYTORCH_INDEX = "https://download.pytorch.org/whl/{build}"


def torchvision_for(torch_version: str) -> tuple[str, str | None]:
    """``(torchvision version, local build or None)`` made for ``torch_version``.

    >>> torchvision_for("2.13.0+cpu")
    ('0.28.0', 'cpu')
    >>> torchvision_for("2.14.1")
    ('0.29.1', None)
    """
    match = re.fullmatch(r"2\.(\d+)\.(\d+)(?:\+(\w+))?", torch_version)
    if match is None:
        raise SystemExit(
            f"install_peers: cannot map torch {torch_version} to a torchvision release"
        )
    minor, patch, build = match.groups()
    return f"0.{int(minor) + 15}.{patch}", build


def pip(*args: str, report: bool = False) -> list[str]:
    """Run pip; with ``report``, return the names it would install (``--dry-run``)."""
    cmd = [sys.executable, "-m", "pip", "install", *args]
    if report:
        cmd += ["--dry-run", "--quiet", "--report", "-"]
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE if report else None)
    if not report:
        return []
    items = json.loads(out.stdout)["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]


TESTS = Path(__file__).resolve().parents[1] / "tests"
CHECK = (
    f"import sys; sys.path.insert(0, {str(TESTS)!r}); import _peers; "
    "_peers.allow_torchvision_without_its_extension(); import timm.utils, timm.models"
)


def imports_timm() -> str | None:
    """None when ``import timm.utils`` works in a fresh interpreter set up as the tests
    set themselves up (``tests/_peers.py``), else its error."""
    check = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
    )
    return None if check.returncode == 0 else (check.stderr.strip().splitlines() or ["?"])[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="show what would be installed")
    parser.add_argument("--strict", action="store_true", help="exit 1 when timm is unavailable")
    parser.add_argument("--index-url", help="index of the torchvision build (default: PyTorch's)")
    args = parser.parse_args()

    torch_version = metadata.version("torch")
    tv_version, build = torchvision_for(torch_version)
    tv_spec = f"torchvision=={tv_version}" + (f"+{build}" if build else "")
    tv_index = ["--index-url", args.index_url or PYTORCH_INDEX.format(build=build)] if build else []
    if args.index_url and not build:
        tv_index = ["--index-url", args.index_url]

    def give_up(why: str, installed: list[str]) -> int:
        if installed and not args.dry_run:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *installed])
        print(f"install_peers: timm not installed ({why}); the timm tests skip", flush=True)
        return 1 if args.strict else 0

    try:
        planned = pip("--no-deps", tv_spec, *tv_index, report=args.dry_run)
    except subprocess.CalledProcessError:
        if not build:
            return give_up(f"no {tv_spec} for torch {torch_version}", [])
        print(
            f"install_peers: {tv_spec} not reachable; taking torchvision=={tv_version} from the default index"
        )
        try:
            planned = pip("--no-deps", f"torchvision=={tv_version}", report=args.dry_run)
        except subprocess.CalledProcessError:
            return give_up(f"no torchvision {tv_version} for torch {torch_version}", [])
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp, "constraints.txt")
        pins = [f"torch=={torch_version}"]
        if not args.dry_run:
            pins.append(f"torchvision=={metadata.version('torchvision')}")
        constraints.write_text("\n".join(pins) + "\n")
        try:
            planned += pip("timm", "-c", str(constraints), report=args.dry_run)
        except subprocess.CalledProcessError:
            return give_up("pip found no timm that keeps torch", ["torchvision"])
    if args.dry_run:
        print("would install:", " ".join(planned) or "nothing")
        bad = [p for p in planned if p.startswith(("torch==", "nvidia", "triton"))]
        if bad:
            print(f"install_peers: would replace torch or add CUDA packages: {bad}")
            return 1
        return 0
    error = imports_timm()
    if error is not None:
        return give_up(f"import timm fails: {error}", ["timm", "torchvision"])
    print(
        f"install_peers: timm {metadata.version('timm')} with torchvision "
        f"{metadata.version('torchvision')} beside torch {torch_version}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
