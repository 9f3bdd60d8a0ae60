"""mypy over ``src/emakit``, started once per pytest session in the background.

A cold mypy run (no cache: a fresh CI checkout) costs tens of seconds of one core, most
of it reading torch's and the integrations' type information. ``conftest.py`` starts it
as a subprocess as soon as collection has selected ``test_mypy_is_clean_on_src``, so it
runs alongside the rest of the suite, and the test only collects the result. The check
itself is unchanged: the whole package, every import followed, the cache in
``.mypy_cache`` (warm reruns take about a second).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import torch

from emakit._dist.dtensor import FSDP2_MIN_TORCH, torch_version

ROOT = Path(__file__).resolve().parents[1]
TEST_NAME = "test_mypy_is_clean_on_src"

#: Why the check does not run on this torch, or None. src is type-checked against torch
#: >= 2.6: older torch's type information lacks the FSDP2 and DTensor names
#: (``torch.distributed.fsdp.fully_shard``, ``torch.distributed.tensor.DTensor``) that emakit
#: uses from 2.6 on, behind version checks.
SKIP = (
    f"src is type-checked against torch >= 2.6; torch {torch.__version__}'s type information "
    "lacks the FSDP2 and DTensor names emakit uses from 2.6 on (behind version checks)"
    if torch_version() < FSDP2_MIN_TORCH
    else None
)

_run: tuple[subprocess.Popen[bytes], IO[bytes]] | None = None


def command() -> list[str]:
    return [
        sys.executable,
        "-m",
        "mypy",
        str(ROOT / "src" / "emakit"),
        "--ignore-missing-imports",
        "--cache-dir",
        str(ROOT / ".mypy_cache"),
    ]


def start() -> None:
    """Start mypy in the background (once)."""
    global _run
    if _run is None:
        out = tempfile.TemporaryFile()  # noqa: SIM115 - read after the run, closed in stop()
        proc = subprocess.Popen(command(), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _run = (proc, out)


def result(timeout: float = 280.0) -> tuple[int, str]:
    """mypy's exit code and output (starting it now if the session did not)."""
    start()
    assert _run is not None
    proc, out = _run
    code = proc.wait(timeout=timeout)
    out.seek(0)
    return code, out.read().decode(errors="replace")


def stop() -> None:
    """End a run the session started but never collected (the test was deselected or
    the session was interrupted)."""
    global _run
    if _run is not None:
        proc, out = _run
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        _run = None
