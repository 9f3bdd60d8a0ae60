"""Crash safety: SIGKILL a process in the middle of saves, many times.

A child process saves over and over, each save tagged with a distinct id (in the
safetensors header, and inside the torch file) and with tensor values derived from that
id; the parent kills it with SIGKILL at a random moment, then checks that each file loads
and holds exactly one complete save, that saves never go backwards, and that temporary
files do not pile up: a SIGKILL runs no cleanup, so a killed write can leave one
temporary file, and the next successful save in the folder removes it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from emakit import EMA
from emakit._files.atomic import TEMP_PREFIX, atomic_write
from emakit.checkpoint import load_ema_weights, save_ema_weights

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or "fork" not in mp.get_all_start_methods(),
    reason="needs fork() and SIGKILL",
)

ROUNDS = 20
TENSORS_PER_SAVE = 8


def make_ema() -> EMA:
    # 8 x 512 x 256 float32 (+ biases): about 4 MiB per file, some ms per save.
    net = nn.Sequential(*(nn.Linear(256, 512) for _ in range(TENSORS_PER_SAVE)))
    return EMA(net)


def fill(ema: EMA, save_id: int) -> None:
    """Give every tensor a value that identifies the save and the tensor (exact in fp32)."""
    with torch.no_grad():
        for j, p in enumerate(ema.ema_model.parameters()):
            p.fill_(float(save_id * 64 + j))


def save_both(ema: EMA, folder: Path, save_id: int) -> None:
    fill(ema, save_id)
    save_ema_weights(ema, folder / "ema.safetensors", metadata={"save_id": str(save_id)})
    state = {"save_id": save_id, "weights": ema.ema_model.state_dict()}
    atomic_write(folder / "state.pt", lambda f: torch.save(state, f))


def saver(ema: EMA, folder: Path, first_id: int, done: mp.Value, started: Any) -> None:
    """The child: saves until it is killed; ``started`` is set before the first save."""
    torch.set_num_threads(1)  # after fork, as DataLoader workers do
    done.value = first_id - 1
    started.set()  # the parent times its kill from here
    save_id = first_id
    while True:
        save_both(ema, folder, save_id)
        done.value = save_id
        save_id += 1


def check_values(weights: dict[str, torch.Tensor], save_id: int, where: str) -> None:
    names = [f"{i}.{w}" for i in range(TENSORS_PER_SAVE) for w in ("weight", "bias")]
    assert set(weights) == set(names), f"{where}: {sorted(weights)}"
    for j, t in enumerate(weights[n] for n in names):  # named_parameters() order
        expected = float(save_id * 64 + j)
        assert bool((t == expected).all()), f"{where}: tensor {j} is not all {expected}"


def read_ids(folder: Path) -> tuple[int, int]:
    """The save ids in the two files, after checking each file is one complete save."""
    path = folder / "ema.safetensors"
    with safetensors.safe_open(str(path), "pt") as f:
        st_id = int(f.metadata()["save_id"])
    check_values(safetensors.torch.load_file(path), st_id, str(path))
    state = torch.load(folder / "state.pt", weights_only=True)
    check_values(state["weights"], state["save_id"], "state.pt")
    return st_id, state["save_id"]


def temps(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if TEMP_PREFIX in p.name]


def test_sigkill_mid_save_leaves_one_complete_save(tmp_path):
    ema = make_ema()
    durations = []
    for save_id in range(4):  # the first is a warm-up
        start = time.perf_counter()
        save_both(ema, tmp_path, save_id)
        durations.append(time.perf_counter() - start)
    one_save = sorted(durations[1:])[1]
    last = read_ids(tmp_path)
    rng = random.Random(0)
    ctx = mp.get_context("fork")
    rounds = left_temp = allowed = 0
    while rounds < ROUNDS:  # a fixed number of kills, however slow the machine
        rounds += 1
        # lock=False: a child killed while holding a Value's lock would leave the parent
        # blocked forever on its next read; an aligned 8-byte store/load needs no lock.
        done = ctx.Value("q", -1, lock=False)
        # set once, before any save: the child is never killed while it holds the lock
        started = ctx.Event()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
            child = ctx.Process(target=saver, args=(ema, tmp_path, rounds * 1000, done, started))
            child.start()
        # Kill somewhere in the first few saves (during a write, a rename or between saves),
        # timed from the moment the child reports it started, not from the fork. The random
        # delay is what picks the moment: it is the thing under test, not a wait.
        assert started.wait(60), "the saving child never started"
        time.sleep(rng.uniform(0.0, 4 * one_save))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        ids = read_ids(tmp_path)
        assert ids[0] >= last[0] and ids[1] >= last[1], (ids, last)  # never goes backwards
        last = ids
        # A killed write leaves at most its own temporary file (the child writes one file
        # at a time), and each successful save removes earlier leftovers; so leftovers
        # can only add up over children killed before completing any save.
        allowed = 1 if done.value >= rounds * 1000 else allowed + 1
        left = temps(tmp_path)
        assert len(left) <= allowed, (left, allowed)
        left_temp += bool(left)
    # The files are also what emakit reads back.
    fresh = make_ema()
    meta = load_ema_weights(fresh, tmp_path / "ema.safetensors")
    check_values(fresh.ema_model.state_dict(), int(meta["save_id"]), "load_ema_weights")
    # The next successful save cleans up whatever the last kill left.
    save_both(ema, tmp_path, 10**5)
    assert temps(tmp_path) == []
    assert read_ids(tmp_path) == (10**5, 10**5)
    print(f"{rounds} kills, {left_temp} left a temporary file; one save took {one_save:.3f} s")


def test_checkpoint_inside_the_window_lags_one_update_and_one_update_repairs_it():
    """docs/resume.md: a checkpoint taken between optimizer.step() and ema.update()."""
    kw = dict(beta=0.9, update_after_step=2, update_every=3)

    def step(net: nn.Module, k: int) -> None:
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.full_like(p, 0.01 * (k % 7) - 0.03))

    def fresh() -> tuple[nn.Module, EMA]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        return net, EMA(net, **kw)

    net_a, ema_a = fresh()  # uninterrupted
    for k in range(1, 21):
        step(net_a, k)
        ema_a.update()
    net_b, ema_b = fresh()
    for k in range(1, 10):
        step(net_b, k)
        ema_b.update()
    step(net_b, 10)  # optimizer.step() of step 10, then a checkpoint before ema.update()
    ckpt = {"step": 10, "model": net_b.state_dict(), "ema": ema_b.state_dict()}
    lagging_net, lagging = fresh()
    lagging_net.load_state_dict(ckpt["model"])
    lagging.load_state_dict(ckpt["ema"])
    net_c, ema_c = fresh()
    net_c.load_state_dict(ckpt["model"])
    ema_c.load_state_dict(ckpt["ema"])
    assert ckpt["step"] - int(ema_c.step) == 1
    ema_c.update()  # the repair
    for k in range(11, 21):
        step(net_c, k)
        ema_c.update()
        step(lagging_net, k)
        lagging.update()
    assert int(ema_c.step) == int(ema_a.step) == 20 and int(lagging.step) == 19
    for name, v in ema_a.ema_model.state_dict().items():
        assert torch.equal(ema_c.ema_model.state_dict()[name], v), name
    assert not torch.equal(lagging.ema_model[0].weight, ema_a.ema_model[0].weight)
