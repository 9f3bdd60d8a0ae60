"""Shared test setup: fixtures used by several test modules.

The shared model builders, training loops and the reference EMA step live in the plain module
``tests/_models.py`` (``from _models import bn_mlp, ...``), because a conftest is not
reliably importable by name. ``tests/`` has no ``__init__.py``, so pytest's default
``prepend`` import mode already puts it on ``sys.path`` for a full run and for a single
file; this keeps that true under ``--import-mode=importlib`` as well. Forked and spawned
workers inherit ``sys.path``, so they can unpickle ``_models`` classes too.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a whole module (restored after it), for modules of tiny
    tensors: there, threads only add synchronisation overhead, which dominates badly on a
    loaded 2-core machine (OpenMP threads spin when oversubscribed). A module asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `TinyLora` run's snapshot folder (``tests/_models.py``): 16 steps, snapshots every
    4, the frozen base in a side file. Read-only: tests that change files take
    `tiny_lora_folder`."""
    import torch

    from _models import TINY_LORA_POSTHOC, TINY_LORA_SGD, TinyLora, train
    from emakit import PostHocEMA

    folder = tmp_path_factory.mktemp("tiny_lora_run") / "snaps"
    torch.manual_seed(0)
    net = TinyLora()
    ema = PostHocEMA(net, checkpoint_folder=folder, **TINY_LORA_POSTHOC)
    train(net, [ema], range(16), **TINY_LORA_SGD)
    ema.release_folder()
    return folder


@pytest.fixture
def tiny_lora_folder(tiny_lora_run: Path, tmp_path: Path) -> Path:
    """A fresh copy of `tiny_lora_run`'s folder."""
    dest = tmp_path / "snaps"
    shutil.copytree(tiny_lora_run, dest, ignore=shutil.ignore_patterns(".emakit-posthoc.lock"))
    return dest
