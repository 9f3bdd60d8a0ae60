"""timm for the comparison tests beside a CPU torch, seen by the test process only.

timm imports torchvision, and every torchvision wheel pins one torch; PyPI's Linux wheel is
moreover a CUDA build whose C++ extension (``torchvision/_C.so``) does not load beside a
CPU torch. Installed into the environment, such a torchvision would break every other
library that imports it when present (transformers, for one). So ``tools/install_peers.py``
puts timm and the torchvision release made for the installed torch into ``.peers/`` at the
repository root, outside site-packages, and `allow_timm()` adds that folder to this
process's ``sys.path`` (after everything else). When torchvision's extension does not load,
it also defines the schemas of the two operators torchvision registers fake kernels for at
import (``torchvision::nms``, ``torchvision::qnms``), in a ``torch.library.Library`` this
process owns; the tests never run them. Then torchvision's Python code imports, and timm.
Nothing happens where ``.peers/`` is absent and torchvision is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

PEERS = Path(__file__).resolve().parents[1] / ".peers"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None


def child_pythonpath(*first: str) -> str:
    """A ``PYTHONPATH`` for a child process: ``first``, then this process's path without
    ``.peers/`` (a child that has not called `allow_timm()` could not import its
    torchvision, and libraries that import torchvision when present would fail)."""
    return os.pathsep.join([*first, *(p for p in sys.path if p != str(PEERS))])


def allow_timm() -> bool:
    """Make ``import timm`` work in this process where ``.peers/`` holds it.

    Returns True when it defined torchvision's two operator schemas (its extension does not
    load beside this torch), False otherwise. Idempotent.
    """
    global _library
    if PEERS.is_dir() and str(PEERS) not in sys.path:
        sys.path.append(str(PEERS))
    if _library is not None:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    extension = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    if extension is None:
        return False
    try:
        torch.ops.load_library(str(extension))
        return False
    except (OSError, RuntimeError):
        pass
    if hasattr(torch.ops.torchvision, "nms"):
        return False
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)
    return True
