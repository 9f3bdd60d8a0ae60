"""DeepSpeed on the CPU for the tests: the shm op's build, and one rank's start-up.

DeepSpeed runs here with ``DS_ACCELERATOR=cpu``, the gloo backend and Adam with
``torch_adam: true``. Its shm op is built once per machine (minutes on two busy cores);
the session fixture ``shm_op`` (``tests/conftest.py``) builds it, and a rank starts
without it where it could not be built (DeepSpeed then uses ``torch.distributed``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from typing import Any

import pytest

from _launch import DIST_MARKS

__all__ = ["DEEPSPEED_MARKS", "WARMUP_S", "build_shm_op", "start_rank"]

#: Seconds the shm op's build may take (once per machine).
WARMUP_S = 900

#: The marks of a module that launches DeepSpeed ranks.
DEEPSPEED_MARKS = [
    *DIST_MARKS,
    pytest.mark.timeout(1300),  # the first test waits for the op's build and the job
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
    ),
]


def build_shm_op() -> bool:
    """Whether DeepSpeed's shm op is built (built now, in a child process, if not)."""
    code = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=WARMUP_S
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def start_rank(rank: int, world: int, shm: bool) -> Any:
    """Start DeepSpeed's process group on this rank (gloo, CPU); the ``deepspeed`` module."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world))
    import deepspeed

    if not shm:  # the op could not be built here: DeepSpeed then uses torch.distributed
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed
