"""Install timm for the comparison tests without touching the environment's packages.

timm needs torchvision, and every torchvision wheel pins one torch release exactly
(torchvision 0.28.0 requires ``torch==2.13.0``): ``pip install timm`` resolves the newest
torchvision, which pins a newer torch, and so replaces the installed one (on Linux with a
CUDA build and its nvidia-* packages, even over a CPU wheel). And PyPI's Linux torchvision
is a CUDA build whose C++ extension does not load beside a CPU torch: installed into the
environment, it would break every library that imports torchvision when present.

So this script installs, with ``--no-deps``, into ``.peers/`` at the repository root (not
site-packages; only the test process adds it to its path, ``tests/_peers.py``):

1. the torchvision release made for the installed torch (torch ``2.X.Y`` -> torchvision
   ``0.(X+15).Y``): for a local build (``2.13.0+cpu``) the same build from PyTorch's index
   of that build (``--index-url`` to change it), else, or where that index cannot be
   reached, the release from the default index;
2. timm (its other dependencies, pyyaml, huggingface_hub and safetensors, are the test
   extra's already).
3. Ultralytics and polars (its trainer writes results.csv with it), for
   ``tests/test_compat_ultralytics.py``; its other dependencies (numpy, matplotlib, pillow,
   pyyaml, requests, psutil, opencv-python-headless) are the test extra's.

Then it checks ``import timm.utils`` in a fresh interpreter set up as the tests set
themselves up. When that fails it removes ``.peers/`` and exits 0 (``--strict``: 1) saying
why: the timm tests then skip.

Usage::

    python tools/install_peers.py              # what the test command runs
    python tools/install_peers.py --strict     # fail when timm cannot be had
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
PYTORCH_INDEX = "https://download.pytorch.org/whl/{build}"
CHECK = (
    f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import _peers; "
    "_peers.allow_timm(); import timm.utils, timm.models; print(timm.__version__)"
)
#: ``import torchvision`` as a person using ``.peers/`` outside the tests would run it.
PLAIN_CHECK = (
    f"import sys; sys.path.append({str(PEERS)!r}); import torchvision.ops; "
    "print(torchvision.__version__)"
)
ULTRALYTICS_CHECK = (
    f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import _peers; "
    "_peers.allow_timm(); import ultralytics.engine.trainer, polars; print(ultralytics.__version__)"
)


def torchvision_for(torch_version: str) -> tuple[str, str | None]:
    """``(torchvision version, local build or None)`` made for ``torch_version``.

    >>> torchvision_for("2.13.0+cpu")
    ('0.28.0', 'cpu')
    >>> torchvision_for("2.14.1")
    ('0.29.1', None)
    """
    match = re.fullmatch(r"2\.(\d+)\.(\d+)(?:\+(\w+))?", torch_version)
    if match is None:
        raise SystemExit(f"install_peers: cannot map torch {torch_version} to a torchvision")
    minor, patch, build = match.groups()
    return f"0.{int(minor) + 15}.{patch}", build


def pip_target(*args: str) -> bool:
    """``pip install --no-deps --target .peers ARGS``; True when it worked."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
    cmd += ["--target", str(PEERS), *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, stderr=subprocess.DEVNULL).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when timm is unavailable")
    parser.add_argument("--index-url", help="index of the torchvision build (default: PyTorch's)")
    args = parser.parse_args()
    torch_version = metadata.version("torch")
    tv_version, build = torchvision_for(torch_version)
    shutil.rmtree(PEERS, ignore_errors=True)
    got = build is not None and pip_target(
        f"torchvision=={tv_version}+{build}",
        "--index-url",
        args.index_url or PYTORCH_INDEX.format(build=build),
    )
    got = got or pip_target(f"torchvision=={tv_version}")
    got = got and pip_target("timm")
    check = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    if not got or check.returncode != 0:
        shutil.rmtree(PEERS, ignore_errors=True)
        why = (check.stderr.strip().splitlines() or ["?"])[-1] if got else "pip failed"
        print(f"install_peers: timm not installed ({why}); the timm tests skip", flush=True)
        return 1 if args.strict else 0
    print(
        f"install_peers: timm {check.stdout.strip()} with torchvision {tv_version} in "
        f"{PEERS.relative_to(ROOT)}/ beside torch {torch_version}"
    )
    plain = subprocess.run([sys.executable, "-c", PLAIN_CHECK], capture_output=True, text=True)
    if plain.returncode != 0:
        why = (plain.stderr.strip().splitlines() or ["?"])[-1]
        print(
            f"install_peers: note: this torchvision does not load on its own beside torch "
            f"{torch_version} ({why}): the test suite defines the operators it lacks "
            f"(tests/_peers.py), so timm's tests run and none skip for it, but outside the "
            f"tests `import torchvision` from {PEERS.relative_to(ROOT)}/ fails; install a "
            f"torch and torchvision made for each other to use it there",
            flush=True,
        )
    # Ultralytics (tests/test_compat_ultralytics.py) beside them, also --no-deps: its own
    # requirements would pull opencv-python (a GUI build that needs libGL; the test extra has
    # opencv-python-headless) and another torchvision. Its trainer writes results.csv with
    # polars, which comes with the runtime it imports. Without them those tests skip.
    ultra = pip_target("ultralytics", "polars", "polars-runtime-32")
    with tempfile.TemporaryDirectory() as config:  # its settings file, not the user's
        env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": config}
        check = subprocess.run(
            [sys.executable, "-c", ULTRALYTICS_CHECK], capture_output=True, text=True, env=env
        )
    if not ultra or check.returncode != 0:
        why = (check.stderr.strip().splitlines() or ["?"])[-1] if ultra else "pip failed"
        print(f"install_peers: ultralytics not usable ({why}); its tests skip", flush=True)
        return 1 if args.strict else 0
    version = check.stdout.strip().splitlines()[-1]
    print(f"install_peers: ultralytics {version} in {PEERS.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
