"""Let timm import beside a CPU torch, in the test process only.

timm imports torchvision (for its data transforms), and PyPI's torchvision wheel for Linux
is a CUDA build: beside a CPU torch its C++ extension (``torchvision/_C.so``) does not
load. torchvision's Python code still works, except that at import it registers fake
(meta) kernels for two operators the extension would have defined, ``torchvision::nms``
and ``torchvision::qnms``, and that fails when they do not exist. The comparison tests
never run those operators, so when the extension does not load, this defines their
schemas in a ``torch.library.Library`` owned by the test process; torchvision then
imports, and so does timm. Nothing is defined when torchvision is absent or its
extension loads. ``tools/install_peers.py`` runs the same check after installing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: torch.library.Library | None = None


def allow_torchvision_without_its_extension() -> bool:
    """Define torchvision's two operator schemas when its extension cannot load.

    Returns True when it defined them (torchvision is installed and its ``_C`` extension
    fails to load beside this torch), False otherwise. Idempotent.
    """
    global _library
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
