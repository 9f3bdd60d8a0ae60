"""Importing emakit's Transformers integration beside a torch Transformers refuses.

Transformers 5 turns its PyTorch part off below torch 2.6 and then fails deep inside its own
modules (``NameError: name 'LRScheduler' is not defined``). emakit's integration says what
is wrong instead: an ``ImportError`` naming both versions and the fix.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from emakit._dist.dtensor import torch_version

MODULE = "emakit.integrations.transformers"
transformers_utils = pytest.importorskip("transformers.utils")


def test_transformers_without_its_pytorch_part_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(transformers_utils, "is_torch_available", lambda: False)
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError) as info:
        importlib.import_module(MODULE)
    msg = str(info.value)
    assert MODULE in msg and torch.__version__ in msg
    assert "torch >= 2.6" in msg and "pip install 'torch>=2.6'" in msg


@pytest.mark.skipif(torch_version() >= (2, 6), reason="Transformers 5 works with this torch")
def test_on_a_torch_transformers_refuses(monkeypatch):
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError, match="needs Transformers' PyTorch part"):
        importlib.import_module(MODULE)
