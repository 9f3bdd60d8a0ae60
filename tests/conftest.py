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

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import _peers  # noqa: E402

# timm's comparison tests beside a CPU torch with PyPI's (CUDA) torchvision: see _peers.
_peers.allow_timm()


def pytest_collection_finish(session) -> None:
    # mypy is the suite's slowest check on a cold cache: run it alongside the other tests.
    import importlib.util

    import _mypy_run

    selected = any(item.name == _mypy_run.TEST_NAME for item in session.items)
    if selected and _mypy_run.SKIP is None and importlib.util.find_spec("mypy") is not None:
        _mypy_run.start()


def pytest_unconfigure(config) -> None:
    import _mypy_run

    _mypy_run.stop()


@pytest.fixture(scope="session")
def shm_op() -> bool:
    """Whether DeepSpeed's shm op is built (built here once per session if not; see
    ``tests/_deepspeed.py``)."""
    import _deepspeed

    return _deepspeed.build_shm_op()
