"""Shared test setup.

The shared model builders and the reference EMA step live in the plain module
``tests/_models.py`` (``from _models import bn_mlp, ...``), because a conftest is not
reliably importable by name. ``tests/`` has no ``__init__.py``, so pytest's default
``prepend`` import mode already puts it on ``sys.path`` for a full run and for a single
file; this keeps that true under ``--import-mode=importlib`` as well. Forked and spawned
workers inherit ``sys.path``, so they can unpickle ``_models`` classes too.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
