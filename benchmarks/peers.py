"""timm in the benchmarks beside a CPU torch, set up as the tests set it up.

PyPI's torchvision wheel (which timm imports) is a CUDA build whose C++ extension does not
load beside a CPU torch; ``tests/_peers.py`` then defines the two operator schemas
torchvision expects from it, in this process only. Call `allow_timm()` before importing
timm; it does nothing where torchvision is absent or its extension loads.
"""

from __future__ import annotations

import sys
from pathlib import Path


def allow_timm() -> None:
    """Let ``import timm`` work beside a CPU torch (see ``tests/_peers.py``)."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    import _peers

    _peers.allow_timm()
