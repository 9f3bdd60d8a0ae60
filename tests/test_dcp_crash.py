"""Sharded checkpoints survive SIGKILL mid-save (issue 14, item 2).

Two gloo ranks (forked, loopback only) shard a model with FSDP2 and save its EMA with
``save_sharded_ema`` over and over into one checkpoint folder, each save with tensor
values and a step derived from a save id. The parent kills both ranks with SIGKILL at a
random moment (a fixed number of rounds, however slow the machine), then loads the folder
in one process and checks it holds exactly one complete save, never an older one than
before, and that stale version folders do not pile up: a killed save leaves its
half-written version folder, and the next successful save removes it.

Before the fix, DCP overwrote the files of the checkpoint in place, so a kill during a
save left a folder mixing two saves, or one that did not load at all.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _launch import FSDP2_MARK
from _models import LayerNormMLP, seeded
from emakit import EMA
from emakit.distributed import load_sharded_ema, local_tensor, save_sharded_ema

pytestmark = [
    pytest.mark.dist,
    FSDP2_MARK,
    pytest.mark.skipif(
        sys.platform == "win32" or "fork" not in mp.get_all_start_methods(),
        reason="needs fork() and SIGKILL",
    ),
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
    ),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]

ROUNDS = 20
WORLD = 2
WAIT_S = 120  # the most a round waits for its ranks to report (a bound, not a budget)
EMA_KW = dict(beta=0.9, update_after_step=0, update_every=1)


def fill(ema: EMA, save_id: int) -> None:
    """Values that identify the save and the tensor (exact in float32), on local shards."""
    with torch.no_grad():
        for j, p in enumerate(ema.ema_model.parameters()):
            local_tensor(p).fill_(float(save_id * 64 + j))
        ema.step.fill_(save_id)


def saver(rank: int, port: int, folder: Path, first_id: int, conn: Connection | None) -> None:
    """A rank of the saving job (the child); rank 0 reports each completed save on ``conn``
    (its save returns once every rank's data is written)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=60),
        )
        mesh = init_device_mesh("cpu", (WORLD,))
        model = seeded(LayerNormMLP)
        for sub in (model.inp, model.out, model):
            fully_shard(sub, mesh=mesh)
        ema = EMA(model, **EMA_KW)
        ema.update()
        if conn is not None:
            conn.send(first_id - 1)  # ready: the parent times its kill from here
        save_id = first_id
        while True:
            fill(ema, save_id)
            save_sharded_ema(ema, folder)
            if conn is not None:
                conn.send(save_id)
            save_id += 1
    except BaseException:
        (folder.parent / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_id(folder: Path) -> int:
    """The save id the folder holds, after checking every value belongs to that save."""
    ema = EMA(seeded(LayerNormMLP), **EMA_KW)
    load_sharded_ema(ema, folder, no_dist=True)
    save_id = int(ema.step)
    for j, p in enumerate(ema.ema_model.parameters()):
        expected = float(save_id * 64 + j)
        assert bool((p == expected).all()), f"tensor {j} is not all {expected}: mixed saves"
    return save_id


def versions(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def start_round(folder: Path, first_id: int) -> tuple[list[mp.Process], Connection]:
    import torch._dynamo
    import torch.distributed.checkpoint
    import torch.distributed.fsdp  # noqa: F401

    ctx = mp.get_context("fork")
    port = free_port()
    reader, writer = ctx.Pipe(duplex=False)
    procs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        for rank in range(WORLD):
            conn = writer if rank == 0 else None
            procs.append(ctx.Process(target=saver, args=(rank, port, folder, first_id, conn)))
            procs[-1].start()
    writer.close()
    return procs, reader


def next_report(reader: Connection, procs: list[mp.Process], folder: Path) -> int:
    try:
        if reader.poll(WAIT_S):
            return reader.recv()
    except EOFError:
        pass
    errors = [f.read_text() for f in sorted(folder.parent.glob("error-*.txt"))]
    codes = [p.exitcode for p in procs]
    pytest.fail(f"the saving ranks stopped reporting (exit codes {codes}):\n" + "\n".join(errors))


def kill(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(30)
        assert p.exitcode is not None, "a killed rank did not exit"


def test_sigkill_during_sharded_saves_leaves_one_loadable_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    ema = EMA(seeded(LayerNormMLP), **EMA_KW)
    ema.update()
    fill(ema, 0)
    save_sharded_ema(ema, folder)  # the checkpoint every kill must leave loadable
    last = load_id(folder)

    # Calibrate: how long one save of the 2-rank job takes on this machine.
    procs, reader = start_round(folder, 1)
    try:
        next_report(reader, procs, folder)
        start = time.monotonic()
        for _ in range(3):
            next_report(reader, procs, folder)
        one_save = (time.monotonic() - start) / 3
    finally:
        kill(procs)
        reader.close()
    last = max(last, load_id(folder))

    rng = random.Random(0)
    mid_save = allowed = 0
    for rounds in range(1, ROUNDS + 1):  # a fixed number of kills
        first = rounds * 1000
        procs, reader = start_round(folder, first)
        try:
            assert next_report(reader, procs, folder) == first - 1  # ready
            # A random moment within the next few saves: during a write, the .metadata,
            # the pointer switch, the clean-up, or between saves.
            time.sleep(rng.uniform(0.0, 3 * one_save))
        finally:
            kill(procs)
        completed = 0
        with contextlib.suppress(EOFError, OSError):  # the killed writer's end is closed
            while reader.poll(0):
                completed = max(completed, reader.recv())
        reader.close()
        save_id = load_id(folder)
        assert save_id >= last, (save_id, last)  # never goes backwards
        last = save_id
        # A killed save leaves at most its own version folder; each successful save
        # removes earlier ones, so leftovers add up only over rounds with no save.
        stale = len(versions(folder)) - 1
        mid_save += stale > 0
        allowed = 1 if completed >= first else allowed + 1
        assert stale <= allowed, (versions(folder), allowed)
    # The next successful save removes whatever the last kill left.
    fill(ema, 10**6)
    save_sharded_ema(ema, folder)
    assert load_id(folder) == 10**6
    assert len(versions(folder)) == 1
    print(f"{ROUNDS} kills, {mid_save} left a half-written version; one save {one_save:.3f} s")
