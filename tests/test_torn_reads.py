"""Torn reads: a reader sees exactly one complete save while another process keeps saving.

A child process saves to one path over and over, each save tagged with an id (in the
header) and with tensor values derived from that id, and with header metadata of varying
length (so consecutive saves put their data at different offsets). The parent loads the
same path a fixed number of times and checks that every load is one complete save: the
header's id and every value agree. Before emakit read header and data through one open
file, the header came from one open and the data from a second open by name, so a load
could pair one save's header with another save's data.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from emakit import EMA, EMAError
from emakit.checkpoint import load_ema_weights, save_ema_weights

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or "fork" not in mp.get_all_start_methods(),
    reason="needs fork() and SIGKILL",
)

LOADS = 3000  # a fixed count of loads, however fast or slow the machine (~1 s)
TENSORS = 4


def make_ema() -> EMA:
    return EMA(nn.Sequential(*(nn.Linear(8, 8) for _ in range(TENSORS))))


def fill(ema: EMA, save_id: int) -> None:
    with torch.no_grad():
        for j, p in enumerate(ema.ema_model.parameters()):
            p.fill_(float(save_id * 64 + j))


def saver(path: Path, started: mp.synchronize.Event) -> None:  # the child
    torch.set_num_threads(1)
    ema = make_ema()
    save_id = 1
    while True:
        fill(ema, save_id)
        # Header lengths vary from save to save, so data offsets differ between saves.
        meta = {"save_id": str(save_id), "pad": "x" * (save_id * 13 % 61)}
        save_ema_weights(ema, path, metadata=meta)
        if save_id == 2:
            started.set()
        save_id += 1


def test_loads_never_mix_two_saves(tmp_path: Path) -> None:
    path = tmp_path / "ema.safetensors"
    ctx = mp.get_context("fork")
    started = ctx.Event()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        child = ctx.Process(target=saver, args=(path, started), daemon=True)
        child.start()
    try:
        assert started.wait(60), "the saving child never completed two saves"
        ema = make_ema()
        torn, seen = [], set()
        for _ in range(LOADS):
            try:
                meta = load_ema_weights(ema, path)
            except EMAError as e:  # e.g. a header whose data the second open lacked
                torn.append(str(e))
                continue
            save_id = int(meta["save_id"])
            seen.add(save_id)
            for j, p in enumerate(ema.ema_model.parameters()):
                if not bool((p == float(save_id * 64 + j)).all()):
                    torn.append((save_id, j, p.flatten()[:3].tolist()))
                    break
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert len(seen) > 1, "the child never replaced the file during the loads"
    assert not torn, f"{len(torn)} of {LOADS} loads mixed two saves, e.g. {torn[:3]}"
