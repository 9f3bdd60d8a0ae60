"""The frameworks the integration and comparison tests import, or a skip that says why not.

The test extra installs on every torch emakit supports, but a framework can install beside
a torch it does not work with: on torch 2.4, transformers 5 disables its PyTorch part (it
needs torch >= 2.6) and then fails at import with a ``NameError``, peft and trl import
transformers, and diffusers 0.4x calls ``torch.accelerator`` (new in torch 2.6).
``pytest.importorskip`` only skips on ``ImportError``.

`need(module)` imports ``module`` (and, for transformers, the part of it emakit's
integration imports). It skips where the module is not installed, and where the import
fails on a torch older than the framework's floor (`TORCH_FLOOR`), naming the framework,
its version, the torch and the error (`refusal`). On a torch at or above the floor, an
error is raised as it is: a real failure.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from types import ModuleType

import pytest
import torch

from emakit._dist.dtensor import torch_version

__all__ = ["TORCH_FLOOR", "need", "refusal"]

#: framework -> the oldest torch it works with (the releases the test extra resolves).
#: transformers 5 says so at import ("PyTorch >= 2.6 is required"); peft and trl import
#: transformers; diffusers calls ``torch.accelerator``, which torch 2.6 added.
TORCH_FLOOR = {
    "transformers": (2, 6),
    "peft": (2, 6),
    "trl": (2, 6),
    "diffusers": (2, 6),
}

#: emakit's modules that import a framework when imported: a docs block that imports one
#: needs that framework.
_USES = {"emakit.integrations.transformers": "transformers"}

#: A module to import after the framework itself, where importing the framework alone does
#: not show whether it works (transformers imports lazily).
_PROBE = {"transformers": "transformers.trainer_pt_utils"}


def refusal(module: str) -> str | None:
    """Why ``module`` does not work with this torch, or None: the reason where it is
    installed, this torch is older than its framework's floor and importing it fails."""
    module = _USES.get(module, module)
    framework = module.split(".")[0]
    floor = TORCH_FLOOR.get(framework)
    if floor is None or torch_version() >= floor or importlib.util.find_spec(framework) is None:
        return None
    try:
        importlib.import_module(module)
        if framework in _PROBE:
            importlib.import_module(_PROBE[framework])
    except Exception as e:
        return (
            f"{framework} {metadata.version(framework)} does not work with torch "
            f"{torch.__version__} (it needs torch >= {'.'.join(map(str, floor))}): "
            f"{type(e).__name__}: {e}"
        )
    return None


def need(module: str) -> ModuleType:
    """``module`` imported, or the calling test (or test module) skipped, saying why: it is
    not installed, or it does not work with this torch (`refusal`)."""
    reason = refusal(module)
    if reason is not None:
        raise pytest.skip.Exception(reason, allow_module_level=True)
    imported = pytest.importorskip(module)
    framework = module.split(".")[0]
    if framework in _PROBE:
        importlib.import_module(_PROBE[framework])
    return imported
